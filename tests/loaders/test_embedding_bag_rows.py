"""Embedding bags over an existing ``CompressedRows`` (``_weight=rows``): one host store, no second copy.

Real MiniLM rows. The module serves the given bytes (same address), outputs equal ``embedding_bag`` over the
dense table bit for bit, training is refused with a clear error (the bytes belong to their owner), and a store
shared in this process and attached in another serves that process's embedding bag exactly; a replaced shared
store raises StaleStoreError instead of returning a mix.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROOT = Path(__file__).resolve().parents[2]


def _rows(w: torch.Tensor, layout: str = "inplace"):
    from ibpcache import Codec

    return Codec.fit(w).compress(w, layout=layout, pin=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
def test_serves_the_given_rows_exactly_without_copying(minilm: torch.Tensor, device: str) -> None:
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    w = minilm[:2000, :96].contiguous()
    rows = _rows(w)
    m = CachedEmbeddingBag(2000, 96, _weight=rows, mode="sum", cache_ratio=0.05, device=device)
    store = m.cache_weight_mgr.store
    assert store.read_only and store.data.data_ptr() == rows.data.data_ptr()  # on CUDA: the once-pinned bytes
    assert m.stats()["host_compress"] and m.stats()["host_ratio"] == pytest.approx(rows.ratio, rel=1e-6)
    ids = torch.randint(0, 2000, (300, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = m(ids.to(device))
    assert torch.equal(_bits(got), _bits(torch.nn.functional.embedding_bag(ids, w, mode="sum")))


def test_table_batched_over_one_store(minilm: torch.Tensor) -> None:
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    sizes = [700, 300, 1000]
    w = minilm[:2000, :64].contiguous()
    m = TableBatchedCachedEmbeddingBag(sizes, 64, _weight=_rows(w), mode="sum", cache_ratio=0.05, device="cpu")
    local = torch.stack([torch.randint(0, n, (50,)) for n in sizes], 1)
    with torch.no_grad():
        got = m(local)
    glob = (local + torch.tensor([0, 700, 1000])).reshape(-1, 1)
    want = torch.nn.functional.embedding_bag(glob, w, mode="sum").reshape(50, -1)
    assert torch.equal(_bits(got), _bits(want))


def test_training_and_bad_rows_are_refused_clearly(minilm: torch.Tensor) -> None:
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    w = minilm[:500, :32].contiguous()
    m = CachedEmbeddingBag(500, 32, _weight=_rows(w), mode="sum", device="cpu")
    with pytest.raises(RuntimeError, match="read-only.*inference"):
        m(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="layout='inplace'"):
        CachedEmbeddingBag(500, 32, _weight=_rows(w, "packed"), device="cpu")
    with pytest.raises(ValueError, match="do not match num_embeddings"):
        CachedEmbeddingBag(400, 32, _weight=_rows(w), device="cpu")
    with pytest.raises(TypeError, match="hold torch.float32"):
        CachedEmbeddingBag(500, 32, _weight=_rows(w), dtype=torch.float16, device="cpu")
    m.load_state_dict({"weight": w * 2})  # a private copy from here on: writable, trainable
    assert not m.cache_weight_mgr.store.read_only
    m(torch.tensor([[1, 2]])).sum().backward()


_CLIENT = """
import sys, numpy as np, torch
from ibpcache import CompressedRows
from ibpcache.loaders.embedding_bag import CachedEmbeddingBag
rows = CompressedRows.attach(sys.argv[1])
m = CachedEmbeddingBag(rows.n_rows, rows.shape[1], _weight=rows, mode="sum", cache_ratio=0.05, device="cpu")
ids = torch.randint(0, rows.n_rows, (400, 3), generator=torch.Generator().manual_seed(int(sys.argv[2])))
with torch.no_grad():
    out = m(ids)
assert m.cache_weight_mgr.store.data.data_ptr() == rows.data.data_ptr()
np.savez(sys.argv[3], ids=ids.numpy(), out=out.view(torch.uint8).numpy())
"""


def test_shared_store_attached_in_another_process(minilm: torch.Tensor, store_name: str, tmp_path: Path) -> None:
    import os

    from ibpcache import CompressedRows
    from ibpcache._shm import StaleStoreError
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    w = minilm[:3000, :128].contiguous()
    handle = _rows(w).share(store_name)
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        res = subprocess.run([sys.executable, "-c", _CLIENT, store_name, "5", str(tmp_path / "c.npz")], env=env,
                             capture_output=True, timeout=180)
        assert res.returncode == 0, res.stderr.decode()[-2000:]
        got = np.load(tmp_path / "c.npz")
        want = torch.nn.functional.embedding_bag(torch.from_numpy(got["ids"]), w, mode="sum")
        assert np.array_equal(got["out"], want.view(torch.uint8).numpy())
        # here too: attach, serve, then the store is replaced -> a clear error, never rows of two generations
        m = CachedEmbeddingBag(3000, 128, _weight=CompressedRows.attach(store_name), mode="sum", device="cpu")
        with torch.no_grad():
            m(torch.tensor([[0, 1]]))
        replaced = _rows(w * 2).share(store_name)
        try:
            with pytest.raises(StaleStoreError), torch.no_grad():
                m(torch.tensor([[0, 1]]))
        finally:
            replaced.unlink()
            replaced.close()
    finally:
        handle.close()
