"""The GPU sampler's fused hop (``kernels/sampling.cu``, ``NeighborSampler(hop_kernel=True)``) draws exactly what
the torch path draws: its constants are the torch path's, its source compiled for the host gives the torch path's
edges on real and power-law graphs (CPU, CI), and on a GPU the samples are equal with fewer launches and no more
host reads."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ibpcache.errors import InvalidArgumentError

SOURCE = Path(__file__).resolve().parents[2] / "ibpcache" / "kernels" / "sampling.cu"

_HARNESS = r"""
#include <cstdio>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
struct ibp_dim3 { unsigned int x; };
static ibp_dim3 blockIdx, blockDim, threadIdx;
#include "sampling.cu"
// stdin: int64 header (colptr length, nodes, k, total), then colptr, nodes, keys, first; stdout: pos, seg
int main() {
    long long h[4];
    if (fread(h, 8, 4, stdin) != 4) return 1;
    std::vector<long long> colptr(h[0]), nodes(h[1]), keys(h[1]), first(h[1]), pos(h[3]), seg(h[3]);
    if (fread(colptr.data(), 8, h[0], stdin) != (size_t)h[0] || fread(nodes.data(), 8, h[1], stdin) != (size_t)h[1]
        || fread(keys.data(), 8, h[1], stdin) != (size_t)h[1] || fread(first.data(), 8, h[1], stdin) != (size_t)h[1])
        return 2;
    blockDim.x = 256;
    for (long long i = 0; i < h[1]; ++i) {  // every thread of the grid, one after the other
        blockIdx.x = (unsigned int)(i / 256);
        threadIdx.x = (unsigned int)(i % 256);
        ibp_smp_hop(colptr.data(), nodes.data(), keys.data(), first.data(), h[1], (int)h[2], pos.data(), seg.data());
    }
    fwrite(pos.data(), 8, h[3], stdout);
    fwrite(seg.data(), 8, h[3], stdout);
    return 0;
}
"""


def _defines() -> dict[str, int]:
    return {m.group(1): int(m.group(2).rstrip("uU"), 0)
            for m in re.finditer(r"^#define (IBP_SMP_\w+) (\S+)$", SOURCE.read_text(), flags=re.M)}


def test_kernel_constants_are_the_torch_paths() -> None:
    from ibpcache.kernels import sampling as kernels
    from ibpcache.loaders import sampling

    found = _defines()
    assert found["IBP_SMP_GOLDEN"] == sampling._GOLDEN
    assert found["IBP_SMP_FMIX1"] == sampling._FMIX1 and found["IBP_SMP_FMIX2"] == sampling._FMIX2
    assert {k: found[k] for k in kernels.HASH_CONSTANTS} == kernels.HASH_CONSTANTS
    assert found["IBP_SMP_KMAX"] == kernels.KMAX


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory: Any) -> Path:
    """sampling.cu compiled for the host, each CUDA thread run in turn (needs a C++ compiler)."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the kernel source for the host")
    d = tmp_path_factory.mktemp("hop_kernel")
    (d / "harness.cpp").write_text(_HARNESS)
    exe = d / "hop"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{SOURCE.parent}", str(d / "harness.cpp"), "-o", str(exe)],
                   check=True, capture_output=True)
    return exe


