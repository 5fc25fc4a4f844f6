"""CachedEmbeddingBag / TableBatchedCachedEmbeddingBag against torch.nn.EmbeddingBag, bit for bit.

Tables are slices of the real MiniLM word-embedding table (real trained rows, so the IBP host store really
compresses). Every equality test runs on the CPU (CI) and, marked ``gpu``, on CUDA (zero-copy fetch path).
Small caches force evictions, write-backs and oversized batches on every few steps.
"""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROWS = 300
DIM = 64


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table(minilm: torch.Tensor) -> torch.Tensor:
    """300 real word vectors (ids 2000..2299: ordinary words), first 64 dims: a 256-byte-row table."""
    return minilm[2000:2000 + ROWS, :DIM].clone()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: not bit-identical (max diff {(a.cpu() - b.cpu()).abs().max()})"


def make(weight: torch.Tensor, device: str, **kw: Any):
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    kw.setdefault("cache_ratio", 0.05)
    kw.setdefault("compress", True)  # these tests are about the compressed engine; the planner's default has its own
    return CachedEmbeddingBag(weight.shape[0], weight.shape[1], _weight=weight.clone(), device=device, **kw)


def reference(weight: torch.Tensor, device: str, **kw: Any) -> torch.nn.EmbeddingBag:
    return torch.nn.EmbeddingBag(weight.shape[0], weight.shape[1], _weight=weight.clone().to(device), **kw)


def random_bags(gen: torch.Generator, n_rows: int, n_bags: int, max_len: int = 9, hot: int = 0):
    """Bags of random length (some empty); ``hot`` > 0 draws half the ids from the first ``hot`` rows."""
    lengths = torch.randint(0, max_len + 1, (n_bags,), generator=gen)
    n = int(lengths.sum())
    ids = torch.randint(0, n_rows, (n,), generator=gen)
    if hot:
        mask = torch.rand(n, generator=gen) < 0.5
        ids[mask] = torch.randint(0, hot, (int(mask.sum()),), generator=gen)
    offsets = torch.zeros(n_bags, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)[:-1]
    return ids, offsets


def skip_if_no_cuda(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


# ------------------------------------------------------------------------------------------------
# forward equality
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_offsets_input_matches_torch(table: torch.Tensor, device: str, mode: str, include_last_offset: bool) -> None:
    m = make(table, device, mode=mode, include_last_offset=include_last_offset)
    ref = reference(table, device, mode=mode, include_last_offset=include_last_offset)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        ids, offsets = random_bags(gen, ROWS, 16, hot=20)
        if include_last_offset:
            offsets = torch.cat([offsets, torch.tensor([ids.numel()])])
        with torch.set_grad_enabled(step % 2 == 0):  # training (ranked) and inference (slot) paths
            got = m(ids, offsets)
        want = ref(ids.to(device), offsets.to(device))
        assert_bitwise(got, want, f"step {step}")
    st = m.stats()
    assert st["misses"] > 0 and st["evictions"] > 0 and st["hits"] > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_2d_input_matches_torch(table: torch.Tensor, device: str, mode: str) -> None:
    m = make(table, device, mode=mode, cache_ratio=0.1)
    ref = reference(table, device, mode=mode)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        ids = torch.randint(0, ROWS, (7, 3), generator=gen)
        assert_bitwise(m(ids), ref(ids.to(device)))
    int32 = torch.randint(0, ROWS, (5, 4), generator=gen, dtype=torch.int32)
    assert_bitwise(m(int32), ref(int32.to(device)), "int32 ids")


@pytest.mark.parametrize("device", DEVICES)
def test_per_sample_weights_and_shape_hook(table: torch.Tensor, device: str) -> None:
    m = make(table, device, mode="sum")
    ref = reference(table, device, mode="sum")
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids, offsets = random_bags(gen, ROWS, 12)
        w = torch.rand(ids.numel(), generator=gen)
        got = m(ids, offsets, per_sample_weights=w, shape_hook=lambda t: t * 2)
        want = ref(ids.to(device), offsets.to(device), per_sample_weights=w.to(device)) * 2
        assert_bitwise(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [7, -1])
def test_padding_idx_matches_torch(table: torch.Tensor, device: str, mode: str, padding_idx: int) -> None:
    m = make(table, device, mode=mode, padding_idx=padding_idx, cache_ratio=0.02)
    ref = reference(table, device, mode=mode, padding_idx=padding_idx)
    pad = padding_idx % ROWS
    gen = torch.Generator().manual_seed(4)
    for step in range(6):
        ids, offsets = random_bags(gen, ROWS, 10)
        ids[torch.rand(ids.numel(), generator=gen) < 0.3] = pad
        with torch.set_grad_enabled(step % 2 == 0):
            got = m(ids, offsets)
        assert_bitwise(got, ref(ids.to(device), offsets.to(device)))
    ids = torch.tensor([pad, pad, 3])  # a bag of only padding -> zeros, like torch
    assert_bitwise(m(ids, torch.tensor([0, 2])), ref(ids.to(device), torch.tensor([0, 2], device=device)))


class ColossalEvictionStrategy(enum.Enum):
    """Stand-in with Colossal-AI 0.5's member names and values (accepted by name)."""

    LFU = 1
    DATASET = 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy,with_freq", [
    ("LFU", False), ("LFU", True), ("LRU", False), ("DATASET", False), ("DATASET", True),
    (ColossalEvictionStrategy.LFU, False), (ColossalEvictionStrategy.DATASET, True), ("lru", True),
])
def test_eviction_strategies_match_torch(table: torch.Tensor, device: str, strategy: Any, with_freq: bool) -> None:
    """DATASET with a frequency mapping must NOT renumber ids (Colossal-AI 0.5 scrambles a pretrained weight)."""
    from ibpcache.loaders.embedding_bag import EvictionStrategy

    gen = torch.Generator().manual_seed(5)
    freq = torch.randint(0, 1000, (ROWS,), generator=gen) if with_freq else None
    if isinstance(strategy, str) and strategy.isupper():
        strategy = EvictionStrategy[strategy]
    m = make(table, device, mode="sum", evict_strategy=strategy, ids_freq_mapping=freq, cache_ratio=0.04)
    ref = reference(table, device, mode="sum")
    for _ in range(6):
        ids, offsets = random_bags(gen, ROWS, 12, hot=15)
        assert_bitwise(m(ids, offsets), ref(ids.to(device), offsets.to(device)))
    assert m.stats()["evictions"] > 0


def test_eviction_strategy_coercion() -> None:
    from ibpcache.loaders.embedding_bag import EvictionStrategy

    assert EvictionStrategy.coerce(ColossalEvictionStrategy.DATASET) is EvictionStrategy.DATASET
    assert EvictionStrategy.coerce("lfu") is EvictionStrategy.LFU
    with pytest.raises(ValueError, match="evict_strategy"):
        EvictionStrategy.coerce("fifo")


def test_lru_keeps_recent_rows(table: torch.Tensor) -> None:
    """With a 3-row LRU cache, the row used last survives a one-row miss; under LFU the most used survives."""
    m = make(table, "cpu", mode="sum", evict_strategy="LRU", cache_ratio=3 / ROWS, warmup_ratio=0.0)
    for ids in ([1, 2, 3], [1], [9]):  # 2 is the least recently used when 9 comes in
        m(torch.tensor(ids), torch.tensor([0]))
    assert set(m.cache_weight_mgr.id_of.tolist()) == {1, 3, 9}
    lfu = make(table, "cpu", mode="sum", evict_strategy="LFU", cache_ratio=3 / ROWS, warmup_ratio=0.0)
    for ids in ([1, 1, 2, 3, 3], [9]):  # 2 was used least
        lfu(torch.tensor(ids), torch.tensor([0]))
    assert set(lfu.cache_weight_mgr.id_of.tolist()) == {1, 3, 9}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_ratio", [1 / ROWS, 0.01, 0.2, 1.0])
def test_cache_ratios_one_row_to_whole_table(table: torch.Tensor, device: str, cache_ratio: float) -> None:
    m = make(table, device, mode="mean", cache_ratio=cache_ratio)
    ref = reference(table, device, mode="mean")
    gen = torch.Generator().manual_seed(6)
    for _ in range(4):
        ids, offsets = random_bags(gen, ROWS, 8)
        assert_bitwise(m(ids, offsets), ref(ids.to(device), offsets.to(device)))
    assert m.cache_weight_mgr.capacity == max(1, int(ROWS * cache_ratio))


@pytest.mark.parametrize("device", DEVICES)
def test_more_unique_ids_than_cache_rows(table: torch.Tensor, device: str) -> None:
    """Colossal-AI refuses such batches; we serve them and shrink back to the budget on the next call."""
    m = make(table, device, mode="sum", cache_ratio=0.02)  # 6 rows
    ref = reference(table, device, mode="sum")
    ids = torch.randperm(ROWS, generator=torch.Generator().manual_seed(7))[:100]
    offsets = torch.arange(0, 100, 10)
    assert_bitwise(m(ids, offsets), ref(ids.to(device), offsets.to(device)))
    st = m.stats()
    assert st["overflow_batches"] == 1 and st["overflow_rows_max"] == 100 - 6
    small = torch.tensor([1, 2, 3])
    assert_bitwise(m(small, torch.tensor([0])), ref(small.to(device), torch.tensor([0], device=device)))
    assert m.cached_weight.shape[0] == 6


@pytest.mark.parametrize("device", DEVICES)
def test_empty_input_and_empty_bags(table: torch.Tensor, device: str) -> None:
    """Empty bags are legal in torch (DLRM multi-hot features often are): zeros, like torch."""
    m = make(table, device, mode="mean")
    ref = reference(table, device, mode="mean")
    empty = torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(3, dtype=torch.int64)
    assert_bitwise(m(empty, offsets), ref(empty.to(device), offsets.to(device)))
    assert_bitwise(m(torch.zeros(0, 4, dtype=torch.int64)), ref(torch.zeros(0, 4, dtype=torch.int64, device=device)))


def test_full_row_width_compresses(minilm: torch.Tensor) -> None:
    """Full 1536-byte MiniLM rows, auto-fitted codec: the host store really is compressed and lossless."""
    w = minilm[5000:5400].clone()
    m = make(w, "cpu", mode="sum", cache_ratio=0.05)
    st = m.stats()
    assert st["host_ratio"] > 1.05 and st["compressed_rows_fraction"] > 0.9
    assert_bitwise(m.weight, w)
    ref = reference(w, "cpu", mode="sum")
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        ids, offsets = random_bags(gen, 400, 10)
        assert_bitwise(m(ids, offsets), ref(ids, offsets))
    assert st["bytes_fetched"] <= st["raw_bytes_fetched"]


