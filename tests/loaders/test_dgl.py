"""The DGL drop-in: DGL's own DataLoader must return exactly the original rows through every fetch mode.

Real data only: Cora (sparse binary rows, bundled) and a small power-law graph carrying real MiniLM rows
(dense float32). Comparisons are on raw bytes, so any lossy step would fail.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import Any

# Deterministic cuBLAS for the GPU loss-equality test; must be set before cuBLAS starts in this process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpcache.errors import ConfigError, IbpcacheError, InvalidIdsError

# DGL suggests enable_cpu_affinity() whenever a DataLoader has workers; irrelevant to these checks.
pytestmark = pytest.mark.filterwarnings("ignore:Dataloader CPU affinity")


@pytest.fixture(scope="module")
def dgl() -> Any:
    try:
        from ibpcache.loaders.dgl import import_dgl

        return import_dgl()
    except ImportError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def mod(dgl: Any) -> Any:
    import ibpcache.loaders.dgl as m

    return m


ALL_MODES = ["dgl", "dgl_pinned", "raw", "ibp_m", "ibp_c", "ibp_cm"]
CACHE_MODES = ["raw", "ibp_m", "ibp_c", "ibp_cm"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _graph(dgl: Any, src: torch.Tensor, dst: torch.Tensor, n: int, labels: torch.Tensor | None = None) -> Any:
    g = dgl.graph((src, dst), num_nodes=n)
    if labels is not None:
        g.ndata["label"] = labels
    return g


def _loader(dgl: Any, g: Any, nids: torch.Tensor, batch_size: int, workers: int = 0, **sampler_kw: Any) -> Any:
    sampler = dgl.dataloading.NeighborSampler([25, 10], **sampler_kw)
    return dgl.dataloading.DataLoader(g, nids, sampler, device="cpu", batch_size=batch_size, shuffle=True,
                                      num_workers=workers)


@pytest.fixture(scope="module")
def minilm_graph(minilm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 3000-node power-law graph whose nodes carry real MiniLM rows (1536 B, dense) drawn at random."""
    from ibpcache.datasets import power_law_graph

    n = 3000
    src, dst = power_law_graph(n, avg_degree=12, seed=3)
    pick = torch.randint(minilm.shape[0], (n,), generator=torch.Generator().manual_seed(4))
    return src, dst, minilm[pick].contiguous()


# ---------------------------------------------------------------------------------------------------------------
# The DataLoader path, every batch of an epoch


