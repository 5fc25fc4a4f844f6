"""Run the GPU sampler's fused hop (``kernels/sampling.cu``) on real and power-law graphs, for compute-sanitizer
memcheck / racecheck.

Covers: fanouts below, at and above the kernel's limit (``-1`` takes every neighbour; 65 > KMAX falls back to the
torch path for that hop), node frontiers on and off, seeds with no neighbours, a batch of one seed and an odd-sized
last batch. Every sample is compared with the torch path's (``hop_kernel=False``), so a sanitizer-clean run is also a
correct one. `compute-sanitizer --tool memcheck python scripts/sanitize_sampling.py` (scripts/gpu_check.sh runs every
scripts/sanitize_*.py); exits non-zero if a sample differs.
"""

from __future__ import annotations

import sys

import torch

from ibpcache import datasets
from ibpcache.loaders.sampling import NeighborSampler

FANOUTS = ([10, 25], [-1, 3], [0, 4], [64, 2], [65, 2])
FIELDS = ("src", "dst", "eid", "dst_ptr", "dst_by_src", "src_ptr")


def graphs() -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Cora's citation graph (real, bundled with the package) and a power-law graph whose hubs have thousands of
    neighbours."""
    cora = datasets.load_cora()
    return [(cora.src, cora.dst, cora.num_nodes), (*datasets.power_law_graph(50_000, 20.0, seed=2), 50_000)]


def same(a: object, b: object) -> bool:
    ok = torch.equal(a.nodes, b.nodes)  # type: ignore[attr-defined]
    for x, y in zip(a.hops, b.hops):  # type: ignore[attr-defined]
        for f in FIELDS:
            u, v = getattr(x, f), getattr(y, f)
            ok &= (u is None) == (v is None) and (u is None or torch.equal(u, v))
    return bool(ok)


def main() -> int:
    ok = True
    cases = 0
    for src, dst, n in graphs():
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(3)).cuda()
        batches = [perm[:512], perm[512:513], perm[513:900]]  # full, one seed, odd-sized
        for fanouts in FANOUTS:
            for frontier in (False, True):
                kw = dict(device="cuda", frontier=frontier, groups=True)
                ref = NeighborSampler(src, dst, n, fanouts, hop_kernel=False, **kw)
                fused = NeighborSampler(src, dst, n, fanouts, hop_kernel=True, **kw)
                for a, b in zip(ref.sample(batches, [5, 6, 7]), fused.sample(batches, [5, 6, 7])):
                    ok &= same(a, b)
                    cases += 1
    torch.cuda.synchronize()
    print(f"fused sampler hop: {cases} samples, equal to the torch path: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