@pytest.mark.parametrize("device", DEVICES)
def test_auto_compress_trains_exactly_with_exponent_rows(table: torch.Tensor, device: str) -> None:
    """compress="auto" weighs IBP, exponent coding and raw rows (CPU: the smallest store, exponent coding for these
    dense floats) by reads; a table that starts training keeps raw host rows from its first write-back (the coded
    write-back cost more than it saved), says so in stats(), and the host table after flush equals a plain
    EmbeddingBag trained the same."""
    skip_if_no_cuda(device)
    m = make(table, device, mode="sum", cache_ratio=0.03, compress="auto")
    layout = m.stats()["host_layout"]
    # 64-wide fp32 rows fit 64-element segments: the planner also weighs 32-element ones (FAST_SEG)
    assert set(layout["ratios"]) == {"ibp", "exponent", "exponent_seg32"}
    assert layout["method"] in ("ibp", "exponent", "exponent_seg32", "raw")
    if device == "cpu":
        assert layout["method"] == "exponent" and m.cache_weight_mgr.store.codec.method == "exponent"
    ref = reference(table, device, mode="sum")
    _train(m, ref, _sgd, device, steps=12, mode="sum")
    m.flush()
    assert_bitwise(m.cache_weight_mgr.store.dense(), ref.weight, "host table after flush")
    st = m.stats()
    mgr = m.cache_weight_mgr
    assert st["write_backs"] > 0 and not mgr.store.compress and st["codec_method"] == "raw"
    assert mgr.raw_for_writes == (layout["method"] != "raw")
    if layout["method"] != "raw":
        assert st["host_layout"]["reason"].startswith("trained:") and layout["method"] in st["host_layout"]["reason"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exponent_compressed_weight_serves_both_bags(table: torch.Tensor, device: str, dtype: torch.dtype) -> None:
    """``_weight`` = exponent-coded CompressedRows (in place): the bag and the table-batched bag serve them as they
    are (read-only host store), outputs bit-identical to torch; a CompressedRows of another dtype or shape is refused
    with RowDtypeError / RowShapeError."""
    from ibpcache import Codec
    from ibpcache.errors import RowDtypeError, RowShapeError
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag, TableBatchedCachedEmbeddingBag

    skip_if_no_cuda(device)
    w = table.to(dtype)
    rows = Codec.fit(w, method="exponent").compress(w, layout="inplace", pin=device == "cuda")
    m = CachedEmbeddingBag(ROWS, DIM, _weight=rows, mode="sum", device=device, cache_ratio=0.05).eval()
    ref = reference(w, device, mode="sum")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(4):
            ids, offsets = random_bags(gen, ROWS, 20, hot=10)
            assert_bitwise(m(ids.to(device), offsets.to(device)), ref(ids.to(device), offsets.to(device)))
    assert m.stats()["codec_method"] == "exponent" and m.cache_weight_mgr.store.read_only
    tb = TableBatchedCachedEmbeddingBag([100, 200], DIM, _weight=rows, mode="sum", device=device, cache_ratio=0.05)
    ids = torch.stack([torch.randint(0, 100, (16,), generator=gen), torch.randint(0, 200, (16,), generator=gen)], 1)
    glob = (ids + torch.tensor([0, 100])).reshape(-1, 1).to(device)
    with torch.no_grad():
        want = torch.nn.functional.embedding_bag(glob, w.to(device), mode="sum").reshape(16, -1)
        assert_bitwise(tb(ids.to(device)), want)
    with pytest.raises(RowDtypeError):
        CachedEmbeddingBag(ROWS, DIM, _weight=rows, dtype=torch.float64, device=device)
    with pytest.raises(RowShapeError):
        CachedEmbeddingBag(ROWS + 1, DIM, _weight=rows, device=device)


def test_set_cache_op_and_prepare_ids(table: torch.Tensor) -> None:
    """Colossal-AI's split use: prepare_ids maps ids to slots, then forward takes the slots."""
    m = make(table, "cpu", mode="sum")
    ref = reference(table, "cpu", mode="sum")
    ids, offsets = torch.tensor([5, 9, 5, 200]), torch.tensor([0, 2])
    slots = m.cache_weight_mgr.prepare_ids(ids)
    m.set_cache_op(False)
    assert_bitwise(m(slots, offsets), ref(ids, offsets))
    m.set_cache_op(True)
    assert_bitwise(m(ids, offsets), ref(ids, offsets))
    assert list(m.parameters()) == [m.cache_weight_mgr.cuda_cached_weight]


# ------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------


def _train(m: torch.nn.Module, ref: torch.nn.Module, make_opt, device: str, steps: int, mode: str,
           unique_ids: bool = False, seed: int = 9, psw: bool = False, one_id: bool = False,
           schedule: bool = False) -> None:
    """``steps`` identical training steps on both models, comparing outputs bitwise each step. The last
    step's outputs stay alive during the next forward (as in a usual loop), which keeps autograd's cached
    view of the parameter alive while the cache resizes it. ``one_id``: bags of one id (a ``[B, 1]`` input);
    ``schedule``: the learning rate halves every 3 steps (StepLR)."""
    opt, ref_opt = make_opt(m.parameters()), make_opt(ref.parameters())
    if hasattr(m, "attach_optimizer") and getattr(make_opt, "attach", False):
        m.attach_optimizer(opt)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 3, 0.5) for o in (opt, ref_opt)] if schedule else []
    gen = torch.Generator().manual_seed(seed)
    outs: list = []
    for step in range(steps):
        previous = outs  # noqa: F841 - deliberately alive
        if unique_ids:
            ids = torch.randperm(ROWS, generator=gen)[:40]
            offsets = torch.arange(0, 40, 4)
        else:
            ids, offsets = random_bags(gen, ROWS, 10, hot=12)
        if one_id:
            ids, offsets = ids.view(-1, 1), torch.arange(ids.numel())
        target = torch.randn(offsets.numel(), DIM, generator=gen).to(device)
        w = torch.rand(ids.numel(), generator=gen).to(device) if psw else None
        outs = []
        for model, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad()
            if one_id:
                out = model(ids.to(device), per_sample_weights=None if w is None else w.view(-1, 1))
            else:
                out = model(ids.to(device), offsets.to(device), per_sample_weights=w)
            ((out - target) ** 2).sum().backward()
            o.step()
            outs.append(out)
        for sched in schedulers:
            sched.step()
        assert_bitwise(outs[0], outs[1], f"output at step {step}")


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _adagrad(params):
    return torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1)


_adagrad.attach = True


def _sparse_adam(params):
    return torch.optim.SparseAdam(list(params), lr=0.01)


_sparse_adam.attach = True


def _momentum(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _nesterov_decay(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def _adamw_amsgrad(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05, amsgrad=True)


def _adagrad_decay(params):
    return torch.optim.Adagrad(params, lr=0.05, lr_decay=0.01, weight_decay=0.01)


for _f in (_momentum, _nesterov_decay, _adam, _adamw_amsgrad, _adagrad_decay):
    _f.attach = True
MOVING = [_momentum, _nesterov_decay, _adam, _adamw_amsgrad, _adagrad_decay]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode,sparse,psw", [("sum", False, False), ("mean", False, False), ("max", False, False),
                                             ("sum", True, True), ("mean", True, False)])
def test_training_sgd_bit_exact(table: torch.Tensor, device: str, mode: str, sparse: bool, psw: bool) -> None:
    """N SGD steps, then flush(): the decompressed host table equals a plain EmbeddingBag trained the same."""
    # CUDA sparse add_ and max-mode backward accumulate duplicate rows with atomics (order varies run to run,
    # even between two plain EmbeddingBags), so the GPU variants use batches without repeated ids.
    unique = device == "cuda" and (sparse or mode == "max")
    m = make(table, device, mode=mode, sparse=sparse, cache_ratio=0.03)
    ref = reference(table, device, mode=mode, sparse=sparse)
    _train(m, ref, _sgd, device, steps=12, mode=mode, unique_ids=unique, psw=psw)
    m.flush()
    assert_bitwise(m.cache_weight_mgr.store.dense(), ref.weight, "host table after flush")
    assert_bitwise(m.weight, ref.weight, "weight property")
    st = m.stats()
    assert st["write_backs"] > 0 and st["overflow_batches"] > 0
    assert st["compressed_rows_fraction"] > 0.5  # SGD-updated rows still match the mask and are re-compressed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_opt,sparse", [(_adagrad, False), (_adagrad, True), (_sparse_adam, True)])
def test_training_stateful_optimizer_follows_rows(table: torch.Tensor, device: str, make_opt, sparse: bool) -> None:
    """With attach_optimizer, per-row optimizer state moves with its row: Adagrad/SparseAdam stay exact."""
    m = make(table, device, mode="sum", sparse=sparse, cache_ratio=0.05)
    ref = reference(table, device, mode="sum", sparse=sparse)
    _train(m, ref, make_opt, device, steps=10, mode="sum", unique_ids=device == "cuda")
    m.flush()
    assert_bitwise(m.weight, ref.weight)


@pytest.mark.parametrize("device", DEVICES)
def test_training_max_norm_and_scale_grad_by_freq(table: torch.Tensor, device: str) -> None:
    """max_norm renormalises the cached rows in place (they are written back), like torch's table."""
    kw = dict(mode="mean", max_norm=0.9, scale_grad_by_freq=True)
    m = make(table, device, cache_ratio=0.03, **kw)
    ref = reference(table, device, **kw)
    _train(m, ref, _sgd, device, steps=8, mode="mean")
    m.flush()
    assert_bitwise(m.weight, ref.weight)


def test_inference_writes_nothing_back(table: torch.Tensor) -> None:
    """Rows cannot change under no_grad, so evictions skip the write-back (Colossal-AI always copies out)."""
    m = make(table, "cpu", mode="sum", cache_ratio=0.03)
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for _ in range(5):
            m(*random_bags(gen, ROWS, 10))
    st = m.stats()
    assert st["evictions"] > 0 and st["write_backs"] == 0 and st["rows_written_back"] == 0
    assert sum(m.num_write_back_history) == 0 and len(m.num_hits_history) == 5
    assert_bitwise(m.weight, table)


