"""Run by test_distributed.py: W CPU ranks over gloo on loopback fetch rows of a partitioned real table.

``python dist_worker.py WORLD PORT OUT_DIR DATASET [METHODS]``: the table (real rows) is split by a random owner
assignment; rank r stores its partition with codec method ``METHODS[r % len(METHODS)]`` (comma-separated; default
``ibp,raw``: even ranks IBP-compressed, odd ranks raw, mixed on purpose; ``exponent`` and ``raw`` are methods too).
Each rank fetches a seeded random batch (duplicates, every owner) and one empty batch, and saves ids + result bytes
+ byte counters + its codec method.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, out_dir: str, dataset: str, methods: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from ibpcache import Codec
        from ibpcache.cache.distributed import DistributedRows, PartitionBook
        from ibpcache.datasets import load_rows

        table = load_rows(dataset)
        owner = torch.randint(0, world, (table.shape[0],), generator=torch.Generator().manual_seed(0))
        book = PartitionBook.from_owner(owner, world)
        mine = table[book.rows_of(rank)].contiguous()
        method = methods[rank % len(methods)]
        local = mine if method == "raw" else Codec.fit(mine, method=method).compress(mine, layout="packed", pin=False)
        rows = DistributedRows(local, book)
        gen = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(0, table.shape[0], (3000 + 500 * rank,), generator=gen)
        got = rows.fetch(ids)
        empty = rows.fetch(torch.empty(0, dtype=torch.int64))
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), ids=ids.numpy(), got=got.view(torch.uint8).numpy(),
                 empty=np.array(empty.shape), sent=rows.bytes_sent, received=rows.bytes_received,
                 row_bytes=rows.row_bytes, method=method,
                 codecs=np.array([c.method if c is not None else "raw" for c in rows.codecs]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    world, port, out_dir, dataset = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    methods = (sys.argv[5] if len(sys.argv) > 5 else "ibp,raw").split(",")
    mp.spawn(_worker, args=(world, port, out_dir, dataset, methods), nprocs=world, join=True)
