"""Run by test_partitioned.py: W ranks share one compressed store and a node-wide partitioned cache.

``python partitioned_worker.py WORLD PORT OUT_DIR BACKEND [MODE]``: BACKEND ``gloo`` runs CPU caches, ``nccl`` one GPU
per rank. MODE ``ibp`` (default) / ``exponent``: rank 0 codes real rows (bundled Cora) with that method and shares
them, every rank attaches; ``auto``: every rank passes the rows themselves with ``codec="auto"`` and
``compress_host="auto"`` (rank 0 plans, the others follow). Every rank then builds its share of the
cache (hotness: a seeded power law over a random order), fetches a seeded batch (duplicates, rows cached here, on
the peer and nowhere) and an empty one, then tries bad ids (all ranks together, then on one rank only:
every rank must raise and carry on). Saves what the test checks.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, out_dir: str, backend: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seg = None
    try:
        from ibpcache import Codec, CompressedRows
        from ibpcache.cache.partitioned import PartitionedFeatureCache
        from ibpcache.datasets import load_cora
        from ibpcache.errors import InvalidIdsError

        table = load_cora().features
        name = f"ptest-{port}"
        if rank == 0 and mode != "auto":
            seg = Codec.fit(table, method=mode).compress(table, layout="inplace", pin=False).share(name)
        dist.barrier()
        rows = table if mode == "auto" else CompressedRows.attach(name)
        kwargs = {"codec": "auto", "compress_host": "auto"} if mode == "auto" else {}
        gen = torch.Generator().manual_seed(7)
        hotness = (torch.randperm(table.shape[0], generator=gen) + 1.0) ** -1.2
        cache = PartitionedFeatureCache(rows, hotness, budget_bytes=0.004 if mode != "exponent" else 0.02,
                                        device=device, **kwargs)
        ids = torch.randint(0, table.shape[0], (4000 + 300 * rank,), generator=torch.Generator().manual_seed(rank))
        hot_ids = torch.argsort(hotness, descending=True)[:200]
        ids = torch.cat([ids, hot_ids, hot_ids[:50]])
        got = cache.fetch(ids.to(device))
        empty = cache.fetch(torch.empty(0, dtype=torch.int64, device=device))
        st = cache.stats()  # before the bad fetches: those raise before counting anything
        bad = "none"
        try:
            cache.fetch(torch.tensor([0, table.shape[0]], device=device))
        except InvalidIdsError as exc:
            bad = str(exc)
        # only rank 1 passes a bad id: every rank must raise (none left waiting in a collective), then go on
        one_bad = "none"
        try:
            cache.fetch(torch.tensor([1, -3 if rank == 1 else 2], device=device))
        except InvalidIdsError as exc:
            one_bad = str(exc)
        after = cache.fetch(hot_ids[:20].to(device))
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), ids=ids.numpy(), got=got.cpu().view(torch.uint8).numpy(),
                 empty=np.array(empty.shape), cached=cache.cache.cached_ids.cpu().numpy(),
                 node_cached=st["rows_cached_on_node"], here=st["rows_cached_here"], peer_rows=st["peer_rows"],
                 served_rows=st["served_rows"], bad=np.array(bad), one_bad=np.array(one_bad),
                 after=after.cpu().view(torch.uint8).numpy(), after_ids=hot_ids[:20].numpy(),
                 counts=np.array([st["requests"], st["local_hits"], st["peer_hits"], st["host_misses"]]),
                 hit_rate=st["hit_rate"], bytes_sent=st["bytes_sent"], bytes_received=st["bytes_received"],
                 method=cache.cache.codec.method, compress_host=cache.cache.compress_host,
                 chosen_by=str(cache.cache.host_layout.get("chosen_by", "")))
        dist.barrier()
    finally:
        if seg is not None:
            seg.unlink()
            seg.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    world, port, out_dir, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mode = sys.argv[5] if len(sys.argv) > 5 else "ibp"
    mp.spawn(_worker, args=(world, port, out_dir, backend, mode), nprocs=world, join=True)