def test_inference_mode_then_training(table: torch.Tensor) -> None:
    """An oversized batch under torch.inference_mode() must not leave inference tensors that break training."""
    m = make(table, "cpu", mode="sum", cache_ratio=0.02)
    ref = reference(table, "cpu", mode="sum")
    with torch.inference_mode():
        ids = torch.arange(100)
        assert_bitwise(m(ids, torch.tensor([0, 50])), ref(ids, torch.tensor([0, 50])))
    _train(m, ref, _sgd, "cpu", steps=3, mode="sum")
    m.flush()
    assert_bitwise(m.weight, ref.weight)
    assert_bitwise(m.cache_weight_mgr.weight, ref.weight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_opt", MOVING, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("one_id", [False, True], ids=["bags", "one-id-bags"])
def test_training_momentum_adam_decay_exact_after_attach(table: torch.Tensor, device: str, make_opt,
                                                         one_id: bool) -> None:
    """Optimizers that move rows absent from the batch (momentum, Adam's moments, weight decay) under a learning-rate
    schedule: an evicted row catches up on the updates it missed when it returns, and the host rows at ``weight`` /
    ``flush``, so every output and the final table equal nn.EmbeddingBag + torch.optim bit for bit. A 3% cache:
    evictions and oversized batches every step."""
    m = make(table, device, mode="sum", cache_ratio=0.03)
    ref = reference(table, device, mode="sum")
    _train(m, ref, make_opt, device, steps=10, mode="sum", unique_ids=device == "cuda", one_id=one_id,
           schedule=True)
    st = m.stats()
    assert st["evictions"] > 0 and st["overflow_batches"] > 0
    assert_bitwise(m.weight, ref.weight, "weight (evicted rows caught up)")
    m.flush()
    assert_bitwise(m.cache_weight_mgr.store.dense(), ref.weight, "host table after flush")


@pytest.mark.parametrize("make_opt", [_momentum, _adam], ids=["momentum", "adam"])
def test_inference_between_steps_sees_current_rows(table: torch.Tensor, make_opt) -> None:
    """Rows admitted by an inference lookup (here an oversized one, under inference_mode) are brought up to date
    first: the lookup of every row equals the reference's current table after each step, and training goes on
    exactly."""
    m = make(table, "cpu", mode="sum", cache_ratio=0.05)
    ref = reference(table, "cpu", mode="sum")
    opt, ref_opt = make_opt(m.parameters()), make_opt(ref.parameters())
    m.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(14)
    every = torch.arange(ROWS).view(-1, 1)
    for step in range(5):
        ids, offsets = random_bags(gen, ROWS, 10, hot=12)
        for model, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad()
            model(ids, offsets).pow(2).sum().backward()
            o.step()
        with torch.inference_mode():
            assert_bitwise(m(every), ref(every), f"every row after step {step}")
    assert_bitwise(m.weight, ref.weight)


@pytest.mark.parametrize("make_opt,sparse", [(_momentum, False), (_nesterov_decay, False), (_adam, False),
                                             (_adagrad, False), (_sparse_adam, True),
                                             (lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01), False)],
                         ids=["momentum", "nesterov-decay", "adam", "adagrad", "sparse-adam", "sgd-decay"])
def test_stateful_optimizer_without_attach_is_refused(table: torch.Tensor, make_opt, sparse: bool) -> None:
    """Without attach_optimizer an optimizer with per-row state (or weight decay) would keep it with the slot and
    break once the cache grows: refused at its first step, before anything changed, saying what to do."""
    from ibpcache.errors import OptimizerStateError

    m = make(table, "cpu", mode="sum", cache_ratio=0.05, sparse=sparse)
    opt = make_opt(m.parameters())
    ids = torch.randperm(ROWS, generator=torch.Generator().manual_seed(15))[:60]  # more rows than the cache holds
    m(ids, torch.arange(0, 60, 6)).pow(2).sum().backward()
    before = m.cached_weight.detach().clone()
    with pytest.raises(OptimizerStateError, match="attach_optimizer") as exc:
        opt.step()
    assert isinstance(exc.value, RuntimeError)
    assert_bitwise(m.cached_weight, before, "rows after the refused step")
    m.attach_optimizer(opt)  # the fix the message names
    opt.step()
    plain = make(table, "cpu", mode="sum", cache_ratio=0.05)
    sgd = _sgd(plain.parameters())
    plain(ids, torch.arange(0, 60, 6)).sum().backward()
    sgd.step()  # stateless SGD needs nothing


def test_attach_refuses_what_it_cannot_keep_exact(table: torch.Tensor) -> None:
    from ibpcache.errors import OptimizerStateError

    m = make(table, "cpu", mode="sum", cache_ratio=0.05)
    with pytest.raises(OptimizerStateError, match="not supported"):
        m.attach_optimizer(torch.optim.RMSprop(m.parameters(), lr=0.01))
    with pytest.raises(ValueError, match="does not hold"):
        m.attach_optimizer(_adam([torch.nn.Parameter(torch.zeros(3))]))
    stepped = torch.nn.Parameter(torch.zeros_like(m.cached_weight))
    donor = _adam([stepped])
    stepped.grad = torch.ones_like(stepped)
    donor.step()
    opt = _adam(m.parameters())
    opt.load_state_dict(donor.state_dict())  # a checkpoint's state belongs to slots, not rows
    with pytest.raises(OptimizerStateError, match="before its first step"):
        m.attach_optimizer(opt)
    first = _adam(m.parameters())
    m.attach_optimizer(first)
    m.attach_optimizer(first)  # again: nothing changes
    with pytest.raises(OptimizerStateError, match="another optimizer"):
        m.attach_optimizer(_adam(m.parameters()))
    sparse = make(table, "cpu", mode="sum", cache_ratio=0.05, sparse=True)
    mom = _momentum(sparse.parameters())
    sparse.attach_optimizer(mom)
    sparse(torch.tensor([1, 2, 3]), torch.tensor([0])).sum().backward()
    with pytest.raises(OptimizerStateError, match="sparse=False"):
        mom.step()


def test_rows_that_stop_matching_are_stored_raw_and_refit(table: torch.Tensor) -> None:
    """Rows pushed far from the learned invariant bits are written back raw; a refit restores compression."""
    m = make(table, "cpu", mode="sum", cache_ratio=1.0, warmup_ratio=1.0, refit_threshold=0.9)
    store = m.cache_weight_mgr.store
    before = store.compressed_fraction()
    assert before > 0.9
    with torch.no_grad():  # an in-place update bumps the parameter's version: the rows count as dirty
        m.cached_weight.mul_(1e30)
    expected = table * 1e30
    m.flush()  # writes back raw rows, then the compressed share has collapsed below 0.9x -> refit
    assert_bitwise(m.weight, expected)
    assert_bitwise(store.dense(), expected)
    st = m.stats()
    assert st["refits"] == 1 and st["refit_steps"] == [0]
    assert st["compressed_rows_fraction"] > 0.9  # the new mask fits the new rows


def test_host_store_raw_fallback_roundtrip(table: torch.Tensor) -> None:
    """The engine's HostStore alone: a row that no longer matches is stored raw in its own slot, others compressed."""
    from ibpcache.cache.host_store import FitOptions, HostStore

    store = HostStore(table, codec=FitOptions(), compress=True, device=torch.device("cpu"))
    rows = table[[3, 4]].clone()
    rows[0] = float("inf")
    store.write_rows(torch.tensor([3, 4]), rows.view(torch.uint8))
    assert int(store.lengths[3]) == store.row_bytes and int(store.lengths[4]) < store.row_bytes
    expected = table.clone()
    expected[3] = float("inf")
    assert_bitwise(store.dense(), expected)


def test_state_dict_roundtrip(table: torch.Tensor) -> None:
    """state_dict holds the full table as 'weight' (like nn.EmbeddingBag), after training too."""
    m = make(table, "cpu", mode="sum", cache_ratio=0.03)
    ref = reference(table, "cpu", mode="sum")
    _train(m, ref, _sgd, "cpu", steps=4, mode="sum")
    sd = m.state_dict()
    assert list(sd) == ["weight"]
    assert_bitwise(sd["weight"], ref.weight)
    fresh = make(torch.zeros_like(table), "cpu", mode="sum", cache_ratio=0.03)
    fresh.load_state_dict(ref.state_dict())
    ids, offsets = torch.tensor([1, 50, 299]), torch.tensor([0, 1])
    assert_bitwise(fresh(ids, offsets), ref(ids, offsets))
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict({})


# ------------------------------------------------------------------------------------------------
# bad input raises like torch
# ------------------------------------------------------------------------------------------------

BAD_INPUTS = {
    "id too large": (torch.tensor([1, ROWS]), torch.tensor([0])),
    "negative id": (torch.tensor([1, -1]), torch.tensor([0])),
    "float ids": (torch.tensor([1.0, 2.0]), torch.tensor([0])),
    "float offsets": (torch.tensor([1, 2]), torch.tensor([0.0])),
    "offsets[0] != 0": (torch.tensor([1, 2, 3, 4]), torch.tensor([1, 3])),
    "offsets decreasing": (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 1])),
    "offsets past the end": (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 5])),
    "2-D input with offsets": (torch.tensor([[1, 2]]), torch.tensor([0])),
    "1-D input without offsets": (torch.tensor([1, 2]), None),
    "3-D input": (torch.tensor([[[1, 2]]]), None),
    "2-D offsets": (torch.tensor([1, 2]), torch.tensor([[0]])),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_like_torch(table: torch.Tensor, device: str, case: str) -> None:
    from ibpcache.errors import IbpcacheError

    skip_if_no_cuda(device)
    ids, offsets = BAD_INPUTS[case]
    ref = reference(table, "cpu", mode="sum")  # the CPU reference raises instead of asserting on the device
    with pytest.raises(Exception) as torch_exc:
        ref(ids, offsets)
    m = make(table, device, mode="sum")
    with pytest.raises(type(torch_exc.value)) as ours:
        m(ids, offsets)
    assert isinstance(ours.value, IbpcacheError), f"{case}: {type(ours.value)}"
    ok = torch.tensor([1, 2, 3])  # the cache is still usable after the error
    assert_bitwise(m(ok, torch.tensor([0])), ref(ok, torch.tensor([0])))