def _host_hop(exe: Path, colptr: torch.Tensor, nodes: torch.Tensor, keys: torch.Tensor, first: torch.Tensor,
              k: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    head = np.array([colptr.numel(), nodes.numel(), k, total], dtype=np.int64)
    blob = b"".join(a.tobytes() for a in (head, colptr.numpy(), nodes.numpy(), keys.numpy(), first.numpy()))
    out = subprocess.run([str(exe)], input=blob, capture_output=True, check=True).stdout
    both = torch.from_numpy(np.frombuffer(out, dtype=np.int64).copy())
    return both[:total], both[total:]


def _torch_hop(sampler: Any, nodes: torch.Tensor, keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's (CSC position, node index) per edge: its edge ids are the CSC -> input permutation, so they
    name the positions."""
    _nbr, seg, eid = sampler._hop(nodes, keys, k)
    inverse = torch.empty_like(sampler.eid)
    inverse[sampler.eid] = torch.arange(sampler.eid.numel())
    return inverse[eid], seg


@pytest.mark.parametrize("graph", ["cora", "power_law"])
@pytest.mark.parametrize("k", [1, 2, 3, 10, 25, 64, 0, -1])
def test_kernel_source_draws_the_torch_paths_edges(host_kernel: Path, cora: Any, graph: str, k: int) -> None:
    from ibpcache.datasets import power_law_graph
    from ibpcache.loaders.sampling import NeighborSampler, _exclusive_cumsum

    if graph == "cora":
        src, dst, n = cora.src, cora.dst, cora.num_nodes
    else:
        src, dst = power_law_graph(20_000, 30.0, seed=5)
        n = 20_000
    sampler = NeighborSampler(src, dst, n, [k], edge_ids=True)
    gen = torch.Generator().manual_seed(k + 7)
    nodes = torch.randint(0, n, (3000,), generator=gen)
    keys = torch.randint(0, 2**32, (3000,), generator=gen, dtype=torch.int64)
    deg = sampler.colptr[nodes + 1] - sampler.colptr[nodes]
    counts = deg if k < 0 else deg.clamp(max=k)
    want_pos, want_seg = _torch_hop(sampler, nodes, keys, k)
    got_pos, got_seg = _host_hop(host_kernel, sampler.colptr, nodes, keys, _exclusive_cumsum(counts), k,
                                 int(counts.sum()))
    assert int(counts.sum()) == want_pos.numel()
    if k > 0:
        assert bool((deg > k).any()), "no node takes Floyd's draws: the case proves nothing"
    assert torch.equal(got_seg, want_seg)
    assert torch.equal(got_pos, want_pos)


def test_hop_positions_names_bad_input() -> None:
    from ibpcache.cache.sampling_hop import KMAX, hop_positions

    x = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(InvalidArgumentError, match="colptr"):
        hop_positions(x, x, x, x, 3, 0)  # CPU tensors: the kernel runs on a GPU only
    if torch.cuda.is_available():
        c = x.cuda()
        with pytest.raises(InvalidArgumentError, match="fanouts"):
            hop_positions(c, c, c, c, KMAX + 1, 0)
        with pytest.raises(InvalidArgumentError, match="first"):
            hop_positions(c, c, c, c.to(torch.int32), 3, 0)


def test_hop_kernel_is_ignored_on_the_cpu(cora: Any) -> None:
    from ibpcache.loaders.sampling import NeighborSampler

    s = NeighborSampler(cora.src, cora.dst, cora.num_nodes, [10, 25], hop_kernel=True)
    assert not s.hop_kernel and "hop_kernel=False" in repr(s)


@pytest.mark.gpu
@pytest.mark.parametrize("frontier", [False, True])
@pytest.mark.parametrize("fanouts", [[10, 25], [-1, 3], [0, 4], [64, 2], [65, 2]])
def test_gpu_hop_kernel_samples_equal_the_torch_paths(cora: Any, frontier: bool, fanouts: list[int]) -> None:
    """Bit for bit, groups and edge ids included, on Cora and a power-law graph (fanout 65 > KMAX: the torch path
    for that hop)."""
    from ibpcache.datasets import power_law_graph
    from ibpcache.loaders.sampling import NeighborSampler

    for src, dst, n in ((cora.src, cora.dst, cora.num_nodes), (*power_law_graph(100_000, 20.0, seed=2), 100_000)):
        ref = NeighborSampler(src, dst, n, fanouts, device="cuda", frontier=frontier, groups=True, hop_kernel=False)
        fused = NeighborSampler(src, dst, n, fanouts, device="cuda", frontier=frontier, groups=True)  # the default
        cpu = NeighborSampler(src, dst, n, fanouts, frontier=frontier, groups=True)
        assert fused.hop_kernel
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))
        batches = [perm[:512], perm[512:1024], perm[1024:1324]]
        keys = [21, 22, 23]
        gpu_batches = [b.cuda() for b in batches]
        for a, b, c in zip(ref.sample(gpu_batches, keys), fused.sample(gpu_batches, keys), cpu.sample(batches, keys)):
            for x, y, z in zip(a.hops, b.hops, c.hops):
                for f in ("src", "dst", "eid", "dst_ptr", "dst_by_src", "src_ptr"):
                    u, v, w = getattr(x, f), getattr(y, f), getattr(z, f)
                    assert (u is None) == (v is None) == (w is None)
                    assert u is None or (torch.equal(u, v) and torch.equal(v.cpu(), w)), f
            assert torch.equal(a.nodes, b.nodes) and torch.equal(b.nodes.cpu(), c.nodes)


@pytest.mark.gpu
def test_gpu_hop_kernel_launches_fewer_kernels_and_reads_back_no_more(cora: Any) -> None:
    import warnings

    from torch.profiler import ProfilerActivity, profile

    from ibpcache.loaders.sampling import NeighborSampler

    batches = [b.cuda() for b in torch.randperm(cora.num_nodes)[:2048].split(512)]
    counts = {}
    for fused in (False, True):
        s = NeighborSampler(cora.src, cora.dst, cora.num_nodes, [10, 25], device="cuda", groups=True,
                            hop_kernel=fused)
        s.sample(batches, [1, 2, 3, 4])  # warm-up: the kernel's build, pinned host blocks
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            s.sample(batches, [1, 2, 3, 4])
            torch.cuda.synchronize()
        counts[fused] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                s.sample(batches, [1, 2, 3, 4])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len([w for w in caught if "synchronizing" in str(w.message)]) <= 2 * 2 + 1
    assert counts[True] < counts[False] - 100, counts