@pytest.mark.parametrize("mode", ALL_MODES)
def test_cora_every_batch_bit_identical(dgl: Any, mod: Any, cora: Any, mode: str) -> None:
    g = _graph(dgl, cora.src, cora.dst, cora.num_nodes, cora.labels)
    feats = cora.features.clone()
    mod.attach(g, {"feat": feats}, mode=mode, device="cpu", budget=0.02)
    loader = _loader(dgl, g, torch.arange(cora.num_nodes), 512, workers=1 if mode == "ibp_cm" else 0,
                     prefetch_node_feats=["feat"], prefetch_labels=["label"])
    batches = 0
    for input_nodes, output_nodes, blocks in loader:
        x = blocks[0].srcdata["feat"]
        assert x.dtype == feats.dtype and x.shape == (len(input_nodes), feats.shape[1])
        assert torch.equal(_bytes(x), _bytes(feats[input_nodes]))
        assert torch.equal(blocks[-1].dstdata["label"], cora.labels[output_nodes])
        batches += 1
    assert batches == -(-cora.num_nodes // 512)
    stats = g.get_node_storage("feat").ibp.stats()
    assert stats["fetch_mode"] == mode and stats["calls"] == batches
    if mode in CACHE_MODES:
        assert stats["requests"] == stats["rows"]
    if mode in ("ibp_m", "ibp_cm"):  # compressed host store: Cora moves far fewer bytes than raw
        assert stats["host_bytes_read"] < stats["raw_bytes"] / 5


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_dense_minilm_graph_every_batch(dgl: Any, mod: Any, minilm_graph: Any, mode: str) -> None:
    src, dst, feats = minilm_graph
    g = _graph(dgl, src, dst, feats.shape[0])
    mod.attach(g, {"feat": feats}, mode=mode, device="cpu", budget=0.05)
    for input_nodes, _, blocks in _loader(dgl, g, torch.arange(feats.shape[0]), 256, prefetch_node_feats=["feat"]):
        assert torch.equal(_bytes(blocks[0].srcdata["feat"]), _bytes(feats[input_nodes]))


def test_attach_ready_cache_and_byte_budget(dgl: Any, mod: Any, cora: Any) -> None:
    from ibpcache.cache.feature_cache import FeatureCache

    cache = FeatureCache(cora.features, budget_bytes=64 * 1024, device="cpu",
                         hotness=mod.degree_hotness(_graph(dgl, cora.src, cora.dst, cora.num_nodes)))
    g = mod.attach(_graph(dgl, cora.src, cora.dst, cora.num_nodes), {"feat": cache})
    assert cache.stats()["budget_bytes"] == 64 * 1024
    for input_nodes, _, blocks in _loader(dgl, g, torch.arange(0, cora.num_nodes, 3), 300,
                                          prefetch_node_feats=["feat"]):
        assert torch.equal(_bytes(blocks[0].srcdata["feat"]), _bytes(cora.features[input_nodes]))
    assert cache.stats()["hits"] > 0


def test_degree_admission_scores(dgl: Any, mod: Any, cora: Any) -> None:
    g = _graph(dgl, cora.src, torch.flip(cora.dst, (0,)), cora.num_nodes)  # make in != out degrees
    assert torch.equal(mod.degree_hotness(g), g.out_degrees().float() + 1)
    assert torch.equal(mod.degree_hotness(g, edge_dir="out"), g.in_degrees().float() + 1)
    with pytest.raises(ValueError, match="edge_dir"):
        mod.degree_hotness(g, edge_dir="both")


# ---------------------------------------------------------------------------------------------------------------
# Heterographs, edge features, the rest of DGL's column protocol


def test_heterograph_one_storage_per_node_type(dgl: Any, mod: Any, cora: Any, minilm: torch.Tensor) -> None:
    n_paper, n_word = 600, 400
    gen = torch.Generator().manual_seed(0)
    cites = (torch.randint(n_paper, (3000,), generator=gen), torch.randint(n_paper, (3000,), generator=gen))
    has = (torch.randint(n_paper, (2000,), generator=gen), torch.randint(n_word, (2000,), generator=gen))
    g = dgl.heterograph({("paper", "cites", "paper"): cites, ("paper", "has", "word"): has,
                         ("word", "in", "paper"): (has[1], has[0])})
    feats = {"paper": cora.features[:n_paper].clone(), "word": minilm[:n_word].clone()}
    mod.attach(g, {"feat": feats}, mode="ibp_cm", device="cpu", budget=0.05)
    with pytest.raises(ValueError, match="several ntypes"):
        mod.attach(g, {"feat": feats["paper"]})
    sampler = dgl.dataloading.NeighborSampler([5, 5], prefetch_node_feats={"paper": ["feat"], "word": ["feat"]})
    loader = dgl.dataloading.DataLoader(g, {"paper": torch.arange(n_paper)}, sampler, batch_size=128,
                                        shuffle=True)
    for input_nodes, _, blocks in loader:
        for ntype, ids in input_nodes.items():
            got = blocks[0].srcdata["feat"][ntype]
            assert torch.equal(_bytes(got), _bytes(feats[ntype][ids]))


@pytest.mark.parametrize("mode", ["dgl", "ibp_cm"])
def test_edge_features(dgl: Any, mod: Any, cora: Any, minilm: torch.Tensor, mode: str) -> None:
    g = _graph(dgl, cora.src, cora.dst, cora.num_nodes)
    weights = minilm[torch.arange(g.num_edges()) % minilm.shape[0], :16].contiguous()  # real float rows
    mod.attach_edges(g, {"w": weights}, mode=mode, device="cpu", budget=0.05)
    loader = _loader(dgl, g, torch.arange(cora.num_nodes), 512, prefetch_edge_feats=["w"])
    for _, _, blocks in loader:
        for block in blocks:
            assert torch.equal(_bytes(block.edata["w"]), _bytes(weights[block.edata[dgl.EID]]))


def test_column_protocol(dgl: Any, mod: Any, cora: Any) -> None:
    g = _graph(dgl, cora.src, cora.dst, cora.num_nodes)
    mod.attach(g, {"feat": cora.features}, mode="ibp_cm", device="cpu")
    # full read decompresses every row; subgraphs slice lazily and read through the cache too
    assert torch.equal(_bytes(g.ndata["feat"]), _bytes(cora.features))
    nodes = torch.tensor([5, 0, 2707, 5, 100])
    sub = g.subgraph(torch.tensor([5, 0, 2707, 100]))
    assert torch.equal(_bytes(sub.ndata["feat"]), _bytes(cora.features[sub.ndata[dgl.NID]]))
    assert torch.equal(_bytes(g.get_node_storage("feat").fetch(nodes, "cpu")), _bytes(cora.features[nodes]))
    assert g.ndata["feat"].shape == cora.features.shape
    assert "IBPColumn" in repr(g._node_frames[0]._columns["feat"])
    half = g._node_frames[0].half()  # DGL's Frame.half -> Column.astype: deferred, applied on read
    assert torch.equal(half["feat"][:10], cora.features[:10].half())
    assert half._columns["feat"].fetch(torch.tensor([7]), "cpu").dtype == torch.float16
    with pytest.raises(IbpcacheError, match="read-only"):
        g.nodes[torch.tensor([0])].data["feat"] = torch.zeros(1, cora.features.shape[1])
    g.ndata["feat"] = torch.ones_like(cora.features)  # replacing the whole column is allowed
    assert bool((g.ndata["feat"] == 1).all())


def test_storage_is_a_dgl_feature_storage(dgl: Any, mod: Any, cora: Any) -> None:
    storage = mod.make_storage(cora.features, "ibp_c", device="cpu", budget=0.01)
    assert isinstance(storage, dgl.storages.FeatureStorage)
    assert isinstance(storage, mod.IBPFeatureStorage)
    empty = storage.fetch(torch.empty(0, dtype=torch.int64), "cpu")
    assert empty.shape == (0, cora.features.shape[1]) and empty.dtype == torch.float32
    ids32 = torch.tensor([3, 1, 3], dtype=torch.int32)  # graphs with idtype int32 give int32 ids
    assert torch.equal(storage.fetch(ids32, "cpu"), cora.features[ids32.long()])


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_is_named(dgl: Any, mod: Any, cora: Any) -> None:
    g = _graph(dgl, cora.src, cora.dst, cora.num_nodes)
    with pytest.raises(ValueError, match="2708 rows"):
        mod.attach(g, {"feat": cora.features[:100]}, device="cpu")
    with pytest.raises(TypeError, match="torch.Tensor, a FeatureCache"):
        mod.attach(g, {"feat": [1, 2, 3]}, device="cpu")
    with pytest.raises(TypeError, match="non-empty dict"):
        mod.attach(g, {}, device="cpu")
    with pytest.raises(ValueError, match="unknown fetch mode 'zstd'"):
        mod.attach(g, {"feat": cora.features}, mode="zstd", device="cpu")
    with pytest.raises(ValueError, match="hotness"):
        mod.make_storage(cora.features, "raw", device="cpu", hotness=torch.ones(5))
    storage = mod.make_storage(cora.features, "ibp_cm", device="cpu")
    with pytest.raises(InvalidIdsError, match="out of range"):
        storage.fetch(torch.tensor([0, 2708]), "cpu")
    with pytest.raises(InvalidIdsError, match="negative"):
        storage.fetch(torch.tensor([-1, 3]), "cpu")
    with pytest.raises(InvalidIdsError, match="dtype"):
        storage.fetch(torch.tensor([0.0, 1.0]), "cpu")
    with pytest.raises(TypeError, match="one storage per type"):
        storage.fetch({"paper": torch.tensor([0])}, "cpu")


def test_import_error_names_the_extra(mod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins
    import sys

    real_import = builtins.__import__

    def no_dgl(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "dgl":
            raise ImportError("No module named 'dgl'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dgl)
    monkeypatch.delitem(sys.modules, "dgl", raising=False)
    mod.import_dgl.cache_clear()
    try:
        with pytest.raises(ImportError, match=r'pip install "ibpcache\[dgl\]"'):
            mod.import_dgl()
    finally:
        monkeypatch.undo()
        mod.import_dgl.cache_clear()
        mod.import_dgl()


# ---------------------------------------------------------------------------------------------------------------
# Pipelined loading: sampling, fetch and training overlapped, the same batches


class _Seed:
    """worker_init_fn seeding DGL in each worker (picklable)."""

    def __init__(self, dgl: Any) -> None:
        self.seed = dgl.seed

    def __call__(self, worker_id: int) -> None:
        self.seed(100 + worker_id)


def _seeded_loader(dgl: Any, g: Any, n: int, workers: int) -> Any:
    sampler = dgl.dataloading.NeighborSampler([25, 10])
    return dgl.dataloading.DataLoader(g, torch.arange(n), sampler, device="cpu", batch_size=256, shuffle=True,
                                      num_workers=workers, worker_init_fn=_Seed(dgl))


def _plain_and_pipelined(dgl: Any, mod: Any, g: Any, n: int) -> tuple[list, list]:
    """The seeded loader's batches over ``g``'s attached features, fetched in turn and through ``mod.pipelined``
    (DGL shuffles with NumPy's global generator, reseeded before each)."""
    import numpy as np

    fetch = mod.FeatureFetch(g, ["feat"], ["label"], device="cpu")
    np.random.seed(0)
    plain = [fetch(b) for b in _seeded_loader(dgl, g, n, 1)]
    np.random.seed(0)
    return plain, list(mod.pipelined(_seeded_loader(dgl, g, n, 1), ["feat"], ["label"], device="cpu"))


@pytest.mark.parametrize("mode", ["dgl", "dgl_pinned", "ibp_c", "ibp_cm"])
def test_pipelined_dataloader_same_batches(dgl: Any, mod: Any, cora: Any, mode: str) -> None:
    g = _graph(dgl, cora.src, cora.dst, cora.num_nodes, cora.labels)
    mod.attach(g, {"feat": cora.features}, mode=mode, device="cpu", budget=0.02)
    plain, piped = _plain_and_pipelined(dgl, mod, g, cora.num_nodes)
    assert len(plain) == len(piped) == -(-cora.num_nodes // 256)
    for (in_a, out_a, blocks_a), (in_b, out_b, blocks_b) in zip(plain, piped):
        assert torch.equal(in_a, in_b) and torch.equal(out_a, out_b)
        assert all(torch.equal(torch.stack(a.edges()), torch.stack(b.edges())) for a, b in zip(blocks_a, blocks_b))
        x = blocks_b[0].srcdata["feat"]
        assert torch.equal(_bytes(x), _bytes(blocks_a[0].srcdata["feat"]))
        assert torch.equal(_bytes(x), _bytes(cora.features[in_b]))
        assert torch.equal(blocks_b[-1].dstdata["label"], cora.labels[out_b])


def test_pipelined_dataloader_over_a_shared_store(dgl: Any, mod: Any, cora: Any) -> None:
    """A FeatureCache whose host rows are another process's shared segment feeds the pipelined loader the same
    bytes as the plain loop (the fetch runs in the pipeline's thread)."""
    import os
    import secrets

    from ibpcache import Codec, CompressedRows
    from ibpcache.cache.feature_cache import FeatureCache

    name = f"test-dgl-{os.getpid()}-{secrets.token_hex(3)}"
    seg = Codec.fit(cora.features).compress(cora.features, layout="packed", pin=False).share(name)
    try:
        g = _graph(dgl, cora.src, cora.dst, cora.num_nodes, cora.labels)
        mod.attach(g, {"feat": FeatureCache(CompressedRows.attach(name), budget_bytes=64 * 1024, device="cpu")})
        plain, piped = _plain_and_pipelined(dgl, mod, g, cora.num_nodes)
    finally:
        seg.unlink()
        seg.close()
    assert len(plain) == len(piped) == -(-cora.num_nodes // 256)
    for (in_a, _, blocks_a), (in_b, _, blocks_b) in zip(plain, piped):
        assert torch.equal(in_a, in_b)
        x = blocks_b[0].srcdata["feat"]
        assert torch.equal(_bytes(x), _bytes(blocks_a[0].srcdata["feat"]))
        assert torch.equal(_bytes(x), _bytes(cora.features[in_b]))


def test_pipelined_refuses_features_fetched_twice(dgl: Any, mod: Any, cora: Any) -> None:
    g = _graph(dgl, cora.src, cora.dst, cora.num_nodes, cora.labels)
    loader = _loader(dgl, g, torch.arange(100), 50, prefetch_node_feats=["feat"])
    with pytest.raises(ValueError, match="prefetched by the sampler"):
        mod.pipelined(loader, ["feat"], device="cpu")
    with pytest.raises(ValueError, match="DataLoader"):
        mod.pipelined([1, 2], device="cpu")
    with pytest.raises(ValueError, match="feature names"):
        mod.FeatureFetch(g, "feat", device="cpu")


def test_pipelined_training_same_losses_per_sampler(dgl: Any, cora: Any) -> None:
    """Both samplers, pipelined or not, two fetch modes: losses and predictions equal within a sampler (DGL's and
    ibpcache's samplers draw different batches); the stage pass times every stage."""
    from examples.gnn import pipeline as gnn

    ds = gnn.load_gnn_dataset("cora")
    cfg = gnn.TrainConfig(batch_size=32, epochs=2, hidden=32, lr=0.01, num_workers=1, verify_batches=2,
                          sample_chunk=2)
    variants = [("dgl", False), ("dgl", True), ("torch", False), ("torch", True)]
    recs = gnn.compare_modes(ds, ["dgl", "ibp_cm"], cfg, device=torch.device("cpu"), variants=variants)
    assert [(r["mode"], r["sampler"], r["pipelined"]) for r in recs] == [
        (m, s, p) for m in ("dgl", "ibp_cm") for s, p in variants]
    for r in recs:
        assert r["identical_losses"] and r["identical_predictions"], (r["mode"], r["sampler"], r["pipelined"])
        assert r["batches"] == 5 and r["sampler_device"] == "cpu"
        assert min(r["sample_ms"], r["fetch_ms"], r["train_ms"]) > 0 and r["epoch_vs_slowest_stage"] > 0
        assert r["speedup_vs_dgl"] is not None and r["speedup_vs_dgl_pinned"] is None
    by = {(r["mode"], r["sampler"], r["pipelined"]): r for r in recs}
    dgl_losses = by[("dgl", "dgl", False)]["run"]["losses"]
    torch_losses = by[("dgl", "torch", False)]["run"]["losses"]
    assert dgl_losses != torch_losses  # different samplers, different batches
    assert by[("ibp_cm", "torch", True)]["run"]["losses"] == torch_losses
    # the torch sampler's pipelined runs take every epoch from one loader run; DGL's start a loader run per epoch
    assert [r["run"]["across_epochs"] for r in recs] == [s == "torch" and p for _ in range(2) for s, p in variants]


def _segment_sums_match_index_add(gnn: Any, ds: Any, device: torch.device) -> None:
    """The example model's mean aggregation (segment sums over edges grouped by destination, by source for the
    gradient) and masked loss equal the ``index_add_`` / ``gather`` forms bit for bit, values and gradients, on real
    sampled hops of Cora."""
    from ibpcache.loaders.sampling import NeighborSampler

    seeds = [ds.train_nids[:64].to(device), ds.train_nids[64:100].to(device)]
    samples = [NeighborSampler(ds.src, ds.dst, ds.num_nodes, [10, 25], device=device, edge_ids=False,
                               groups=groups).sample(seeds, [11, 12])[0] for groups in (False, True)]
    sorted_here, from_sampler = ([gnn.Block.from_hop(h, device) for h in reversed(s.hops)] for s in samples)
    for a, b in zip(sorted_here, from_sampler):  # the sampler's groups (one sort per call) equal the block's own
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in
                   ("src", "dst", "inv_deg", "src_by_dst", "dst_ptr", "dst_by_src", "src_ptr"))
    gen = torch.Generator(device=device).manual_seed(5)
    for block in from_sampler:
        h = torch.randn(block.n_src, 16, generator=gen, device=device).requires_grad_()
        new = gnn.SAGEConv._mean(block, h)
        old = h.new_zeros(block.n_dst, 16).index_add(0, block.dst, h.index_select(0, block.src)) * block.inv_deg
        g = torch.randn(new.shape, generator=gen, device=device)
        assert torch.equal(new, old)
        assert torch.equal(torch.autograd.grad(new, h, g)[0], torch.autograd.grad(old, h, g)[0])
    logits = (torch.randn(64, 7, generator=gen, device=device) * 4).requires_grad_()
    labels = torch.randint(0, 7, (64,), generator=gen, device=device)
    new = gnn.cross_entropy(logits, labels)
    old = -torch.log_softmax(logits, 1).gather(1, labels.view(-1, 1)).mean()
    assert torch.equal(new, old)
    assert torch.equal(torch.autograd.grad(new, logits)[0], torch.autograd.grad(old, logits)[0])


def test_block_inverse_degrees_are_zero_without_neighbours() -> None:
    """A block's mean weights: 1 / in-degree per destination, bit for bit, and 0 (not inf or NaN) where a
    destination sampled no neighbour."""
    from examples.gnn import pipeline as gnn

    src = torch.tensor([3, 4, 4, 5, 6, 3, 1], dtype=torch.int64)
    dst = torch.tensor([0, 0, 2, 2, 2, 5, 5], dtype=torch.int64)  # destinations 1, 3, 4 have none
    block = gnn.Block._build(src, dst, 7, 6, torch.device("cpu"))
    deg = torch.bincount(dst, minlength=6).to(torch.float32)
    want = torch.where(deg > 0, 1.0 / deg.clamp(min=1), torch.zeros_like(deg)).unsqueeze(1)
    assert torch.equal(block.inv_deg.view(torch.int32), want.view(torch.int32))
    assert block.inv_deg[[1, 3, 4], 0].tolist() == [0.0, 0.0, 0.0]


def test_segment_sums_equal_index_add_bit_for_bit() -> None:
    from examples.gnn import pipeline as gnn

    _segment_sums_match_index_add(gnn, gnn.load_gnn_dataset("cora"), torch.device("cpu"))


@pytest.mark.gpu
def test_gpu_segment_sums_equal_deterministic_index_add_and_blocks_build_without_a_sync() -> None:
    """On the GPU, against deterministic ``index_add_``; and building a block's edge groups (in the sampling stage,
    which runs ahead of training) reads nothing back to the host."""
    from examples.gnn import pipeline as gnn
    from ibpcache.loaders.sampling import NeighborSampler

    ds = gnn.load_gnn_dataset("cora")
    dev = torch.device("cuda")
    with gnn.deterministic_cuda(True):
        _segment_sums_match_index_add(gnn, ds, dev)
    samples = [NeighborSampler(ds.src, ds.dst, ds.num_nodes, [10, 25], device=dev, edge_ids=False,
                               groups=groups).sample([ds.train_nids[:64].to(dev)], [3])[0] for groups in (False, True)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        blocks = [gnn.Block.from_hop(h, dev) for s in samples for h in s.hops]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(int(b.dst_ptr[-1]) == b.src.numel() == int(b.src_ptr[-1]) for b in blocks)


def _sampled_batches(gnn: Any, ds: Any, device: torch.device, n: int, **cfg_kw: Any) -> tuple[Any, list[Any]]:
    """``n`` training batches of real Cora rows from ibpcache's sampler on ``device``, and their config."""
    import itertools

    cfg = gnn.TrainConfig(batch_size=32, hidden=16, sampler="torch", sample_chunk=3, **cfg_kw)
    sampler = gnn.build_torch_sampler(ds, cfg, device)
    sampled = itertools.islice(iter(gnn._batches(ds, None, cfg, device, sampler, train=True)), n)
    return cfg, [gnn._Batch(s.input_nodes, s.blocks, ds.node_rows(s.input_nodes.cpu()).to(device), s.y)
                 for s in sampled]


def _model(gnn: Any, ds: Any, cfg: Any, device: torch.device) -> Any:
    torch.manual_seed(3)
    model = gnn.GraphSAGE(int(np.prod(ds.row_shape)), cfg.hidden, ds.num_classes, len(cfg.fanouts), cfg.dropout)
    model.seed_dropout(7)
    return model.to(device).train()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**7))
def test_padded_size_leaves_a_spare_row_and_pads_little(n: int) -> None:
    from examples.gnn.pipeline import padded_size

    c = padded_size(n)
    assert n + 1 <= c <= (n + 1) * 17 // 16 + 1
    assert padded_size(c - 1) == c and all(padded_size(m) <= c for m in range(max(0, n - 3), n + 1))


def test_a_padded_batch_changes_no_real_row() -> None:
    """Padding a batch (filler edges in no segment, padding labels -1) leaves every real row's logits as they were,
    bit for bit, and the loss and gradients those of the real rows (the mean is taken over a count instead of a
    length, so the last bits may differ). Every padding node's segment is empty, so no segment sum runs through
    the filler edges one by one."""
    from examples.gnn import pipeline as gnn

    ds, cpu = gnn.load_gnn_dataset("cora"), torch.device("cpu")
    cfg, batches = _sampled_batches(gnn, ds, cpu, 3, dropout=0.0)
    model = _model(gnn, ds, cfg, cpu)
    steps = gnn.GraphedStep(model, torch.optim.Adam(model.parameters()), cpu, graphs=False)
    for b in batches:
        key = gnn._PaddedBatch.key_of(b)
        padded = gnn._PaddedBatch(key, steps._arena(key, b.x), cfg.hidden, cpu)
        padded.fill(b, model)
        assert padded.x.shape[0] > b.x.shape[0] and padded.labels.numel() > b.y.numel()
        for pb, blk in zip(padded.blocks, b.blocks):
            e = blk.src_by_dst.numel()
            assert pb.src_by_dst.numel() > e
            assert torch.equal(pb.dst_ptr[blk.n_dst:], torch.full_like(pb.dst_ptr[blk.n_dst:], e))
            assert torch.equal(pb.src_ptr[blk.n_src:], torch.full_like(pb.src_ptr[blk.n_src:], e))
        want = model(b.blocks, b.x)
        got = model([pb.block for pb in padded.blocks], padded.x)
        assert torch.equal(got[:want.shape[0]], want)
        loss, ref = padded.loss(model), gnn.cross_entropy(want, b.y)
        assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
        params = list(model.parameters())
        for g, r in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref, params)):
            assert torch.allclose(g, r, rtol=1e-5, atol=1e-8)


def test_padded_steps_keep_gradients_in_one_flat_buffer_and_reduce_it_before_the_optimizer() -> None:
    """Every parameter's gradient is a view of ``GraphedStep.grads`` (a data-parallel reduce is one call on it);
    ``reduce`` sees the step's gradient before the optimizer does; a caller that sets the gradients to None gets a
    new buffer, and the steps go on as if nothing happened."""
    from examples.gnn import pipeline as gnn

    ds, cpu = gnn.load_gnn_dataset("cora"), torch.device("cpu")
    cfg, batches = _sampled_batches(gnn, ds, cpu, 3)

    def run(zero_between: bool) -> list[torch.Tensor]:
        model = _model(gnn, ds, cfg, cpu)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        seen: list[torch.Tensor] = []
        steps = gnn.GraphedStep(model, opt, cpu, graphs=False, reduce=lambda flat: seen.append(flat.clone()))
        losses = []
        for i, b in enumerate(batches):
            losses.append(steps(b))
            params = list(model.parameters())
            assert steps.grads.numel() == sum(p.numel() for p in params)
            assert all(p.grad.untyped_storage().data_ptr() == steps.grads.untyped_storage().data_ptr()
                       for p in params)
            assert torch.equal(seen[i], steps.grads)  # reduce saw the gradient the optimizer used
            if zero_between:
                opt.zero_grad(set_to_none=True)
        assert len(seen) == len(batches)
        return losses

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_padded_steps_train_deterministically_and_graphs_need_cuda() -> None:
    from examples.gnn import pipeline as gnn

    ds, cpu = gnn.load_gnn_dataset("cora"), torch.device("cpu")
    cfg, batches = _sampled_batches(gnn, ds, cpu, 4)
    runs = []
    for _ in range(2):
        model = _model(gnn, ds, cfg, cpu)
        steps = gnn.GraphedStep(model, torch.optim.Adam(model.parameters(), lr=0.01), cpu, graphs=False)
        runs.append([steps(b) for b in batches])
    assert all(torch.equal(a, b) for a, b in zip(*runs)) and all(torch.isfinite(x) for x in runs[0])
    assert runs[0][-1] < runs[0][0]
    with pytest.raises(ConfigError, match="CUDA"):
        gnn.GraphedStep(model, torch.optim.Adam(model.parameters()), cpu)
    assert isinstance(gnn.make_step(model, torch.optim.Adam(model.parameters()), replace(cfg, step_graphs=True), cpu),
                      functools.partial)  # graphs are for CUDA; the CPU steps eagerly
    # a capturable Adam (stepped inside the step's graph) only where steps are graphed: CUDA, step_graphs on
    for graphed in (False, True):
        opt = gnn.new_optimizer(model, replace(cfg, step_graphs=graphed, optimizer_in_graph=True), cpu)
        assert not opt.param_groups[0]["capturable"]


@pytest.mark.gpu
@pytest.mark.parametrize("capturable,split", [(False, False), (True, False), (True, True)])
def test_gpu_step_graphs_equal_the_same_padded_steps_taken_eagerly(capturable: bool, split: bool) -> None:
    """Replayed graphs give the eager padded step's losses and weights bit for bit (dropout on), capture once per
    padded shape, and replay without a host sync; a capturable Adam steps inside the graph (the whole step one
    replay) and gives the same bits as its eager steps. With ``split`` the graphed steps are captured and replayed
    on the step side of an SM split (a green context of fewer SMs), as a pipelined run with ``fetch_sms`` does."""
    from examples.gnn import pipeline as gnn
    from ibpcache.loaders.sm_split import split_sms

    ds, dev = gnn.load_gnn_dataset("cora"), torch.device("cuda", torch.cuda.current_device())
    cfg, batches = _sampled_batches(gnn, ds, dev, 6)
    sms = split_sms(dev, 32) if split else None
    with gnn.deterministic_cuda(True, tf32=True):
        eager_model, graph_model = _model(gnn, ds, cfg, dev), _model(gnn, ds, cfg, dev)
        eager = gnn.GraphedStep(eager_model, torch.optim.Adam(eager_model.parameters(), lr=0.01,
                                                              capturable=capturable), dev, graphs=False)
        graphs = gnn.GraphedStep(graph_model, torch.optim.Adam(graph_model.parameters(), lr=0.01,
                                                               capturable=capturable), dev,
                                 capture_stream=sms.capture_stream if sms else None)
        assert graphs.optimizer_in_graph == capturable and not eager.optimizer_in_graph
        if capturable:
            with pytest.raises(ConfigError, match="inside the graph"):
                graphs.forward_backward(batches[0])
        want = [eager(b) for b in batches * 3]
        torch.cuda.synchronize()
        with torch.cuda.stream(sms.step_stream if sms else None):  # None: a no-op
            got = [graphs(b) for b in batches * 2]  # a shape's first batch steps eagerly, its second is captured
            torch.cuda.current_stream().synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got += [graphs(b) for b in batches]  # replays only
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.current_stream().synchronize()
    assert [float(x) for x in got] == [float(x) for x in want]
    assert all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), graph_model.parameters()))
    stats = graphs.stats()
    shapes = len({gnn._PaddedBatch.key_of(b) for b in batches})
    assert stats["graph_error"] is None and stats["graph_captures"] == stats["padded_shapes"] == shapes
    assert stats["graph_replays"] >= len(batches) and eager.stats()["graph_replays"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer_in_graph", [False, True])
def test_gpu_step_graphs_give_every_mode_the_same_losses(dgl: Any, cora: Any, optimizer_in_graph: bool) -> None:
    from examples.gnn import pipeline as gnn

    ds = gnn.load_gnn_dataset("cora")
    # Cora's sampled batches of 64 never repeat a padded shape, so every step of the first config is eager. The
    # second trains on every training node with every neighbour: one batch of one shape an epoch, stepped eagerly in
    # epoch 1, captured in epoch 2 (and replayed to run it: capturing runs nothing) and replayed in epoch 3, so the
    # graphed step (and its optimizer) is what is compared.
    for batch_size, fanouts, epochs in ((64, (25, 10), 2), (256, (-1, -1), 3)):
        cfg = gnn.TrainConfig(batch_size=batch_size, fanouts=fanouts, epochs=epochs, hidden=64, lr=0.01,
                              num_workers=1, sampler="torch", sampler_device="cuda", step_graphs=True,
                              optimizer_in_graph=optimizer_in_graph)
        recs = gnn.compare_modes(ds, ["dgl", "ibp_cm"], cfg, device=torch.device("cuda"),
                                 variants=[("torch", False), ("torch", True)])
        assert all(r["identical_losses"] and r["identical_predictions"] for r in recs)
        for r in recs:  # each epoch says how many steps it captured and replayed (a slow epoch may still be capturing)
            each = [(e["graph_captures"], e["graph_replays"]) for e in r["run"]["epochs"]]
            assert all(0 <= c and 0 <= p <= e["batches"] for (c, p), e in zip(each, r["run"]["epochs"]))
            if epochs == 3:
                assert each == [(0, 0), (1, 1), (0, 1)], (r["mode"], r["pipelined"], each)


@pytest.mark.gpu
def test_gpu_split_sms_runs_give_the_losses_of_the_whole_gpu(dgl: Any, cora: Any) -> None:
    """``fetch_sms``: the sampler and the fetch on a green context's SMs, the graphed step captured and replayed on
    the others; ``fetch_validate="lazy"``: fetches that never wait for the GPU. Every mode's losses and predictions
    are equal, and equal the run on the whole GPU with eager checks (same batches, same kernels); the one-shape
    config captures in epoch 2 and replays in epoch 3, so the graphs ran there."""
    from examples.gnn import pipeline as gnn

    ds = gnn.load_gnn_dataset("cora")
    base = gnn.TrainConfig(batch_size=256, fanouts=(-1, -1), epochs=3, hidden=64, lr=0.01, num_workers=1,
                           sampler="torch", sampler_device="cuda", step_graphs=True)
    losses = {}
    for sms, check in ((None, "eager"), (32, "eager"), (32, "lazy")):
        cfg = replace(base, fetch_sms=sms, fetch_validate=check)
        recs = gnn.compare_modes(ds, ["dgl", "ibp_cm"], cfg, device=torch.device("cuda"), variants=[("torch", True)])
        assert all(r["identical_losses"] and r["identical_predictions"] for r in recs)
        for r in recs:
            each = [(e["graph_captures"], e["graph_replays"]) for e in r["run"]["epochs"]]
            assert each == [(0, 0), (1, 1), (0, 1)], (sms, r["mode"], each)
        losses[sms, check] = [r["run"]["losses"] for r in recs]
    assert losses[None, "eager"] == losses[32, "eager"] == losses[32, "lazy"]


# ---------------------------------------------------------------------------------------------------------------
# Training: the lossless path changes nothing


def test_training_losses_identical_with_and_without_ibpcache(dgl: Any, cora: Any) -> None:
    from examples.gnn import pipeline as gnn

    ds = gnn.load_gnn_dataset("cora")
    g = gnn.build_graph(ds)
    cfg = gnn.TrainConfig(batch_size=32, epochs=2, hidden=64, lr=0.01, num_workers=1)
    cpu = torch.device("cpu")
    base = gnn.run_mode(ds, g, "dgl", cfg, device=cpu)
    ibp = gnn.run_mode(ds, g, "ibp_cm", cfg, device=cpu, budget=0.01)
    assert len(base.losses) == 2 and len(base.losses[0]) == 5  # 140 training nodes / 32
    assert base.losses == ibp.losses
    assert base.predictions_sha1 == ibp.predictions_sha1 and base.accuracy == ibp.accuracy
    assert 0.3 < ibp.accuracy <= 1.0
    summary = gnn.stats_summary(ibp, ds)
    assert summary["ratio"] > 10 and summary["bytes_moved"] < summary["raw_bytes"]
    assert base.losses[0] != base.losses[1]
    assert all(e.graph_captures == 0 == e.graph_replays for e in base.epochs + ibp.epochs)  # eager steps on a CPU


def test_gc_freeze_holds_over_every_mode_s_epochs_and_changes_no_loss(dgl: Any, cora: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from examples.gnn import pipeline as gnn

    ds = gnn.load_gnn_dataset("cora")
    g = gnn.build_graph(ds)
    counts: list[int] = []
    train_epoch = gnn._train_epoch

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts.append(gc.get_freeze_count())
        return train_epoch(*args, **kwargs)

    monkeypatch.setattr(gnn, "_train_epoch", counted)
    runs = []
    for freeze, pipelined in ((False, False), (True, False), (True, True)):
        cfg = gnn.TrainConfig(batch_size=32, epochs=2, hidden=16, lr=0.01, num_workers=1, gc_freeze=freeze,
                              pipelined=pipelined, stage_batches=0)
        counts.clear()
        runs.append(gnn.run_mode(ds, g, "ibp_cm", cfg, device=torch.device("cpu"), budget=0.01))
        assert len(counts) == 2 and all((n > 0) == freeze for n in counts), counts
        assert gc.get_freeze_count() == 0
        for e in runs[-1].epochs:  # the collector's pauses per epoch (a frozen heap may see none)
            assert e.gc_full >= 0 and e.gc_young >= 0 and e.gc_seconds >= 0.0
            assert (e.gc_seconds > 0.0) == (e.gc_full + e.gc_young > 0)
    assert runs[0].losses == runs[1].losses == runs[2].losses


@pytest.mark.parametrize("field,value,kwarg,default", [
    ("fetch_blocks_per_sm", 4, "fetch_blocks_per_sm", None),
    ("fetch_validate", "eager", "validate", "lazy"),
])
def test_storage_settings_reach_the_cache_from_the_model_config(dgl: Any, mod: Any, cora: Any, field: str,
                                                                 value: Any, kwarg: str, default: Any) -> None:
    """``model.<field>`` (configs/model/sage.yaml) -> TrainConfig -> make_storage -> FeatureCache; one storage
    serves a mode's configs, so configs that disagree are refused."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from examples.gnn import pipeline as gnn
    from ibpcache.errors import ConfigError

    model = OmegaConf.load(Path(__file__).resolve().parents[2] / "configs" / "model" / "sage.yaml")
    data = {"batch_size": 32}
    assert getattr(gnn.train_config(model, data, epochs=1, seed=0), field) == default
    setattr(model, field, value)
    assert getattr(gnn.train_config(model, data, epochs=1, seed=0), field) == value
    storage = mod.make_storage(cora.features, "ibp_cm", device="cpu", budget=0.05, **{kwarg: value})
    assert getattr(storage.backend.cache, kwarg) == value
    ds = gnn.load_gnn_dataset("cora")
    cfgs = [gnn.TrainConfig(epochs=1, **{field: v}) for v in (default, value)]
    with pytest.raises(ConfigError, match=field):
        gnn.run_variants(ds, gnn.build_graph(ds), "ibp_cm", cfgs, device=torch.device("cpu"))


@pytest.mark.gpu
def test_gpu_every_mode_bit_identical_and_same_losses(dgl: Any, cora: Any) -> None:
    from examples.gnn import pipeline as gnn

    ds = gnn.load_gnn_dataset("cora")
    g = gnn.build_graph(ds)
    cuda = torch.device("cuda")
    for mode in ALL_MODES:
        from ibpcache.loaders.dgl import attach

        attach(g, {"feat": ds.features}, mode=mode, device="cuda", budget=0.01)
        for input_nodes, _, blocks in _loader(dgl, g, torch.arange(ds.num_nodes), 512, workers=1,
                                              prefetch_node_feats=["feat"]):
            x = blocks[0].srcdata["feat"]
            assert x.device.type == "cuda"
            assert torch.equal(_bytes(x.cpu()), _bytes(ds.features[input_nodes]))
    cfg = gnn.TrainConfig(batch_size=32, epochs=2, hidden=64, lr=0.01, num_workers=1)
    runs = [gnn.run_mode(ds, g, m, cfg, device=cuda) for m in ALL_MODES]
    for r in runs[1:]:
        assert r.losses == runs[0].losses, r.mode
        assert r.predictions_sha1 == runs[0].predictions_sha1, r.mode


@pytest.mark.gpu
def test_gpu_storage_reads_and_errors(dgl: Any, mod: Any, cora: Any) -> None:
    g = _graph(dgl, cora.src, cora.dst, cora.num_nodes)
    mod.attach(g, {"feat": cora.features}, mode="ibp_cm", device="cuda", budget=0.01)
    storage = g.get_node_storage("feat")
    ids = torch.tensor([2707, 0, 0, 5, 1000])
    got = storage.fetch(ids, "cpu")  # rows land on the cache's device whatever DGL asks for
    assert got.device.type == "cuda" and torch.equal(_bytes(got.cpu()), _bytes(cora.features[ids]))
    assert torch.equal(storage.fetch(ids.cuda(), "cuda").cpu(), cora.features[ids])  # ids already on the GPU
    full = g.ndata["feat"]  # a full read is assembled in host memory, piece by piece
    assert full.device.type == "cpu" and torch.equal(_bytes(full), _bytes(cora.features))
    with pytest.raises(InvalidIdsError):
        storage.fetch(torch.tensor([cora.num_nodes]), "cuda")


@pytest.mark.gpu
def test_gpu_pipelined_samplers_and_modes_same_losses(dgl: Any, cora: Any) -> None:
    """On the GPU: every mode, both samplers, pipelined or not; and ibpcache's sampler on the GPU gives the CPU
    sampler's batches, so its runs give the same losses."""
    from dataclasses import replace

    from examples.gnn import pipeline as gnn

    ds = gnn.load_gnn_dataset("cora")
    cfg = gnn.TrainConfig(batch_size=64, epochs=2, hidden=64, lr=0.01, num_workers=1, verify_batches=3,
                          sampler_device="cuda")
    variants = [("dgl", False), ("dgl", True), ("torch", False), ("torch", True)]
    recs = gnn.compare_modes(ds, ALL_MODES, cfg, device=torch.device("cuda"), variants=variants)
    assert len(recs) == len(ALL_MODES) * len(variants)
    for r in recs:
        assert r["identical_losses"] and r["identical_predictions"], (r["mode"], r["sampler"], r["pipelined"])
        if r["sampler"] == "torch":
            assert r["sampler_device"].startswith("cuda")
    g = gnn.build_graph(ds)
    on_cpu = gnn.run_variants(ds, g, "ibp_cm", [replace(cfg, sampler="torch", sampler_device="cpu")],
                              device=torch.device("cuda"))[0]
    on_gpu = next(r for r in recs if r["mode"] == "ibp_cm" and r["sampler"] == "torch" and not r["pipelined"])
    assert on_cpu.sampler_device == "cpu" and on_cpu.losses == on_gpu["run"]["losses"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ALL_MODES)
def test_gpu_storage_takes_ids_from_a_gpu_sampler(dgl: Any, mod: Any, cora: Any, mode: str) -> None:
    storage = mod.make_storage(cora.features, mode, device="cuda", budget=0.01)
    ids = torch.tensor([2707, 0, 0, 5, 1000], device="cuda")
    got = storage.fetch(ids, "cuda")
    assert got.device.type == "cuda" and torch.equal(_bytes(got.cpu()), _bytes(cora.features[ids.cpu()]))


def test_stage_pass_fetches_then_steps_a_window_at_a_time(dgl: Any) -> None:
    """The timed stage pass fetches a window of batches, then steps them (so a stage runs ahead of the GPU as it
    does alone, not synced per batch), covering every batch once and holding at most one window's batches."""
    from examples.gnn import pipeline as gnn

    calls: list[tuple[str, int]] = []
    live: set[int] = set()
    most_live = [0]

    class Fetched:
        def __init__(self, i: int) -> None:
            self.i = i
            live.add(i)
            most_live[0] = max(most_live[0], len(live))

        def __del__(self) -> None:
            live.discard(self.i)

    def fetch(i: int) -> Fetched:
        calls.append(("fetch", i))
        return Fetched(i)

    def step(batch: Fetched) -> None:
        calls.append(("step", batch.i))

    n = 2 * gnn._STAGE_WINDOW + 3
    cfg = gnn.TrainConfig(batch_size=4, epochs=1, hidden=8, lr=0.01, num_workers=1, stage_batches=-1)
    out = gnn._stage_times(list(range(n)), fetch, lambda: (torch.nn.Linear(1, 1), step), torch.device("cpu"),
                           cfg, threads=torch.get_num_threads())
    assert out["batches"] == n
    timed = calls[2:2 + 2 * n]  # after the warm-up's fetch and step of batch 0; the profiled pass follows
    expected: list[tuple[str, int]] = []
    for at in range(0, n, gnn._STAGE_WINDOW):
        window = range(at, min(at + gnn._STAGE_WINDOW, n))
        expected += [("fetch", i) for i in window] + [("step", i) for i in window]
    assert timed == expected
    assert most_live[0] <= gnn._STAGE_WINDOW + 1  # a window, plus the warm-up's batch until it is dropped