def test_bad_constructor_arguments(table: torch.Tensor) -> None:
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    with pytest.raises(ValueError, match="cache_ratio"):
        CachedEmbeddingBag(ROWS, DIM, _weight=table, cache_ratio=0.0, device="cpu")
    with pytest.raises(ValueError, match="cache_ratio"):
        CachedEmbeddingBag(ROWS, DIM, _weight=table, cache_ratio=1.5, device="cpu")
    with pytest.raises(ValueError, match="mode"):
        CachedEmbeddingBag(ROWS, DIM, _weight=table, mode="min", device="cpu")
    with pytest.raises(ValueError, match="padding_idx"):
        CachedEmbeddingBag(ROWS, DIM, _weight=table, padding_idx=ROWS, device="cpu")
    with pytest.raises(ValueError, match="Shape of weight"):
        CachedEmbeddingBag(ROWS + 1, DIM, _weight=table, device="cpu")
    with pytest.raises(ValueError, match="ids_freq_mapping"):
        CachedEmbeddingBag(ROWS, DIM, _weight=table, ids_freq_mapping=[1, 2], device="cpu")
    with pytest.raises(ValueError, match="evict_strategy"):
        CachedEmbeddingBag(ROWS, DIM, _weight=table, evict_strategy="random", device="cpu")
    with pytest.raises(ValueError, match="fetch"):
        CachedEmbeddingBag(ROWS, DIM, _weight=table, fetch="dma", device="cpu")


def test_moving_the_module_is_refused(table: torch.Tensor) -> None:
    m = make(table, "cpu", mode="sum").double()
    with pytest.raises(RuntimeError, match="moved/cast"):
        m(torch.tensor([1]), torch.tensor([0]))


def test_default_init_like_colossal() -> None:
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    torch.manual_seed(0)
    m = CachedEmbeddingBag(100, 8, padding_idx=3, device="cpu", compress=False)
    w = m.weight
    assert w.abs().max() <= 1 / 100 and torch.all(w[3] == 0)


# ------------------------------------------------------------------------------------------------
# table-batched form
# ------------------------------------------------------------------------------------------------

SIZES = [120, 60, 120]


def _tables(table: torch.Tensor) -> list[torch.Tensor]:
    out, lo = [], 0
    for n in SIZES:
        out.append(table[lo:lo + n].clone())
        lo += n
    return out


def _table_major_batch(gen: torch.Generator, batch: int, include_last_offset: bool):
    ids_t, offs_t = [], []
    start = 0
    for n in SIZES:
        ids, offsets = random_bags(gen, n, batch, max_len=4)
        ids_t.append(ids)
        offs_t.append(offsets)
    flat_offsets, pos = [], 0
    for ids, offsets in zip(ids_t, offs_t):
        flat_offsets.append(offsets + pos)
        pos += ids.numel()
    offsets = torch.cat(flat_offsets + ([torch.tensor([pos])] if include_last_offset else []))
    return ids_t, offs_t, torch.cat(ids_t), offsets


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_table_batched_matches_per_table_bags(table: torch.Tensor, device: str, mode: str,
                                              include_last_offset: bool) -> None:
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    tables = _tables(table)
    m = TableBatchedCachedEmbeddingBag(SIZES, DIM, _weight=tables, mode=mode, include_last_offset=include_last_offset,
                                       cache_ratio=0.05, device=device)
    refs = [reference(t, device, mode=mode) for t in tables]
    gen = torch.Generator().manual_seed(11)
    for step in range(4):
        ids_t, offs_t, ids, offsets = _table_major_batch(gen, 6, include_last_offset)
        want = torch.cat([r(i.to(device), o.to(device)) for r, i, o in zip(refs, ids_t, offs_t)], 1)
        single = torch.stack([torch.randint(0, n, (5,), generator=gen) for n in SIZES], 1)  # [B, T]
        want_single = torch.cat([r(single[:, t:t + 1].to(device)) for t, r in enumerate(refs)], 1)
        with torch.set_grad_enabled(step % 2 == 0):  # per-table (training) and one-call (inference) paths
            assert_bitwise(m(ids, offsets), want)
            assert_bitwise(m(single), want_single)
    assert m.stats()["misses"] > 0


