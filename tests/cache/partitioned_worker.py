"""Run by test_partitioned.py: W ranks share one compressed store and a node cache (PartitionedFeatureCache).

``python partitioned_worker.py WORLD PORT OUT_DIR BACKEND [MODE]``: BACKEND ``gloo`` runs CPU caches (independent
caches: the fallback), ``nccl`` one GPU per rank (peer slabs through CUDA IPC). MODE ``ibp`` (default) / ``exponent``:
rank 0 codes real rows (bundled Cora) with that method and shares them, every rank attaches; ``auto``: every rank
passes the rows themselves with ``codec="auto"`` and ``compress_host="auto"`` (rank 0 plans, the others follow).
``ibp`` and ``exponent`` plan with the guessed ``DEFAULT_COSTS`` (a placement with peer rows, whatever this machine
measures); ``auto`` with ``costs="measure"`` (the default: timed sources and the set-up check on CUDA).
Every rank fetches a seeded batch (duplicates, hot rows), on CUDA a batch of peer-owned rows under
``torch.cuda.set_sync_debug_mode("error")``, then refreshes to a reversed hotness and fetches again. Saves what the
test checks.
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
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    seg = None
    try:
        from ibpcache import Codec, CompressedRows
        from ibpcache.cache.partitioned import DEFAULT_COSTS, PEER, PartitionedFeatureCache
        from ibpcache.datasets import load_cora

        table = load_cora().features
        n = table.shape[0]
        name = f"ptest-{port}"
        if rank == 0 and mode != "auto":
            seg = Codec.fit(table, method=mode).compress(table, layout="inplace", pin=False).share(name)
        dist.barrier()
        rows = table if mode == "auto" else CompressedRows.attach(name)
        kwargs = {"codec": "auto", "compress_host": "auto"} if mode == "auto" else {"costs": DEFAULT_COSTS}
        hotness = (torch.randperm(n, generator=torch.Generator().manual_seed(7)) + 1.0) ** -1.2
        budget = 0.004 if mode != "exponent" else 0.02
        cache = PartitionedFeatureCache(rows, hotness, budget_bytes=budget, device=device, **kwargs)
        hot_ids = torch.argsort(hotness, descending=True)[:200]
        ids = torch.cat([torch.randint(0, n, (4000 + 300 * rank,), generator=torch.Generator().manual_seed(rank)),
                         hot_ids, hot_ids[:50]])
        got = cache.fetch(ids.to(device))
        empty = cache.fetch(torch.empty(0, dtype=torch.int64, device=device))
        st = cache.stats()
        peer_ids = torch.nonzero(cache.holder.cpu() == PEER).reshape(-1)
        peer_got = np.zeros((0, 0), dtype=np.uint8)
        peer_hits = -1
        if device.type == "cuda" and peer_ids.numel():
            pick = peer_ids[torch.randint(0, peer_ids.numel(), (3000,), generator=torch.Generator().manual_seed(3))]
            pick = pick.to(device)
            cache.reset_stats()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # a fetch must not sync the host
            try:
                out = cache.fetch(pick)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            peer_got, peer_ids = out.cpu().view(torch.uint8).numpy(), pick.cpu()
            peer_hits = cache.stats()["peer_hits"]
        cached_before = cache.cache.cached_ids.cpu().numpy()
        cache.refresh(hotness.flip(0))  # another placement: the coldest rows are now the hottest
        after = cache.fetch(ids.to(device))
        st2 = cache.stats()
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), ids=ids.numpy(), got=got.cpu().view(torch.uint8).numpy(),
                 empty=np.array(empty.shape), cached=cached_before, replicated=np.array(st["replicated_rows"]),
                 owned=np.array(st["owned_rows"]),
                 node_cached=st["node_cached_rows"], here=st["rows_cached_here"],
                 counts=np.array([st["requests"], st["local_hits"], st["peer_hits"], st["host_misses"]]),
                 hit_rate=st["hit_rate"], peer_access=st["peer_access"], reason=np.array(str(st["fallback_reason"])),
                 fallback=np.array(str(st["fallback"])), peer_got=peer_got, peer_ids=peer_ids.numpy(),
                 peer_hits=peer_hits, after=after.cpu().view(torch.uint8).numpy(),
                 cached_after=cache.cache.cached_ids.cpu().numpy(), after_requests=st2["requests"],
                 method=cache.cache.codec.method, compress_host=cache.cache.compress_host,
                 chosen_by=str(cache.cache.host_layout.get("chosen_by", "")), costs_rule=np.array(st["costs_rule"]),
                 placement_costs=np.array(st["placement_costs"]), replicate=st["replicate"],
                 source_costs=np.array([np.nan] * 3 if st["source_costs_us_per_row"] is None else
                                       [st["source_costs_us_per_row"][k] for k in ("local", "peer", "host")]),
                 setup_kept=np.array(str((st["setup_check"] or {}).get("kept"))))
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
