"""ibpcache's plain-torch NeighborSampler: real, distinct, uniform in-neighbours; a batch's sample depends only on its
key and seeds (not on how many batches are sampled together, nor, on a GPU, on the device).

Real Cora edges throughout, plus a power-law graph for the CPU == GPU check.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpcache.errors import DeviceError, InvalidArgumentError, InvalidIdsError, InvalidTypeError


def _sampler(cora: Any, fanouts: list[int], device: str = "cpu", frontier: bool = False, groups: bool = False) -> Any:
    from ibpcache.loaders.sampling import NeighborSampler

    return NeighborSampler(cora.src, cora.dst, cora.num_nodes, fanouts, device=device, frontier=frontier,
                           groups=groups)


def _batches(n_nodes: int, sizes: list[int], seed: int = 0) -> list[torch.Tensor]:
    perm = torch.randperm(n_nodes, generator=torch.Generator().manual_seed(seed))
    out, at = [], 0
    for s in sizes:
        out.append(perm[at:at + s])
        at += s
    return out


def _same(a: Any, b: Any) -> bool:
    if not torch.equal(a.nodes.cpu(), b.nodes.cpu()) or len(a.hops) != len(b.hops):
        return False
    for x, y in zip(a.hops, b.hops):
        if (x.n_src, x.n_dst) != (y.n_src, y.n_dst):
            return False
        for s, t in ((x.src, y.src), (x.dst, y.dst), (x.eid, y.eid), (x.dst_ptr, y.dst_ptr),
                     (x.dst_by_src, y.dst_by_src), (x.src_ptr, y.src_ptr)):
            if (s is None) != (t is None) or (s is not None and not torch.equal(s.cpu(), t.cpu())):
                return False
    return True


def test_mix32_is_murmur3_fmix32_on_ints_and_tensors() -> None:
    from ibpcache.loaders.sampling import mix32

    # MurmurHash3's fmix32 of 0, 1 and 2**32 - 1
    want = {0: 0, 1: 0x514E28B7, 0xFFFFFFFF: 0x81F16F39}
    for x, h in want.items():
        assert mix32(x) == h
    got = mix32(torch.tensor(list(want), dtype=torch.int64))
    assert got.tolist() == list(want.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50), st.integers(0, 2**32 - 1))
def test_32_bit_product_has_no_int64_overflow(xs: list[int], c: int) -> None:
    from ibpcache.loaders.sampling import _mul32

    got = _mul32(torch.tensor(xs, dtype=torch.int64), c)
    assert got.tolist() == [(x * c) % 2**32 for x in xs]
    assert int(got.min()) >= 0


@pytest.mark.parametrize("frontier", [False, True])
def test_real_distinct_in_neighbours_of_cora(cora: Any, frontier: bool) -> None:
    fanouts = [10, 4]
    s = _sampler(cora, fanouts, frontier=frontier)
    seeds = _batches(cora.num_nodes, [300])[0]
    out = s.sample(seeds, 7)
    assert torch.equal(out.nodes[:300], seeds) and out.num_seeds == 300
    assert torch.unique(out.nodes).numel() == out.nodes.numel()
    edges = set(zip(cora.src.tolist(), cora.dst.tolist()))
    deg = torch.bincount(cora.dst, minlength=cora.num_nodes)
    sampled_before = 0
    for hop, k in zip(out.hops, fanouts):
        u, v = out.nodes[hop.src], out.nodes[hop.dst]
        assert all((a, b) in edges for a, b in zip(u.tolist(), v.tolist()))
        assert torch.equal(cora.src[hop.eid], u) and torch.equal(cora.dst[hop.eid], v)
        lo = sampled_before if frontier else 0  # PyG hops sample only the previous hop's new nodes
        per = torch.bincount(hop.dst, minlength=hop.n_dst)
        assert torch.equal(hop.dst_degree(), per)
        assert torch.equal(per[lo:], deg[out.nodes[lo:hop.n_dst]].clamp(max=k)) and int(per[:lo].sum()) == 0
        assert len(set(zip(hop.src.tolist(), hop.dst.tolist()))) == hop.src.numel()  # no edge twice
        assert int(hop.src.max()) < hop.n_src and int(hop.dst.max()) < hop.n_dst <= hop.n_src
        new = out.nodes[hop.n_dst:hop.n_src]
        assert torch.equal(new, new.sort().values)  # a hop's new nodes in ascending id order
        assert not set(new.tolist()) & set(out.nodes[:hop.n_dst].tolist())
        order = hop.dst * (hop.eid.max() + 1) + hop.eid
        assert torch.equal(hop.dst, hop.dst.sort().values) and torch.equal(order, order.sort().values)
        sampled_before = hop.n_dst
    assert out.hops[-1].n_src == out.nodes.numel()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 90), min_size=1, max_size=6), st.integers(0, 2**40))
def test_batches_sampled_together_equal_batches_sampled_alone(cora: Any, sizes: list[int], key: int) -> None:
    s = _sampler(cora, [6, 3], groups=True)
    batches = _batches(cora.num_nodes, sizes, seed=key % 1000)
    keys = [key + 17 * i for i in range(len(sizes))]
    together = s.sample(batches, keys)
    assert len(together) == len(sizes)
    for b, k, t in zip(batches, keys, together):
        assert _same(t, s.sample(b, k))


@pytest.mark.parametrize("frontier", [False, True])
@pytest.mark.parametrize("fanouts", [[10, 25], [-1, 3], [0, 4]])
def test_hop_groups_equal_a_stable_sort_of_each_hop(cora: Any, frontier: bool, fanouts: list[int]) -> None:
    """``groups=True``: per hop, offsets per destination into ``src`` (already in destination order) and the edges
    grouped by source, stably, with their offsets: what a stable sort of each batch's hop gives, for a call of
    several batches (one of them empty); the samples themselves are unchanged."""
    batches = _batches(cora.num_nodes, [40, 0, 1, 97])
    keys = [5, 6, 7, 8]
    grouped = _sampler(cora, fanouts, frontier=frontier, groups=True).sample(batches, keys)
    plain = _sampler(cora, fanouts, frontier=frontier).sample(batches, keys)
    for g, p in zip(grouped, plain):
        assert torch.equal(g.nodes, p.nodes) and all(h.dst_ptr is None for h in p.hops)
        for h, q in zip(g.hops, p.hops):
            assert torch.equal(h.src, q.src) and torch.equal(h.dst, q.dst)
            by_dst = torch.sort(h.dst, stable=True)
            assert torch.equal(h.src[by_dst.indices], h.src)
            assert torch.equal(h.dst_ptr, torch.searchsorted(by_dst.values, torch.arange(h.n_dst + 1)))
            by_src = torch.sort(h.src, stable=True)
            assert torch.equal(h.dst_by_src, h.dst[by_src.indices])
            assert torch.equal(h.src_ptr, torch.searchsorted(by_src.values, torch.arange(h.n_src + 1)))


def test_the_key_alone_decides(cora: Any) -> None:
    s = _sampler(cora, [5, 5])
    seeds = _batches(cora.num_nodes, [200])[0]
    a, b, c = s.sample(seeds, 1), s.sample(seeds, 1), s.sample(seeds, 2)
    assert _same(a, b) and not _same(a, c)
    again = _sampler(cora, [5, 5]).sample(seeds, 1)  # a new sampler over the same graph: the same sample
    assert _same(a, again)


def test_draws_are_uniform() -> None:
    """A node with 20 in-neighbours, 5 drawn per key: each neighbour is drawn in about 1/4 of 4000 keys."""
    from ibpcache.loaders.sampling import NeighborSampler

    n = 21
    s = NeighborSampler(torch.arange(1, n), torch.zeros(n - 1, dtype=torch.int64), n, [5])
    counts = torch.zeros(n, dtype=torch.int64)
    pairs = torch.zeros(n, n, dtype=torch.int64)
    seeds = [torch.tensor([0])] * 4000
    for out in s.sample(seeds, list(range(4000))):
        nbr = out.nodes[out.hops[0].src]
        assert nbr.numel() == 5 and torch.unique(nbr).numel() == 5
        counts[nbr] += 1
        pairs[nbr.unsqueeze(1), nbr.unsqueeze(0)] += 1
    sigma = (4000 * 0.25 * 0.75) ** 0.5
    assert int((counts[1:] - 1000).abs().max()) < 5 * sigma, counts
    together = pairs[1:, 1:][~torch.eye(n - 1, dtype=torch.bool)]  # P(both drawn) = 5*4 / (20*19)
    want = 4000 * 20 / 380
    assert float((together - want).abs().max()) < 5 * (want * (1 - 20 / 380)) ** 0.5


def test_all_neighbours_zero_and_no_hops(cora: Any) -> None:
    from ibpcache.loaders.sampling import NeighborSampler

    seeds = torch.tensor([0, 1, 2])
    deg = torch.bincount(cora.dst, minlength=cora.num_nodes)
    out = _sampler(cora, [-1]).sample(seeds, 0)
    assert torch.equal(torch.bincount(out.hops[0].dst, minlength=3), deg[seeds])
    none = _sampler(cora, [0]).sample(seeds, 0)
    assert none.hops[0].src.numel() == 0 and torch.equal(none.nodes, seeds)
    bare = NeighborSampler(cora.src, cora.dst, cora.num_nodes, []).sample(seeds, 0)
    assert bare.hops == [] and torch.equal(bare.nodes, seeds) and bare.num_seeds == 3
    empty = _sampler(cora, [3, 3]).sample([torch.empty(0, dtype=torch.int64), seeds], [1, 2])
    assert empty[0].nodes.numel() == 0 and _same(empty[1], _sampler(cora, [3, 3]).sample(seeds, 2))


def test_bad_input_is_named(cora: Any) -> None:
    from ibpcache.loaders.sampling import NeighborSampler

    s = _sampler(cora, [3])
    with pytest.raises(InvalidIdsError, match="outside"):
        s.sample(torch.tensor([cora.num_nodes]), 0)
    with pytest.raises(InvalidArgumentError, match="distinct"):
        s.sample(torch.tensor([4, 4]), 0)
    with pytest.raises(InvalidIdsError, match="integer"):
        s.sample(torch.tensor([0.5]), 0)
    with pytest.raises(InvalidArgumentError, match="keys"):
        s.sample([torch.tensor([1])], [1, 2])
    with pytest.raises(InvalidArgumentError, match="fanouts"):
        NeighborSampler(cora.src, cora.dst, cora.num_nodes, [-2])
    with pytest.raises(InvalidArgumentError, match="num_nodes"):
        NeighborSampler(cora.src, cora.dst, 2**31, [3])
    with pytest.raises(InvalidIdsError, match="outside"):
        NeighborSampler(cora.src, cora.dst, 10, [3])
    with pytest.raises(InvalidTypeError):
        NeighborSampler(cora.src.tolist(), cora.dst, cora.num_nodes, [3])  # type: ignore[arg-type]


def test_sampler_device_choice() -> None:
    from ibpcache.loaders.sampling import choose_sampler_device, graph_bytes

    assert choose_sampler_device(100, 1000, "cpu") == torch.device("cpu")
    assert graph_bytes(100, 1000, edge_ids=False) == 8 * 101 + 8 * 1000
    if not torch.cuda.is_available():
        assert choose_sampler_device(100, 1000, "auto") == torch.device("cpu")
        with pytest.raises(DeviceError):
            choose_sampler_device(100, 1000, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("frontier", [False, True])
def test_gpu_samples_equal_cpu_samples(cora: Any, frontier: bool) -> None:
    from ibpcache.datasets import power_law_graph
    from ibpcache.loaders.sampling import NeighborSampler, choose_sampler_device

    cpu = _sampler(cora, [10, 25], frontier=frontier, groups=True)
    gpu = _sampler(cora, [10, 25], "cuda", frontier, groups=True)
    batches = _batches(cora.num_nodes, [512, 512, 300])
    keys = [11, 12, 13]
    for a, b in zip(cpu.sample(batches, keys), gpu.sample([x.cuda() for x in batches], keys)):
        assert b.nodes.is_cuda and _same(a, b)
    src, dst = power_law_graph(100_000, 20.0, seed=2)
    big_cpu = NeighborSampler(src, dst, 100_000, [10, 25], frontier=frontier, groups=True)
    big_gpu = NeighborSampler(src, dst, 100_000, [10, 25], device="cuda", frontier=frontier, groups=True)
    seeds = _batches(100_000, [512] * 4, seed=3)
    for a, b in zip(big_cpu.sample(seeds, [1, 2, 3, 4]), big_gpu.sample(seeds, [1, 2, 3, 4])):
        assert _same(a, b)
    assert choose_sampler_device(100_000, int(src.numel()), "auto").type == "cuda"  # 2M edges fit any GPU
    assert choose_sampler_device(10**9, 10**12, "auto").type == "cpu"


@pytest.mark.gpu
@pytest.mark.parametrize("frontier", [False, True])
def test_gpu_sampling_reads_the_gpu_back_twice_per_hop_and_once_per_call(cora: Any, frontier: bool) -> None:
    """A sampler running ahead of training stalls at every host read; a call of H hops makes at most 2 H + 1 (the
    sync debug mode reports each), and a Hop's degrees need none. Bad seeds still raise (clamped, checked at the
    end), without a device-side assert."""
    import warnings

    gpu = _sampler(cora, [10, 25], "cuda", frontier, groups=True)
    batches = [b.cuda() for b in _batches(cora.num_nodes, [512, 512, 300])]
    gpu.sample(batches, [1, 2, 3])  # warm-up: pinned host blocks, kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = gpu.sample(batches, [1, 2, 3])
            degrees = [hop.dst_degree() for s in out for hop in s.hops]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) <= 2 * 2 + 1, [str(w.message) for w in syncs]
    hops = [hop for s in out for hop in s.hops]
    assert all(torch.equal(d.cpu(), torch.bincount(h.dst.cpu(), minlength=h.n_dst)) for d, h in zip(degrees, hops))
    with pytest.raises(InvalidIdsError, match="outside"):
        gpu.sample(torch.tensor([cora.num_nodes, -1], device="cuda"), 0)
    with pytest.raises(InvalidArgumentError, match="distinct"):
        gpu.sample(torch.tensor([4, 4], device="cuda"), 0)
    assert _same(gpu.sample(batches[0], 9),
                 _sampler(cora, [10, 25], frontier=frontier, groups=True).sample(batches[0].cpu(), 9))


def _floyd_step_by_step(deg: torch.Tensor, node_keys: torch.Tensor, k: int) -> torch.Tensor:
    """Floyd's algorithm as written, one draw after the other (the reference for the sampler's vectorized one)."""
    from ibpcache.loaders.sampling import _GOLDEN, _M32, _rand_below, mix32

    steps = torch.arange(k)
    draws = mix32((node_keys.unsqueeze(1) + ((steps * _GOLDEN) & _M32)) & _M32)
    hi = (deg - k).unsqueeze(1) + steps
    t = _rand_below(draws, hi + 1)
    rows = []
    for r in range(t.shape[0]):
        taken: list[int] = []
        for j in range(k):
            tj = int(t[r, j])
            taken.append(int(hi[r, j]) if tj in taken else tj)
        rows.append(sorted(taken))
    return torch.tensor(rows, dtype=torch.int64).reshape(t.shape)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(1, 60), st.integers(0, 2**32 - 1)), min_size=1,
                                    max_size=12))
def test_floyd_subsets_equal_the_step_by_step_algorithm(k: int, rows: list[tuple[int, int]]) -> None:
    """Degrees just above k (many collisions, long "taken already" chains) and far above it: the same subsets,
    distinct, inside [0, deg)."""
    from ibpcache.loaders.sampling import NeighborSampler

    s = NeighborSampler(torch.tensor([0]), torch.tensor([1]), 2, [k])
    deg = torch.tensor([k + extra for extra, _ in rows], dtype=torch.int64)
    keys = torch.tensor([key for _, key in rows], dtype=torch.int64)
    got = s._floyd(deg, keys, k)
    assert torch.equal(got, _floyd_step_by_step(deg, keys, k))
    assert bool((got[:, 1:] > got[:, :-1]).all()) and bool((got < deg.unsqueeze(1)).all()) and bool((got >= 0).all())


def test_floyd_ops_grow_with_log_k_not_k() -> None:
    """The draws' dedup takes O(log k) tensor ops (each a kernel launch on a GPU), not one dependent step per draw:
    going from k = 8 to k = 64 adds at most three pointer-jumping rounds of a few ops each."""
    from torch.profiler import ProfilerActivity, profile

    from ibpcache.loaders.sampling import NeighborSampler

    def ops(k: int) -> int:
        s = NeighborSampler(torch.tensor([0]), torch.tensor([1]), 2, [k])
        deg = torch.full((100,), 3 * k, dtype=torch.int64)
        keys = torch.arange(100, dtype=torch.int64)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            s._floyd(deg, keys, k)
        return sum(1 for e in prof.events() if e.cpu_parent is None)

    assert ops(64) - ops(8) <= 3 * 8, (ops(8), ops(64))