def _batched_inputs(gen: torch.Generator, layout: str, device: str) -> tuple:
    """One batch for every table, with repeated (hot) ids: the per-table inputs, and the table-batched module's."""
    if layout == "2d":  # [B, T]: one id per sample and table, 24 samples
        hot = [torch.randint(0, 8, (24,), generator=gen) for _ in SIZES]
        cold = [torch.randint(0, n, (24,), generator=gen) for n in SIZES]
        pick = torch.rand(24, len(SIZES), generator=gen) < 0.5
        single = torch.where(pick, torch.stack(hot, 1), torch.stack(cold, 1))
        per_table = [(single[:, t:t + 1].to(device), None) for t in range(len(SIZES))]
        return per_table, (single.to(device), None)
    parts = [random_bags(gen, n, 12, max_len=6, hot=8) for n in SIZES]
    flat, offsets, pos = [], [], 0
    for ids, offs in parts:
        flat.append(ids)
        offsets.append(offs + pos)
        pos += ids.numel()
    per_table = [(i.to(device), o.to(device)) for i, o in parts]
    return per_table, (torch.cat(flat).to(device), torch.cat(offsets).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make_opt", [_sgd, _adagrad, _sparse_adam], ids=["sgd", "adagrad", "sparse-adam"])
@pytest.mark.parametrize("layout", ["offsets", "2d"])
def test_table_batched_sparse_training_matches_per_table_modules(table: torch.Tensor, device: str, make_opt,
                                                                 layout: str) -> None:
    """Sparse gradients of all tables from one reduction (coalesced table by table on the CPU, at once on CUDA), each
    next batch prefetched after the step (its forward then reuses the prefetch's slots): outputs and trained tables
    bit-identical to one nn.EmbeddingBag per table under one optimizer. Ids repeat within a table's bags, more than 16
    of them per table (where the CPU's sort stops being an insertion sort), and the cache evicts between steps."""
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    if device == "cuda" and make_opt is _sgd:
        pytest.skip("the reference's CUDA sparse SGD adds repeated ids with atomics (no fixed order)")
    tables = _tables(table)
    m = TableBatchedCachedEmbeddingBag(SIZES, DIM, _weight=tables, mode="sum", sparse=True, cache_ratio=0.4,
                                       warmup_ratio=0.0, device=device)
    refs = torch.nn.ModuleList([reference(t, device, mode="sum", sparse=True) for t in tables])
    opt, ref_opt = make_opt(m.parameters()), make_opt(refs.parameters())
    if getattr(make_opt, "attach", False):
        m.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(21)
    batches = [_batched_inputs(gen, layout, device) for _ in range(7)]
    m.prefetch(*batches[0][1])
    for step, (per_table, (ids, offsets)) in enumerate(batches):
        want = torch.cat([r(i, o) for r, (i, o) in zip(refs, per_table)], 1)
        out = m(ids, offsets)
        assert_bitwise(out, want, f"output at step {step}")
        target = torch.randn(out.shape, generator=gen).to(device)
        for o, model_out in ((opt, out), (ref_opt, want)):
            ((model_out - target) ** 2).sum().backward()
            o.step()
            o.zero_grad()
        if step + 1 < len(batches):
            m.prefetch(*batches[step + 1][1])
    assert m.stats()["evictions"] > 0
    m.flush()
    for t, r in enumerate(refs):
        assert_bitwise(m.table_weight(t), r.weight, f"table {t}")


def test_table_batched_training_and_errors(table: torch.Tensor) -> None:
    from ibpcache.loaders.embedding_bag import EmbeddingBagIndexError, TableBatchedCachedEmbeddingBag

    tables = _tables(table)
    m = TableBatchedCachedEmbeddingBag(SIZES, DIM, _weight=tables, mode="sum", cache_ratio=0.03, device="cpu")
    refs = torch.nn.ModuleList([reference(t, "cpu", mode="sum") for t in tables])
    opt, ref_opt = _sgd(m.parameters()), _sgd(refs.parameters())
    gen = torch.Generator().manual_seed(12)
    for _ in range(6):
        ids_t, offs_t, ids, offsets = _table_major_batch(gen, 8, False)
        out = m(ids, offsets)
        want = torch.cat([r(i, o) for r, i, o in zip(refs, ids_t, offs_t)], 1)
        assert_bitwise(out, want)
        for o, model_out in ((opt, out), (ref_opt, want)):
            o.zero_grad()
            model_out.pow(2).sum().backward()
            o.step()
    m.flush()
    for t, r in enumerate(refs):
        assert_bitwise(m.table_weight(t), r.weight, f"table {t}")
    with pytest.raises(EmbeddingBagIndexError, match="its table"):
        m(torch.tensor([[0, 60, 0]]))  # table 1 has 60 rows
    with pytest.raises(ValueError, match="tables"):
        m(torch.tensor([1, 2]), torch.tensor([0, 1]))  # 2 bags for 3 tables


# ------------------------------------------------------------------------------------------------
# CUDA fetch paths (zero-copy decode kernel vs CPU gather), compression on and off
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fetch", ["zero_copy", "host_gather"])
@pytest.mark.parametrize("compress", [True, False])
def test_cuda_fetch_paths(minilm: torch.Tensor, fetch: str, compress: bool) -> None:
    """Full-width MiniLM rows on the GPU: every fetch path serves and trains bit-exactly; the compressed
    zero-copy path reads fewer bytes over PCIe than raw rows would need."""
    w = minilm[3000:3600].clone()
    m = make(w, "cuda", mode="sum", cache_ratio=0.02, compress=compress, fetch=fetch)
    ref = reference(w, "cuda", mode="sum")
    gen = torch.Generator().manual_seed(14)
    with torch.no_grad():
        for _ in range(4):
            ids, offsets = random_bags(gen, 600, 32, hot=30)
            assert_bitwise(m(ids.cuda(), offsets.cuda()), ref(ids.cuda(), offsets.cuda()))
    st = m.stats()
    assert st["fetch_path"] == fetch
    if fetch == "zero_copy":  # inference goes through the fused lookup: misses read zero-copy, counted on device
        assert st["fused_lookups"] > st["fused_hits"]
        read, raw = st["fused_host_bytes"], st["fused_raw_host_bytes"]
    else:
        assert st["misses"] > 0
        read, raw = st["bytes_fetched"], st["raw_bytes_fetched"]
    assert read <= raw  # each distinct missed row is read once per step, not once per request
    if compress:
        assert read < raw
    opt, ref_opt = _sgd(m.parameters()), _sgd(ref.parameters())
    for _ in range(5):
        ids, offsets = random_bags(gen, 600, 32, hot=30)
        for model, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad()
            model(ids.cuda(), offsets.cuda()).pow(2).sum().backward()
            o.step()
    m.flush()
    assert_bitwise(m.weight, ref.weight)
    assert_bitwise(m.cache_weight_mgr.store.dense(), ref.weight)


@pytest.mark.gpu
def test_cuda_table_batched_one_decode_launch(minilm: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """26 tables, one lookup: after the step's admission (count, scan, apply, copy), probe, read, decode and pooling of
    all tables are exactly one kernel launch, then the staged rows leave the slot table."""
    from ibpcache.kernels import _build
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    sizes = [200] * 26
    w = minilm[:sum(sizes), :128].clone()
    m = TableBatchedCachedEmbeddingBag(sizes, 128, _weight=w, mode="sum", cache_ratio=0.01, device="cuda",
                                       warmup_ratio=0.0)
    ids = torch.randint(0, 200, (64, 26), device="cuda")
    with torch.no_grad():
        m(ids)  # first call: builds the kernels
    m.cache_weight_mgr.fused_lookup(m.stage_bytes, m.compress_cache).planner.fix("single", "staged")  # one way
    calls = []
    real = _build.launch
    monkeypatch.setattr(_build, "launch", lambda *a, **k: (calls.append(a[1]), real(*a, **k))[1])
    import ibpcache.kernels.admit as admit
    import ibpcache.kernels.bitpack as bitpack
    import ibpcache.kernels.lookup as lookup

    for mod in (lookup, bitpack, admit):  # modules that bound the name at import
        monkeypatch.setattr(mod, "launch", _build.launch)
    with torch.no_grad():
        out = m(ids)
    global_ids = (ids + torch.arange(26, device="cuda") * 200).reshape(-1, 1)
    want = torch.nn.functional.embedding_bag(global_ids, w.cuda(), mode="sum").reshape(64, -1)
    assert_bitwise(out, want)
    from ibpcache.kernels.lookup import codec_kind

    kind = codec_kind(m.cache_weight_mgr.store.codec.kernel_tables("cuda"))[0]  # the planner's codec: IBP/exp/raw
    pool = "ibp_lookup_pool_single_" + kind  # one id per bag: the kernel that takes several bags per warp
    # admitted rows are copied as stored, or decoded into the slots when the layout planner keeps them decoded
    fused = m.cache_weight_mgr.fused_lookup(m.stage_bytes, m.compress_cache)
    admit = "ibp_lookup_fill_" + kind if fused.decoded else "ibp_adm_copy"
    assert calls == ["ibp_adm_count", "ibp_adm_scan", "ibp_adm_apply", admit, pool, "ibp_adm_unstage"]


def test_bench_dlrm_smoke(tmp_path, shared_data_dir) -> None:
    """scripts/bench_dlrm.py end to end at a tiny size on the CPU (our methods; FBGEMM and Colossal-AI need CUDA):
    every trace and dtype, two runs per configuration, forced settings where asked, hit rates and oracles."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "scripts" / "bench_dlrm.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(script), "--device", "cpu", "--out", str(tmp_path), "--tables", "3", "--rows-per-table",
           "400", "--entry-bytes", "512", "--batches", "64", "--cache-ratios", "0.05,0.2", "--bags", "1,3", "--iters",
           "3", "--warmup", "1", "--budget-s", "5", "--drift-period", "3",
           "--paired", "ibpcache:ibpcache_raw,ibpcache:ibpcache"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    payload = json.loads((tmp_path / "bench_dlrm.json").read_text())
    records = payload["records"]
    ours = [r for r in records if r["method"].startswith("ibpcache")]
    assert ours and all(r["status"] == "ok" and r["verified"] for r in ours)
    assert {r["status"] for r in records if not r["method"].startswith("ibpcache")} == {"unavailable"}
    points = payload["points"]
    assert {(p["trace"], p["dtype"]) for p in points} == {(t, d) for t in ("zipf-stable", "zipf-drift", "zipf")
                                                          for d in ("fp32", "fp16")}
    assert {(p["bag"], p["batch"], p["cache_ratio"]) for p in points} == {(b, 64, c) for b in (1, 3)
                                                                          for c in (0.05, 0.2)}
    for p in points:
        m = p["methods"]["ibpcache"]
        assert m["M_lookups_per_s"] > 0 and 0 <= m["hit_rate"] <= 1 and 0 < m["oracle_hit_rate"] <= 1
        assert len(m["runs"]) == 2 and m["spread"] >= 0
        forced = {k for k in p["methods"] if k in ("ibpcache_ibp", "ibpcache_raw", "ibpcache_unstaged")}
        assert forced == (set() if (p["trace"], p["dtype"]) != ("zipf-stable", "fp32") else
                          {"ibpcache_ibp", "ibpcache_raw", "ibpcache_unstaged"})
    assert payload["meta"]["targets"]["lines"]
    assert (tmp_path / "bench_dlrm.png").exists()
    paired = payload["paired"]  # both modules stepped in turn at every point, outputs verified
    assert {(r["trace"], r["dtype"], r["bag"], r["batch"], r["cache_ratio"]) for r in paired} == {
        (p["trace"], p["dtype"], p["bag"], p["batch"], p["cache_ratio"]) for p in points}
    for r in paired:
        other = r["pair"][1]
        assert r["status"] == "ok" and r["verified"] and r["pair"][0] == "ibpcache"
        assert set(r["methods"]) == ({"ibpcache", "ibpcache_raw"} if other == "ibpcache_raw" else
                                     {"ibpcache", "ibpcache#2"}) and r["steps"] >= 1
        assert all(m["median_ms"] > 0 and 0 <= m["hit_rate"] <= 1 for m in r["methods"].values())
        assert r["speedup_p10"] <= r["speedup_step_median"] <= r["speedup_p90"]
    assert sorted(r["pair"][1] for r in paired) == sorted(["ibpcache_raw", "ibpcache"] * len(points))
    judged = [x for x in payload["meta"]["targets"]["lines"] if "steps in turn with ibpcache" in x]
    assert len(judged) == len(paired)


def test_bench_dlrm_judges_paired_windows_like_the_sequential_ones() -> None:
    from scripts.bench_dlrm import check_targets

    base = {"trace": "zipf-stable", "dtype": "fp32", "row_bytes": 512, "batch": 4096, "cache_ratio": 0.1,
            "status": "ok"}
    paired = [{**base, "pair": ["ibpcache", "fbgemm_lfu"], "speedup_step_median": 2.1},  # needs 2x here: met
              {**base, "batch": 1024, "pair": ["ibpcache", "fbgemm_lru"], "speedup_step_median": 1.4},  # 1.5x: missed
              {**base, "pair": ["ibpcache", "ibpcache_raw"], "speedup_step_median": 0.97},  # a forced setting: 0.95x
              {**base, "pair": ["ibpcache_raw", "ibpcache"], "speedup_step_median": 0.5},  # not ours first: not judged
              {**base, "pair": ["ibpcache", "fbgemm_lfu"], "status": "error"},
              {**base, "pair": ["ibpcache", "ibpcache"], "speedup_step_median": 0.91},  # two builds: within 10%
              {**base, "batch": 8192, "pair": ["ibpcache", "ibpcache"], "speedup_step_median": 1.12}]  # 12% apart
    t = check_targets([], paired)
    assert len(t["missed"]) == 2 and "fbgemm_lru: 1.400x (target 1.5x)" in t["missed"][0]
    assert "batch 8192" in t["missed"][1] and "the two builds differ by 12.0%" in t["missed"][1]
    assert sum("steps in turn" in x for x in t["lines"]) == 5


def test_bench_dlrm_train_smoke(tmp_path, shared_data_dir) -> None:
    """--train on the CPU: every one of ours trains with SGD and with Adagrad, and the trained-weights check finds the
    whole table equal to nn.EmbeddingBag's after the same steps (recorded on the smallest batch's points)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(root / "scripts" / "bench_dlrm.py"), "--device", "cpu", "--out", str(tmp_path),
           "--tables", "3", "--rows-per-table", "400", "--entry-bytes", "512", "--batches", "64,32",
           "--cache-ratios", "0.05", "--bags", "1,3", "--iters", "2", "--warmup", "1", "--train", "--check-steps",
           "3", "--methods", "ibpcache,ibpcache_raw,colossal", "--budget-s", "5"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    payload = json.loads((tmp_path / "bench_dlrm.json").read_text())
    records = payload["records"]
    # one point per shape AND optimizer: an Adagrad run never overwrites the SGD run of the same shape
    assert sorted((p["batch"], p["bag"], p["optimizer"]) for p in payload["points"]) == sorted(
        (b, g, o) for b in (64, 32) for g in (1, 3) for o in ("sgd", "adagrad"))
    ours = [r for r in records if r["method"].startswith("ibpcache")]
    checked = [r for r in ours if "trained_weights" in r]
    assert {(r["method"], r["bag"], r["batch"], r["optimizer"]) for r in checked} == {
        (m, b, 32, o) for m in ("ibpcache", "ibpcache_raw") for b in (1, 3) for o in ("sgd", "adagrad")}
    for r in checked:
        chk = r["trained_weights"]
        assert chk["status"] == "ok" and chk["steps"] == 3 and chk["bit_exact"] and chk["rows_differing"] == 0, chk
    assert all("trained_weights" not in r for r in records if r["method"] == "colossal")  # unavailable on CPU
    # prefetched steps: the forward finds every row; the prefetch's own hit rate says what was read from the host
    # (a 5% cache of 1200 rows cannot hold 3-id bags of 64 samples: rows miss at every prefetch)
    for r in ours:
        assert 0.0 <= r["prefetch_hit_rate"] < r["hit_rate"] <= 1.0, r


def test_bench_dlrm_hot_set_trace_draws_only_its_hot_rows(script_module) -> None:
    """``hot-set``: the Zipf law over a table's ``hot_fraction`` most probable ranks only, mapped to rows by the
    table's permutation; its oracle holds every lookup once the cache has that many rows per table."""
    with script_module("bench_dlrm") as mod:
        hot = mod.Trace("hot-set", 1000, 3, 1.05, torch.device("cpu"), 200, hot_fraction=0.02)
        full = mod.Trace("zipf-stable", 1000, 3, 1.05, torch.device("cpu"), 200)
    hot.reset(1)
    ids = hot.batch(512, 4)
    rows = {t: set(hot.perm[t, :20].tolist()) for t in range(3)}
    assert all(set(ids[t].tolist()) <= rows[t] for t in range(3)) and len(set(ids[0].tolist())) > 10
    assert hot.oracle(3 * 20) == pytest.approx(1.0) and hot.oracle(3 * 10) < 0.9 and full.oracle(3 * 20) < 0.6
    assert torch.equal(hot.perm, full.perm)  # the same rows per rank: only the law's support differs


def test_bench_dlrm_train_hot_set_fits_the_cache(tmp_path, shared_data_dir) -> None:
    """--train on a hot set smaller than the cache: after warm-up each prefetch finds (nearly) every row resident,
    the case issue 27's "within 1.5x of GPU-resident torch where the hot set fits" is about."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(root / "scripts" / "bench_dlrm.py"), "--device", "cpu", "--out", str(tmp_path),
           "--tables", "3", "--rows-per-table", "1000", "--entry-bytes", "512", "--batches", "64",
           "--cache-ratios", "0.05", "--bags", "3", "--iters", "4", "--warmup", "10", "--train", "--check-steps", "0",
           "--methods", "ibpcache", "--optimizers", "sgd", "--traces", "hot-set", "--hot-fraction", "0.02",
           "--budget-s", "5"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = json.loads((tmp_path / "bench_dlrm.json").read_text())["records"]
    assert rec["trace"] == "hot-set" and rec["status"] == "ok", rec
    assert rec["prefetch_hit_rate"] > 0.95, rec


def test_bench_dlrm_compare_tables_reports_differences(script_module) -> None:
    """The trained-weights comparison counts differing rows and their max abs difference (-0.0 vs 0.0 differs)."""
    with script_module("bench_dlrm") as mod:
        compare_tables = mod.compare_tables
    a = torch.zeros(10, 4)
    b = a.clone()
    assert compare_tables(a, b, torch.device("cpu"), chunk_rows=3) == {
        "bit_exact": True, "rows_differing": 0, "max_abs_diff": 0.0}
    b[2, 1] = -0.0
    b[7, 3] = 0.25
    got = compare_tables(a, b, torch.device("cpu"), chunk_rows=3)
    assert got == {"bit_exact": False, "rows_differing": 2, "max_abs_diff": 0.25}
    assert not compare_tables(a, b[:9], torch.device("cpu"))["bit_exact"]


# ------------------------------------------------------------------------------------------------
# the fused inference lookup (issue 11): exact against torch on CUDA, no host syncs, CUDA graphs, threads
# ------------------------------------------------------------------------------------------------


def _fused_table(minilm: torch.Tensor, dtype: torch.dtype, dim: int = 128) -> torch.Tensor:
    return minilm[:1200, :dim].to(dtype).contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("compress", [True, False])
def test_fused_inference_matches_torch_on_cuda(minilm: torch.Tensor, dtype, mode, compress) -> None:
    """Random bags (empty ones included), per-sample weights for sum, include_last_offset both ways, through
    enough calls that the cache admits and evicts rows on the device: bit-identical to torch's CUDA embedding_bag."""
    w = _fused_table(minilm, dtype)
    gen = torch.Generator().manual_seed(21)
    for last in (False, True):
        m = make(w, "cuda", mode=mode, cache_ratio=0.03, compress=compress, include_last_offset=last)
        ref = reference(w, "cuda", mode=mode, include_last_offset=last)
        with torch.no_grad():
            for step in range(40):
                ids, offsets = random_bags(gen, w.shape[0], 48, hot=60)
                if last:
                    offsets = torch.cat([offsets, torch.tensor([ids.numel()])])
                psw = None
                if mode == "sum" and step % 2:
                    psw = torch.randn(ids.numel(), generator=gen).to(dtype).cuda()
                got = m(ids.cuda(), offsets.cuda(), per_sample_weights=psw)
                assert_bitwise(got, ref(ids.cuda(), offsets.cuda(), per_sample_weights=psw), f"step {step}")
                fixed = torch.randint(0, w.shape[0], (16, 5), generator=gen).cuda()  # 2-D input: bags of 5
                assert_bitwise(m(fixed), ref(fixed), f"2-D step {step}")
        st = m.stats()
        assert st["fused_admitted"] >= 1 and 0 < st["fused_hits"] < st["fused_lookups"]
        m.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_fused_inference_wide_rows_match_torch(minilm: torch.Tensor, dtype, mode) -> None:
    """2 KB rows of 1024 half-precision elements (DLRM's 2048 B fp16 rows) pool in the wide fused kernel, not the
    training-form path: bit-identical to torch's CUDA embedding_bag while the cache admits and evicts."""
    from ibpcache.cache.row_cache import pool_supported

    w = minilm[:3600].reshape(1200, 1152)[:, :1024].to(dtype).contiguous()  # real rows, 1024 columns
    assert pool_supported(dtype, w.shape[1] * w.element_size())
    gen = torch.Generator().manual_seed(22)
    m = make(w, "cuda", mode=mode, cache_ratio=0.03, compress=True)
    ref = reference(w, "cuda", mode=mode)
    with torch.no_grad():
        for step in range(20):
            ids, offsets = random_bags(gen, w.shape[0], 48, hot=60)
            psw = torch.randn(ids.numel(), generator=gen).to(dtype).cuda() if mode == "sum" and step % 2 else None
            got = m(ids.cuda(), offsets.cuda(), per_sample_weights=psw)
            assert_bitwise(got, ref(ids.cuda(), offsets.cuda(), per_sample_weights=psw), f"step {step}")
    st = m.stats()
    assert st["fused_lookups"] > 0 and st["fused_admitted"] >= 1 and 0 < st["fused_hits"] < st["fused_lookups"]
    m.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["2d", "offsets"])
