"""Run by test_distributed.py: W CPU ranks over gloo on loopback fetch rows of a partitioned real table.

``python dist_worker.py WORLD PORT OUT_DIR DATASET``: the table (real rows) is split by a random owner assignment;
even ranks store their partition compressed, odd ranks raw (mixed on purpose). Each rank fetches a seeded
random batch (duplicates, every owner) and one empty batch, and saves ids + result bytes + byte counters.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, out_dir: str, dataset: str) -> None:
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
        local = Codec.fit(mine).compress(mine, layout="packed", pin=False) if rank % 2 == 0 else mine
        rows = DistributedRows(local, book)
        gen = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(0, table.shape[0], (3000 + 500 * rank,), generator=gen)
        got = rows.fetch(ids)
        empty = rows.fetch(torch.empty(0, dtype=torch.int64))
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), ids=ids.numpy(), got=got.view(torch.uint8).numpy(),
                 empty=np.array(empty.shape), sent=rows.bytes_sent, received=rows.bytes_received,
                 row_bytes=rows.row_bytes)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    world, port, out_dir, dataset = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mp.spawn(_worker, args=(world, port, out_dir, dataset), nprocs=world, join=True)
