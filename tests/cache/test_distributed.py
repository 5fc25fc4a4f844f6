"""Partitioned rows over torch.distributed (gloo, 2 CPU ranks on loopback): fetch is bit-exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]



def test_partition_book_maps_every_row_once() -> None:
    from ibpcache.cache.distributed import PartitionBook

    owner = torch.tensor([1, 0, 1, 2, 0, 1])
    book = PartitionBook.from_owner(owner, 3)
    assert book.local.tolist() == [0, 0, 1, 0, 1, 2]
    for r in range(3):
        assert torch.equal(book.owner[book.rows_of(r)], torch.full((int((owner == r).sum()),), r, dtype=torch.int32))
        assert torch.equal(book.local[book.rows_of(r)], torch.arange(int((owner == r).sum())))
    c = PartitionBook.contiguous(10, 4)
    assert c.owner.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    with pytest.raises(ValueError, match="owner ranks"):
        PartitionBook.from_owner(torch.tensor([0, 3]), 3)


def test_two_gloo_ranks_fetch_exact_rows(real_rows: Any, tmp_path: Path, free_port: int) -> None:
    table = real_rows("cora")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("dist_worker.py")), "2", str(free_port),
                          str(tmp_path), "cora"], env=env, capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    raw = table.contiguous().view(torch.uint8).reshape(table.shape[0], -1).numpy()
    for rank in range(2):
        r = np.load(tmp_path / f"rank{rank}.npz")
        assert np.array_equal(r["got"].reshape(len(r["ids"]), -1), raw[r["ids"]])
        assert tuple(r["empty"]) == (0, table.shape[1])
    # rank 0 stores its partition compressed and sends it so; rank 1 stores and sends raw rows
    owner = torch.randint(0, 2, (table.shape[0],), generator=torch.Generator().manual_seed(0)).numpy()
    rs = [np.load(tmp_path / f"rank{k}.npz") for k in range(2)]
    served = [sum(int((owner[r["ids"]] == k).sum()) for r in rs) for k in range(2)]
    row_bytes = int(rs[0]["row_bytes"])
    assert int(rs[1]["sent"]) == served[1] * row_bytes
    assert 0 < int(rs[0]["sent"]) < served[0] * row_bytes
    assert int(rs[0]["received"]) + int(rs[1]["received"]) == int(rs[0]["sent"]) + int(rs[1]["sent"])


def test_ranks_of_different_codecs_exchange_stored_rows(real_rows: Any, tmp_path: Path, free_port: int) -> None:
    """Rank 0 stores its partition exponent-coded, rank 1 IBP-coded (dense MiniLM rows): each rebuilds the other's
    codec from header() + sections() and decodes the rows it receives in their stored (shorter) form."""
    table = real_rows("minilm")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("dist_worker.py")), "2", str(free_port),
                          str(tmp_path), "minilm", "exponent,ibp"], env=env, capture_output=True, timeout=600)
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    raw = table.contiguous().view(torch.uint8).reshape(table.shape[0], -1).numpy()
    owner = torch.randint(0, 2, (table.shape[0],), generator=torch.Generator().manual_seed(0)).numpy()
    rs = [np.load(tmp_path / f"rank{k}.npz") for k in range(2)]
    for r in rs:
        assert np.array_equal(r["got"].reshape(len(r["ids"]), -1), raw[r["ids"]])
        assert list(r["codecs"]) == ["exponent", "ibp"]
    served = [sum(int((owner[r["ids"]] == k).sum()) for r in rs) for k in range(2)]
    for k in range(2):  # both send coded rows: fewer bytes than raw ones
        assert 0 < int(rs[k]["sent"]) < served[k] * int(rs[k]["row_bytes"]) / 1.1


def test_single_rank_serves_an_attached_shared_store(real_rows: Any, tmp_path: Path) -> None:
    import os as _os
    import secrets

    import torch.distributed as dist

    from ibpcache import Codec, CompressedRows
    from ibpcache.cache.distributed import DistributedRows, PartitionBook

    table = real_rows("pubmed")
    name = f"test-dist-{_os.getpid()}-{secrets.token_hex(3)}"
    seg = Codec.fit(table).compress(table, layout="inplace", pin=False).share(name)
    store = dist.FileStore(str(tmp_path / "pg"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        rows = DistributedRows(CompressedRows.attach(name), PartitionBook.contiguous(table.shape[0], 1))
        ids = torch.randint(0, table.shape[0], (5000,), generator=torch.Generator().manual_seed(5))
        assert torch.equal(rows.fetch(ids).view(torch.uint8), table[ids].view(torch.uint8))
        with pytest.raises(ValueError, match="partition book"):
            DistributedRows(table, PartitionBook.contiguous(table.shape[0], 2))
    finally:
        dist.destroy_process_group()
        seg.unlink()
        seg.close()