def test_fused_table_batched_inference_step_never_syncs(minilm: torch.Tensor, layout: str) -> None:
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    tables = _tables(minilm[:300, :128].contiguous())
    m = TableBatchedCachedEmbeddingBag(SIZES, 128, _weight=tables, mode="sum", cache_ratio=0.05, device="cuda")
    refs = [reference(t, "cuda", mode="sum") for t in tables]
    gen = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(8):
        if layout == "2d":
            single = torch.stack([torch.randint(0, n, (32,), generator=gen) for n in SIZES], 1).cuda()
            want = torch.cat([r(single[:, t:t + 1]) for t, r in enumerate(refs)], 1)
            batches.append(((single,), want))
        else:
            ids_t, offs_t, ids, offsets = _table_major_batch(gen, 32, False)
            want = torch.cat([r(i.cuda(), o.cuda()) for r, i, o in zip(refs, ids_t, offs_t)], 1)
            batches.append(((ids.cuda(), offsets.cuda()), want))
    with torch.no_grad():
        m(*batches[0][0])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [m(*inp) for inp, _ in batches]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for out, (_, want) in zip(outs, batches):
        assert_bitwise(out, want)
    m.check_errors()


def _fixed_table_major_batch(gen: torch.Generator, batch: int, bag: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 list[torch.Tensor]]:
    """Table-major bags of ``bag`` ids each (TorchRec's KJT with a fixed pooling factor): ids, offsets, and each
    table's ids [batch, bag] for the reference."""
    per = [torch.randint(0, n, (batch, bag), generator=gen) for n in SIZES]
    ids = torch.cat([p.reshape(-1) for p in per])
    return ids, torch.arange(0, ids.numel(), bag), per


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["2d", "offsets"])
def test_fused_steps_replay_from_cuda_graphs_exactly(minilm: torch.Tensor, layout: str) -> None:
    """Inference steps of a shape seen before replay from CUDA graphs: bit-exact outputs, the same admissions and
    hits as a module that runs every step eagerly (cuda_graphs=False), captures and replays with no host sync."""
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    tables = _tables(minilm[:300, :128].contiguous())
    mods = [TableBatchedCachedEmbeddingBag(SIZES, 128, _weight=tables, mode="sum", cache_ratio=0.05, device="cuda",
                                           cuda_graphs=g).eval() for g in (True, False)]
    for m in mods:  # one way for both, so the two runs do the same work whatever each planner would time
        fused = m.cache_weight_mgr.fused_lookup(m.stage_bytes, m.compress_cache, m.cuda_graphs)
        fused.planner.fix("single", "staged, sorted")
        fused.planner.fix("multi", "staged")
    refs = [reference(t, "cuda", mode="sum") for t in tables]
    gen = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(24):
        if layout == "2d":
            single = torch.stack([torch.randint(0, n, (48,), generator=gen) for n in SIZES], 1).cuda()
            batches.append(((single,), torch.cat([r(single[:, t:t + 1]) for t, r in enumerate(refs)], 1)))
        else:
            ids, offsets, per = _fixed_table_major_batch(gen, 48, 3)
            want = torch.cat([r(p.cuda()) for r, p in zip(refs, per)], 1)
            batches.append(((ids.cuda(), offsets.cuda()), want))
    with torch.no_grad():
        for m in mods:
            m(*batches[0][0])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [[m(*inp) for inp, _ in batches] for m in mods]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for got_g, got_e, (_, want) in zip(*outs, batches):
        assert_bitwise(got_g, want, "graph")
        assert_bitwise(got_e, want, "eager")
    st_g, st_e = (m.stats() for m in mods)
    assert st_g["fused_graph_error"] is None and st_g["fused_graph_replays"] >= len(batches) - 2
    assert st_e.get("fused_graph_replays", 0) == 0
    for k in ("fused_lookups", "fused_hits", "fused_admitted", "fused_staged"):
        assert st_g[k] == st_e[k], k
    for m in mods:
        m.check_errors()


@pytest.mark.gpu
def test_fused_table_batched_step_in_a_cuda_graph(minilm: torch.Tensor) -> None:
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    tables = _tables(minilm[:300, :128].contiguous())
    m = TableBatchedCachedEmbeddingBag(SIZES, 128, _weight=tables, mode="sum", cache_ratio=0.05, device="cuda")
    refs = [reference(t, "cuda", mode="sum") for t in tables]
    gen = torch.Generator().manual_seed(6)
    ids = torch.stack([torch.randint(0, n, (64,), generator=gen) for n in SIZES], 1).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        m(ids)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = m(ids)
    for _ in range(3):
        new = torch.stack([torch.randint(0, n, (64,), generator=gen) for n in SIZES], 1).cuda()
        ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = torch.cat([r(new[:, t:t + 1]) for t, r in enumerate(refs)], 1)
        assert_bitwise(out, want)


@pytest.mark.gpu
def test_fused_lazy_errors_and_threads(minilm: torch.Tensor) -> None:
    """Bad ids/offsets are reported by the next call (or check_errors) with no device-side assert; four threads on
    four streams get exact bags."""
    import threading

    from ibpcache.loaders.embedding_bag import EmbeddingBagIndexError, EmbeddingBagInputError

    w = _fused_table(minilm, torch.float32)
    m = make(w, "cuda", mode="sum", cache_ratio=0.03)
    ref = reference(w, "cuda", mode="sum")
    with torch.no_grad():
        m(torch.tensor([1, 5000, 2], device="cuda"), torch.tensor([0, 1], device="cuda"))
        with pytest.raises(EmbeddingBagIndexError):
            m.check_errors()
        m(torch.tensor([1, 2, 3], device="cuda"), torch.tensor([0, 2, 1], device="cuda"))
        torch.cuda.synchronize()
        with pytest.raises(EmbeddingBagInputError):
            m(torch.tensor([1], device="cuda"), torch.tensor([0], device="cuda"))
    bad: list[int] = []

    def work(t: int) -> None:
        gen = torch.Generator().manual_seed(100 + t)
        stream = torch.cuda.Stream()
        with torch.no_grad(), torch.cuda.stream(stream):
            for k in range(30):
                ids, offsets = random_bags(gen, w.shape[0], 64, hot=60)
                got = m(ids.cuda(), offsets.cuda())
                want = ref(ids.cuda(), offsets.cuda())
                stream.synchronize()
                if not torch.equal(bits(got), bits(want)):
                    bad.append(t * 100 + k)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert bad == []
    m.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("stage_bytes", [0, 2048, 64 << 20], ids=["no-staging", "staging-overflows", "staging"])
def test_fused_staging_reads_each_miss_once(minilm: torch.Tensor, stage_bytes: int) -> None:
    """Staged lookups stay exact when the buffer holds all misses, some (the rest zero-copy), or none; with a
    buffer that holds them all, host bytes per step drop to one read per distinct missed row."""
    w = _fused_table(minilm, torch.float32)
    m = make(w, "cuda", mode="sum", cache_ratio=0.02, stage_bytes=stage_bytes)
    fused = m.cache_weight_mgr.fused_lookup(stage_bytes)
    if stage_bytes:
        fused.planner.fix("multi", "staged")
    ref = reference(w, "cuda", mode="sum")
    gen = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for step in range(12):
            ids, offsets = random_bags(gen, w.shape[0], 256, max_len=12, hot=40)
            assert_bitwise(m(ids.cuda(), offsets.cuda()), ref(ids.cuda(), offsets.cuda()), f"step {step}")
        before = m.stats()
        ids = torch.cat([torch.arange(1000, 1100)] * 5)  # 100 distinct cold rows, each asked 5 times
        offsets = torch.arange(0, 500, 5)
        assert_bitwise(m(ids.cuda(), offsets.cuda()), ref(ids.cuda(), offsets.cuda()))
        after = m.stats()
    read = after["fused_host_bytes"] - before["fused_host_bytes"]
    stored = m.cache_weight_mgr.store.lengths[1000:1100].sum().item()
    resident = (m.cache_weight_mgr.slot_of[1000:1100] >= 0).sum().item()
    assert int((m.cache_weight_mgr.slot_of < -1).sum()) == 0  # staged rows left the slot table
    if stage_bytes == 64 << 20:
        assert read <= stored and resident < 100  # each missed row once
    elif stage_bytes == 0:
        assert read > stored  # the requests of a row that was not admitted crossed PCIe each time
    m.check_errors()


def test_path_planner_interleaves_then_keeps_the_fastest_way() -> None:
    """The fused lookup's path planner (CPU test with stand-in events): per kind and shape it interleaves the ways
    while timing, drops each way's first timing, ignores timings still running, decides by medians, keeps an
    incumbent unless beaten by the margin when it checks again, and times each new shape on its own."""
    from ibpcache.cache.plan_path import PathPlanner

    class Ev:
        def __init__(self, done: bool = True, ms: float = 0.0) -> None:
            self.done, self.ms = done, ms

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end: "Ev") -> float:
            return end.ms

    ways = {"single": ("as given", "sorted", "staged"), "multi": ("zero-copy",)}
    planner = PathPlanner(ways, trials=3, margin=0.1, recheck_every=5)
    cost = {0: 2.0, 1: 1.0, 2: 1.5}
    seen = []
    while planner.calibrating("single", 5000):
        w = planner.choose("single", 5000)
        seen.append(w)
        if planner.calibrating("single", 5000):
            planner.record("single", 5000, w, Ev(), Ev(ms=cost[w] if len(seen) > 3 else 99.0))
    assert seen[:6] == [0, 1, 2, 0, 1, 2]  # interleaved; the first timing of each (99 ms) was dropped
    assert planner.choose("single", 5000) == 1 and planner.plan()["single 5000 bags"] == "sorted"
    assert planner.calibrating("single", 5001) and planner.choose("multi", 10) == 0  # a new shape; one way: no timing
    assert not planner.timing("multi", 10)
    planner.record("single", 77, 0, Ev(), Ev(done=False, ms=1.0))  # still running: not counted yet
    assert planner.choose("single", 77) == 1 and planner.choose("single", 77, capturing=True) == 0
    for _ in range(5):  # recheck after 5 calls: "staged" now 1.05 ms vs sorted 1.0: within the margin, no switch
        planner.choose("single", 5000)
    cost.update({1: 1.1, 2: 1.05})
    while planner.calibrating("single", 5000):
        w = planner.choose("single", 5000)
        planner.record("single", 5000, w, Ev(), Ev(ms=cost[w]))
    assert planner.choose("single", 5000) == 1
    planner.fix("single", "staged")
    assert planner.choose("single", 5000) == 2 and not planner.calibrating("single", 5000)
    assert planner.plan()["single (fixed)"] == "staged"
    with pytest.raises(ValueError):
        planner.fix("other", 0)
    with pytest.raises(ValueError):
        planner.fix("single", "backwards")
    with pytest.raises(ValueError):
        PathPlanner(ways, first_recheck=0)


class _DoneEvent:
    """A stand-in CUDA event that has completed; ``elapsed_time`` to it is its ``ms``."""

    def __init__(self, ms: float = 0.0) -> None:
        self.ms = ms

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_DoneEvent") -> float:
        return end.ms


def test_path_planner_rechecks_early_then_at_growing_intervals() -> None:
    """The ways are timed again ``first_recheck`` steps after the first decision (the first timings ran while the
    cache was filling), then after 4x as many, up to ``recheck_every``; a way that became faster by the margin on the
    warm cache takes over at the first recheck."""
    from ibpcache.cache.plan_path import PathPlanner

    planner = PathPlanner({"single": ("as given", "sorted")}, trials=2, margin=0.05, recheck_every=40,
                          first_recheck=3)
    cost = {0: 1.0, 1: 1.2}  # cold cache: "as given" looks faster

    def calibrate() -> None:
        while planner.calibrating("single", 8):
            w = planner.choose("single", 8)
            planner.record("single", 8, w, _DoneEvent(), _DoneEvent(ms=cost[w]))

    calibrate()
    assert planner.choose("single", 8) == 0
    cost.update({0: 1.3, 1: 1.0})  # warm cache: "sorted" is faster by more than the margin
    gaps = []
    for _ in range(4):
        steps = 1  # the choose() above or the one that ended the last calibration
        while not planner.calibrating("single", 8):
            planner.choose("single", 8)
            steps += 1
        gaps.append(steps)
        calibrate()
        assert planner.choose("single", 8) == 1
    assert gaps == [3, 12, 40, 40]


def test_fused_table_batched_lookup_on_cpu_matches_torch(table: torch.Tensor) -> None:
    """The fused path's own logic on the CPU (admission twin, emulated lookup): 2-D [B, T] input and table-major bags
    with offsets, bad ids skipped, exact against per-table embedding_bag; training afterwards starts cold and exact."""
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    tables = _tables(table)
    m = TableBatchedCachedEmbeddingBag(SIZES, table.shape[1], _weight=tables, mode="sum", cache_ratio=0.05,
                                       warmup_ratio=0.0, device="cpu", compress=True)
    m.fused_inference = True  # CPU: what CUDA runs by default, through the kernels' twin
    refs = [reference(t, "cpu", mode="sum") for t in tables]
    gen = torch.Generator().manual_seed(17)
    m.eval()
    with torch.no_grad():
        for step in range(6):
            single = torch.stack([torch.randint(0, n, (32,), generator=gen) for n in SIZES], 1)
            want = torch.cat([r(single[:, t:t + 1]) for t, r in enumerate(refs)], 1)
            assert_bitwise(m(single), want, f"2-D step {step}")
            ids_t, offs_t, ids, offsets = _table_major_batch(gen, 32, False)
            want = torch.cat([r(i, o) for r, i, o in zip(refs, ids_t, offs_t)], 1)
            m.prefetch(ids, offsets)
            assert_bitwise(m(ids, offsets), want, f"bags, step {step}")
    st = m.stats()
    assert st["form"] == "stored" and st["fused_admitted"] > 0 and st["fused_prefetches"] == 6
    m.train()
    opt = _sgd(m.parameters())
    single = torch.stack([torch.randint(0, n, (8,), generator=gen) for n in SIZES], 1)
    m(single).sum().backward()
    opt.step()
    assert m.stats()["form"] == "raw"


def test_table_batched_bags_over_a_node_cache(tmp_path) -> None:
    """use_node_cache: every layout (one id per table, bags with offsets, per-sample weights, mean) equals T
    EmbeddingBags over the tables bit for bit; a bad id raises; training through a read-only node cache raises; None
    goes back to the module's own cache."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from ibpcache.cache.partitioned import PartitionedFeatureCache
    from ibpcache.errors import InvalidArgumentError, InvalidIdsError, UnsupportedError
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    gen = torch.Generator().manual_seed(0)
    sizes, dim = [50, 30, 40], 8
    tables = [torch.randn(n, dim, generator=gen).round(decimals=2) for n in sizes]
    weight = torch.cat(tables)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        node = PartitionedFeatureCache(weight, torch.rand(weight.shape[0], generator=gen), 0.3, device="cpu")
        for mode in ("sum", "mean"):
            emb = TableBatchedCachedEmbeddingBag(sizes, dim, _weight=weight, mode=mode, cache_ratio=0.1, device="cpu")
            emb.requires_grad_(False)
            emb.use_node_cache(node)
            ids2 = torch.stack([torch.randint(0, n, (6,), generator=gen) for n in sizes], 1)  # [B, T]
            want = torch.cat([F.embedding_bag(ids2[:, t:t + 1], tables[t], mode=mode) for t in range(3)], 1)
            assert torch.equal(emb(ids2), want)
            bags = [torch.randint(0, n, (12,), generator=gen) for n in sizes]  # 4 bags of 3 per table
            offs = torch.arange(0, 36, 3)
            psw = torch.rand(36, generator=gen) if mode == "sum" else None
            got = emb(torch.cat(bags), offs, psw)
            want = torch.cat([F.embedding_bag(bags[t], tables[t], torch.arange(0, 12, 3), mode=mode,
                                              per_sample_weights=None if psw is None else psw[12 * t:12 * (t + 1)])
                              for t in range(3)], 1)
            assert torch.equal(got, want)
        with pytest.raises(InvalidIdsError):
            emb(torch.tensor([[0, 30, 0]]))  # table 1 has 30 rows
        with pytest.raises(InvalidArgumentError, match="node cache"):
            TableBatchedCachedEmbeddingBag([10], dim, _weight=weight[:10], device="cpu").use_node_cache(node)
        emb.requires_grad_(True)
        emb.train()
        with pytest.raises(UnsupportedError, match="frozen"):
            emb(ids2)
        emb.use_node_cache(None)
        emb.eval()
        with torch.no_grad():
            assert torch.equal(emb(ids2), torch.cat([F.embedding_bag(ids2[:, t:t + 1], tables[t], mode="mean")
                                                     for t in range(3)], 1))
    finally:
        dist.destroy_process_group()


def test_bench_dlrm_counters_that_did_not_move_give_no_hit_rate() -> None:
    """FBGEMM's LFU cache counts nothing (its populate takes no stats tensor): that must read as no hit rate, not 0."""
    from scripts.bench_dlrm import _counter_fields

    zero = {"requests": 0.0, "hits": 0.0, "unique": 0.0, "unique_misses": 0.0}
    res = _counter_fields(zero, dict(zero), steps=100)
    assert "hit_rate" not in res and "did not move" in res["hit_rate_note"]
    moved = {"requests": 400.0, "hits": 300.0, "unique": 200.0, "unique_misses": 50.0}
    res = _counter_fields(zero, moved, steps=100)
    assert res["hit_rate"] == 0.75 and res["unique_hit_rate"] == 0.75


def test_settled_admit_every_must_be_a_positive_int(table: torch.Tensor) -> None:
    from ibpcache.errors import InvalidArgumentError
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="settled_admit_every"):
            CachedEmbeddingBag(table.shape[0], table.shape[1], _weight=table, settled_admit_every=bad)


@pytest.mark.gpu
def test_settled_steps_skip_admission_exactly_without_syncs_and_replay(minilm: torch.Tensor) -> None:
    """Once the cache is full and its hit rate flat, most fused steps skip the admission pass
    (``settled_admit_every``): outputs stay bit-exact, no step syncs, and both kinds of step replay from CUDA graphs."""
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    tables = _tables(minilm[:300, :128].contiguous())
    m = TableBatchedCachedEmbeddingBag(SIZES, 128, _weight=tables, mode="sum", cache_ratio=0.05, device="cuda",
                                       settled_admit_every=3).eval()
    fused = m.cache_weight_mgr.fused_lookup(m.stage_bytes, m.compress_cache, m.cuda_graphs, m.settled_admit_every)
    fused.planner.fix("single", "sorted")  # an unstaged way: the settled steps may skip the pass
    fused.pace.window, fused.pace.span, fused.pace.min_requests = 2, 2, 0  # settle within this short run
    refs = [reference(t, "cuda", mode="sum") for t in tables]
    gen = torch.Generator().manual_seed(17)
    batches = []
    for _ in range(90):
        single = torch.stack([torch.randint(0, n, (48,), generator=gen) for n in SIZES], 1).cuda()
        batches.append((single, torch.cat([r(single[:, t:t + 1]) for t, r in enumerate(refs)], 1)))
    with torch.no_grad():
        m(batches[0][0])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [m(inp) for inp, _ in batches]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for step, (out, (_, want)) in enumerate(zip(outs, batches)):
        assert_bitwise(out, want, f"step {step}")
    st = m.stats()
    pace = st["fused_admission"]
    assert pace["settles"] >= 1 and pace["skipped_steps"] >= 20, pace
    assert st["fused_graph_error"] is None and st["fused_graph_replays"] >= 60
    assert st["fused_lookups"] == 91 * 48 * len(SIZES)  # skipped steps still count their requests
    m.check_errors()


def test_path_planner_takes_a_cycles_mean_step() -> None:
    """A sample of several steps, each timed on its own (a settled cache's cycle: one step admitting, the others not),
    counts as their mean: a way whose cycle's steps take 1.4 + 3 x 0.6 ms (0.8 ms a step) beats one at 1.0 ms a
    step, though the cycle's admitting step alone would not."""
    from ibpcache.cache.plan_path import PathPlanner

    planner = PathPlanner({"single": ("staged", "sorted")}, trials=3)
    while planner.calibrating("single", 100):
        w = planner.choose("single", 100)
        if w == 0:
            planner.record("single", 100, 0, _DoneEvent(), _DoneEvent(ms=1.0))
        else:
            planner.record_steps("single", 100, 1, [(_DoneEvent(), _DoneEvent(ms=ms)) for ms in (1.4, 0.6, 0.6, 0.6)])
    assert planner.choose("single", 100) == 1 and planner.plan()["single 100 bags ms"]["sorted"] == pytest.approx(0.8)


def test_path_planner_plans_each_phase_apart_and_resumes_a_phase_it_has_seen() -> None:
    """A settled cache (unstaged ways skip most passes) and a filling or moving one are planned apart: entering a
    phase for the first time times every shape's ways at once from the other phase's choice (a way faster by the
    margin takes over, one within it does not); entering it again runs its way from the first step, untimed."""
    from ibpcache.cache.plan_path import PathPlanner

    planner = PathPlanner({"single": ("staged", "sorted")}, trials=2, margin=0.05, first_recheck=1000)
    cost = {0: 1.0, 1: 1.1}  # admitting every step, the staged way is faster

    def calibrate(n: int) -> None:
        while planner.calibrating("single", n):
            w = planner.choose("single", n)
            planner.record("single", n, w, _DoneEvent(), _DoneEvent(ms=cost[w]))

    for n in (40, 48):
        calibrate(n)
        assert planner.choose("single", n) == 0
    planner.set_phase(True)
    assert planner.calibrating("single", 40) and planner.calibrating("single", 48)
    cost.update({0: 1.0, 1: 0.8})  # settled: "sorted" skips 3 passes in 4
    calibrate(40)
    assert planner.choose("single", 40) == 1
    cost.update({0: 1.0, 1: 0.97})  # within the margin: the incumbent stays
    calibrate(48)
    assert planner.choose("single", 48) == 0
    planner.set_phase(False)  # the hot set moved: back to the moving cache's plan, no timing
    assert not planner.calibrating("single", 40) and planner.choose("single", 40) == 0
    planner.set_phase(True)  # settled again: its plan resumes
    assert not planner.calibrating("single", 40) and planner.choose("single", 40) == 1
    assert planner.phase_changes == 3
    plan = planner.plan()
    assert plan["single 40 bags"] == "staged" and plan["single 40 bags, settled"] == "sorted", plan
    fixed = PathPlanner({"single": ("staged", "sorted")})
    fixed.fix("single", "sorted")
    fixed.set_phase(True)
    assert not fixed.calibrating("single", 40) and fixed.choose("single", 40) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_a_settled_cache_times_its_ways_by_whole_cycles(minilm: torch.Tensor, graphs: bool) -> None:
    """When the planner times the ways of a settled cache, an unstaged way runs a cycle of ``settled_admit_every``
    steps (the first admitting) and is judged on their mean, whether the steps replay CUDA graphs or run eagerly, and
    while steps of another batch shape come in between; outputs stay bit-exact throughout."""
    from ibpcache.loaders.embedding_bag import TableBatchedCachedEmbeddingBag

    tables = _tables(minilm[:300, :128].contiguous())
    m = TableBatchedCachedEmbeddingBag(SIZES, 128, _weight=tables, mode="sum", cache_ratio=0.05,
                                       device="cuda", cuda_graphs=graphs).eval()
    fused = m.cache_weight_mgr.fused_lookup(m.stage_bytes, m.compress_cache, m.cuda_graphs, m.settled_admit_every)
    fused.pace.window, fused.pace.span, fused.pace.min_requests = 2, 2, 0
    refs = [reference(t, "cuda", mode="sum") for t in tables]
    gen = torch.Generator().manual_seed(23)
    with torch.no_grad():
        for step in range(400):
            batch = 48 if step % 2 else 40  # two shapes, one step each in turn: each keeps its own cycles
            single = torch.stack([torch.randint(0, n, (batch,), generator=gen) for n in SIZES], 1).cuda()
            want = torch.cat([r(single[:, t:t + 1]) for t, r in enumerate(refs)], 1)
            assert_bitwise(m(single), want, f"step {step}")
    st = m.stats()
    pace = st["fused_admission"]
    assert pace["settles"] >= 1 and pace["timed_cycles"] >= 6, pace
    assert fused.planner.phase_changes >= 1  # the settled cache got its own plans
    decided = [st["fused_plan"].get(f"single {n * len(SIZES)} bags, settled") for n in (40, 48)]
    assert None not in decided and "calibrating" not in decided, st["fused_plan"]
    assert sum(st["fused_way_steps"].values()) == 400, st["fused_way_steps"]
    m.check_errors()
