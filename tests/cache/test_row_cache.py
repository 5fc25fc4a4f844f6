"""The engine's trainable row cache on its own: ``CachedRowManager`` over a ``HostStore`` (and ``FusedLookup``).

Real MiniLM word vectors (a slice of the 30522 x 384 table), stored compressed, in float32, float16 and bfloat16.
Checked bit for bit: admission (slot tables both ways, the rows that land in the slots), eviction and its
write-back to the host store (dirty rows only), hit/miss counters, an oversized batch growing the cache and the
next call shrinking it, flush, the pinned padding row, prefetch counting, ``load_weight``, an attached optimizer
whose state follows its rows (against the same optimizer over the whole table), and a hypothesis-driven sequence
of batches and writes against a plain tensor model of the table. ``FusedLookup``'s refresh runs on the CPU; its
pooled lookup needs CUDA (``gpu`` tests).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS, DIM = 400, 48
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def words(minilm: torch.Tensor) -> torch.Tensor:
    """400 ordinary words (ids 3000..3399), the first 48 dimensions: real trained values."""
    return minilm[3000:3000 + ROWS, :DIM].contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    assert torch.equal(_bits(a), _bits(b)), f"{what}: not bit-identical"


def _manager(table: torch.Tensor, capacity: int, device: torch.device = CPU, **kw: Any):
    from ibpcache.cache.host_store import FitOptions, HostStore
    from ibpcache.cache.policy import EvictionStrategy
    from ibpcache.cache.row_cache import CachedRowManager

    store = HostStore(table, codec=FitOptions(), compress=kw.pop("compress", True), device=device)
    kw.setdefault("strategy", EvictionStrategy.LFU)
    kw.setdefault("ids_freq_mapping", None)
    kw.setdefault("warmup_ratio", 0.0)
    return CachedRowManager(store, capacity, **kw)


def _check_maps(mgr: Any) -> None:
    """slot_of and id_of describe the same placement, and no id sits in two slots."""
    slots = mgr.occupied_slots()
    ids = mgr.id_of[slots]
    assert torch.equal(mgr.slot_of[ids].to(torch.int64), slots)
    assert int((mgr.slot_of >= 0).sum()) == slots.numel() == torch.unique(ids).numel()


def _cached_rows(mgr: Any) -> tuple[torch.Tensor, torch.Tensor]:
    slots = mgr.occupied_slots()
    return mgr.id_of[slots], mgr.cached_weight.detach()[slots]


# ------------------------------------------------------------------------------------------------
# admission, hits and misses
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_admission_places_the_stored_rows(words: torch.Tensor, dtype: torch.dtype) -> None:
    table = words.to(dtype)
    mgr = _manager(table, 32)
    assert mgr.store.compress and mgr.store.ratio > 1.0  # the host rows really are compressed
    ids = torch.tensor([[7, 3, 7], [250, 3, 99]])
    slots = mgr.prepare_ids(ids)
    assert slots.shape == ids.shape
    _same(mgr.cached_weight.detach()[slots], table[ids], "rows read through the slots")
    _check_maps(mgr)
    held, rows = _cached_rows(mgr)
    _same(rows, table[held], "every cached row")
    assert mgr.num_miss_history == [4] and mgr.num_hits_history == [0]
    again = mgr.prepare_ids(torch.tensor([99, 7, 5]))
    assert mgr.num_hits_history[-1] == 2 and mgr.num_miss_history[-1] == 1
    assert torch.equal(again[:2], mgr.prepare_ids(torch.tensor([99, 7])))  # hits stay where they are
    st = mgr.stats()
    assert st["hits"] == 2 + 2 and st["misses"] == 4 + 1 and st["lookups"] == 6 + 3 + 2 and st["steps"] == 3


def test_warmup_preloads_the_most_frequent_rows(words: torch.Tensor) -> None:
    freq = torch.zeros(ROWS, dtype=torch.int64)
    freq[[5, 17, 300, 42]] = torch.tensor([9, 50, 7, 30])
    mgr = _manager(words, 8, ids_freq_mapping=freq, warmup_ratio=0.5)
    assert sorted(_cached_rows(mgr)[0].tolist()) == [5, 17, 42, 300]
    plain = _manager(words, 8, warmup_ratio=0.5)
    assert sorted(_cached_rows(plain)[0].tolist()) == [0, 1, 2, 3]  # no frequencies: ids 0..k-1, as Colossal-AI


# ------------------------------------------------------------------------------------------------
# eviction and write-back
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_evicted_dirty_rows_are_written_back_bit_exact(words: torch.Tensor, dtype: torch.dtype) -> None:
    """Rows changed in the cache reach the host store when evicted, re-encoded in place (compressed where they still
    match the mask, raw where not); clean rows are not written."""
    table = words.to(dtype)
    mgr = _manager(table, 6)
    first = torch.arange(6)
    slots = mgr.prepare_ids(first)
    expected = table.clone()
    with torch.no_grad():  # an in-place update bumps the parameter's version: the cache counts as dirty
        new = torch.cat([table[200:203] * 3, torch.full((3, DIM), 1e4, dtype=dtype)])  # the last 3 stop compressing
        mgr.cached_weight[slots] = new
    expected[first] = new
    assert mgr.is_dirty()
    mgr.prepare_ids(torch.arange(100, 106))  # evicts all six
    assert mgr.stats()["evictions"] == 6 and mgr.num_write_back_history[-1] == 6
    _same(mgr.store.dense(), expected, "host table after the write-back")
    lengths = mgr.store.lengths[first]
    assert bool((lengths[3:] == mgr.store.row_bytes).all())  # stored raw in their own slots
    mgr.mark_clean()
    written = mgr.store.rows_written
    mgr.prepare_ids(torch.arange(50, 56))  # clean rows leave without a write
    assert mgr.store.rows_written == written and mgr.num_write_back_history[-1] == 0
    _same(mgr.full_weight(), expected, "full table")


def test_victims_are_never_rows_of_the_batch(words: torch.Tensor) -> None:
    mgr = _manager(words, 4)
    mgr.prepare_ids(torch.tensor([1, 2, 3, 4]))
    prep = mgr.prepare_unique(torch.tensor([1, 2, 9, 10]))  # two misses, two free-able slots: 3 and 4 go
    assert sorted(_cached_rows(mgr)[0].tolist()) == [1, 2, 9, 10]
    _same(mgr.cached_weight.detach()[prep.slots()], words[[1, 2, 9, 10]])
    assert mgr.slots == 4 and mgr.overflow_batches == 0


def test_pinned_padding_row_is_never_evicted(words: torch.Tensor) -> None:
    mgr = _manager(words, 3, pinned_ids=(11,))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        prep = mgr.prepare_unique(torch.randint(0, ROWS, (12,), generator=gen))
        assert int(mgr.id_of[0]) == 11 and int(mgr.slot_of[11]) == 0
        _check_maps(mgr)
        assert prep.pinned_pos is None or int(prep.uniq[prep.pinned_pos]) == 11
    prep = mgr.prepare_unique(torch.tensor([11, 5, 2]))
    assert int(prep.uniq[prep.pinned_pos]) == 11 and int(prep.slots()[0]) == 0


# ------------------------------------------------------------------------------------------------
# oversized batches, flush, prefetch, reload
# ------------------------------------------------------------------------------------------------


def test_oversized_batch_grows_for_one_call_then_shrinks(words: torch.Tensor) -> None:
    mgr = _manager(words, 5)
    param = mgr.cached_weight
    ids = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1))[:40]
    slots = mgr.prepare_ids(ids)
    assert mgr.slots == 40 and mgr.cached_weight is param  # the same Parameter object, grown
    _same(param.detach()[slots], words[ids], "every row of the oversized batch")
    with torch.no_grad():
        param.mul_(2)  # a training step over all 40 rows
    st = mgr.stats()
    assert st["overflow_batches"] == 1 and st["overflow_rows_max"] == 35
    small = torch.tensor([ids[0], ids[1]])
    mgr.prepare_ids(small)
    assert mgr.slots == 5 and int((mgr.id_of >= 0).sum()) <= 5
    _check_maps(mgr)
    _same(mgr.full_weight()[ids], words[ids] * 2, "rows written back when the cache shrank")
    rest = torch.tensor(sorted(set(range(ROWS)) - set(ids.tolist())))
    _same(mgr.full_weight()[rest], words[rest], "untouched rows")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flush_writes_every_cached_row_and_keeps_it(words: torch.Tensor, dtype: torch.dtype) -> None:
    table = words.to(dtype)
    mgr = _manager(table, 10)
    ids = torch.tensor([4, 8, 15, 16, 23, 42])
    slots = mgr.prepare_ids(ids)
    with torch.no_grad():
        mgr.cached_weight[slots] = -table[ids]
    expected = table.clone()
    expected[ids] = -table[ids]
    mgr.flush()
    _same(mgr.store.dense(), expected, "host table after flush")
    assert not mgr.is_dirty() and sorted(_cached_rows(mgr)[0].tolist()) == ids.tolist()
    written = mgr.store.rows_written
    mgr.flush()  # nothing changed since: nothing to write
    assert mgr.store.rows_written == written


def test_prefetch_admits_without_counting_a_lookup(words: torch.Tensor) -> None:
    mgr = _manager(words, 8)
    assert mgr.stats()["prefetch_hit_rate"] is None
    mgr.prepare_unique(torch.tensor([1, 2, 3]), count=False)
    assert mgr.step == 0 and mgr.num_hits_history == [] and mgr.prefetched_rows == 3
    mgr.prepare_ids(torch.tensor([1, 2, 3, 4]))
    assert mgr.num_hits_history == [3] and mgr.num_miss_history == [1]
    # the prefetch's own count: distinct rows looked for, and those not resident then (duplicates count once)
    mgr.prepare_unique(torch.tensor([4, 5, 5, 1, 6]), count=False)
    st = mgr.stats()
    assert (st["prefetch_unique_ids"], st["prefetch_misses"], st["prefetched_rows"]) == (7, 5, 5)
    assert st["prefetch_hit_rate"] == pytest.approx(2 / 7) and st["hit_rate"] == pytest.approx(3 / 4)


def test_load_weight_replaces_the_table_and_the_cached_rows(words: torch.Tensor) -> None:
    mgr = _manager(words, 8)
    slots = mgr.prepare_ids(torch.tensor([1, 2, 3]))
    fresh = words.flip(0).contiguous()
    mgr.load_weight(fresh)
    _same(mgr.cached_weight.detach()[slots], fresh[[1, 2, 3]], "cached rows reloaded")
    _same(mgr.full_weight(), fresh, "table")
    with pytest.raises(ValueError, match="expected shape"):
        mgr.load_weight(words[:10])


# ------------------------------------------------------------------------------------------------
# an attached optimizer, against the same optimizer over the whole table
# ------------------------------------------------------------------------------------------------


OPTIMIZERS = {
    "sgd-momentum-decay": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3), True),
    "adam": (lambda p: torch.optim.Adam(p, lr=0.01), False),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05), False),
    "adagrad-decay": (lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=1e-3), True),
}
"""name -> (factory, uses ``Tensor.add(other, alpha=...)``: SGD's update, weight decay added to the gradient)."""


def _within_tail_rounding(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The documented tolerance (``row_optimizer.py``): on the CPU torch rounds fp16/bf16 ``add(alpha=...)`` once in
    the vectorized body of a loop and twice in its scalar tail, so an element's update depends on its position in
    its tensor, and the cache's rows sit elsewhere than the table's. A few elements may then differ by about one
    rounding of the largest value per update; a missed update or misplaced state would change whole rows."""
    diff = (got.float() - want.float()).abs()
    ulp = torch.finfo(want.dtype).eps * 2.0 ** torch.floor(torch.log2(want.float().abs().max()))
    assert float(diff.max()) <= 2 * float(ulp), f"{what}: max difference {float(diff.max())} > 2 ulps ({float(ulp)})"
    assert float((diff > 0).float().mean()) < 0.03, f"{what}: {int((diff > 0).sum())} of {diff.numel()} differ"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attached_optimizer_equals_it_over_the_full_table(words: torch.Tensor, name: str, dtype: torch.dtype,
                                                         device: str) -> None:
    """The manager alone (no embedding bag): each step makes a batch's rows resident, puts the reference's gradient
    rows on their slots, and steps; evictions, oversized batches and catch-ups happen underneath. The cached rows
    and the final table equal the same optimizer stepping the whole table bit for bit (bf16 with ``add(alpha)``
    updates on the CPU: within the documented tolerance)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    make_opt, adds_with_alpha = OPTIMIZERS[name]
    dev = torch.device(device) if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    check = _within_tail_rounding if adds_with_alpha and dtype != torch.float32 and device == "cpu" else _same
    table = words.to(dtype)
    mgr = _manager(table, 12, dev)
    ref = torch.nn.Parameter(table.to(dev))
    opt, ref_opt = make_opt([mgr.cached_weight]), make_opt([ref])
    mgr.attach_optimizer(opt)
    gen = torch.Generator().manual_seed(2)
    for step in range(12):
        n = 30 if step % 4 == 3 else 8  # every fourth batch has more distinct ids than the cache has rows
        ids = torch.randint(0, 40, (n,), generator=gen).to(dev)
        prep = mgr.prepare_unique(ids)
        check(mgr.cached_weight.detach()[prep.slot_u], ref.detach()[prep.uniq], f"rows before step {step}")
        grad = torch.randn(prep.uniq.numel(), DIM, generator=gen).to(dev, dtype)
        ref.grad = torch.zeros_like(ref).index_copy_(0, prep.uniq, grad)
        mgr.cached_weight.grad = torch.zeros_like(mgr.cached_weight).index_copy_(0, prep.slot_u, grad)
        mgr.dirty = True
        opt.step()
        ref_opt.step()
    assert mgr.evictions > 0 and mgr.overflow_batches > 0
    check(mgr.full_weight(), ref.detach().cpu(), "table")
    mgr.flush()
    check(mgr.store.dense(), ref.detach().cpu(), "host table after flush")


# ------------------------------------------------------------------------------------------------
# a random workload against a plain model of the table
# ------------------------------------------------------------------------------------------------


def test_random_batches_and_writes_match_a_plain_table(words: torch.Tensor) -> None:
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    batch = st.lists(st.integers(0, 59), min_size=0, max_size=14)
    ops = st.lists(st.tuples(batch, st.booleans(), st.sampled_from(["lfu", "lru", "dataset"])), min_size=1,
                   max_size=12)

    @hypothesis.given(ops=ops, capacity=st.integers(1, 6))
    @hypothesis.settings(max_examples=25, deadline=None)
    def run(ops: list, capacity: int) -> None:
        mgr = _manager(words[:60].contiguous(), capacity, strategy=ops[0][2])
        model = words[:60].clone()
        for k, (ids, write, _) in enumerate(ops):
            ids_t = torch.tensor(ids, dtype=torch.int64)
            slots = mgr.prepare_ids(ids_t)
            _same(mgr.cached_weight.detach()[slots], model[ids_t], f"batch {k}")
            _check_maps(mgr)
            assert int((mgr.id_of >= 0).sum()) <= max(capacity, len(set(ids)))
            if write and ids:
                uniq = ids_t.unique()
                new = words[100:100 + uniq.numel()] * (k + 2)
                with torch.no_grad():
                    mgr.cached_weight[mgr.slot_of[uniq].to(torch.int64)] = new
                model[uniq] = new
        _same(mgr.full_weight(), model, "table")
        mgr.flush()
        _same(mgr.store.dense(), model, "host table after flush")

    run()


# ------------------------------------------------------------------------------------------------
# FusedLookup
# ------------------------------------------------------------------------------------------------


def _pool(fused: Any, table: torch.Tensor, ids: torch.Tensor, offsets: "torch.Tensor | None", mode: str = "sum",
          psw: "torch.Tensor | None" = None, bag_size: int = 0) -> torch.Tensor:
    n_bags = offsets.numel() if offsets is not None else ids.numel() // bag_size
    out = torch.empty((n_bags, table.shape[1]), dtype=table.dtype, device=fused.mgr.device)
    fused.pool(ids, offsets, bag_size, n_bags, False, mode, psw, out, None)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_fused_lookup_on_cpu_equals_embedding_bag(words: torch.Tensor, dtype: torch.dtype, mode: str) -> None:
    """The fused path's admission (the kernels' CPU twin) and reads (slots of stored rows, staged rows, host rows),
    step after step on a skewed stream: every pooled bag equals ``embedding_bag`` over the dense table, rows enter the
    cache as stored, and what is resident is what the slot table says."""
    table = words.to(dtype)
    mgr = _manager(table, 30)
    fused = mgr.fused_lookup()
    fused.planner.fix("multi", "staged")
    gen = torch.Generator().manual_seed(5)
    hot = torch.randperm(ROWS, generator=gen)[:60]
    for step in range(12):
        ids = torch.where(torch.rand(200, generator=gen) < 0.8, hot[torch.randint(0, 60, (200,), generator=gen)],
                          torch.randint(0, ROWS, (200,), generator=gen))
        offsets = torch.arange(0, 200, 4)
        psw = torch.rand(200, generator=gen).to(dtype) if mode == "sum" and step % 2 else None
        got = _pool(fused, table, ids, offsets, mode, psw)
        want = torch.nn.functional.embedding_bag(ids, table, offsets, mode=mode, per_sample_weights=psw)
        _same(got, want, f"step {step}")
        fixed = ids[:60].view(20, 3)  # fixed-size bags
        _same(_pool(fused, table, fixed.reshape(-1), None, mode, bag_size=3),
              torch.nn.functional.embedding_bag(fixed, table, mode=mode), f"fixed bags, step {step}")
    assert mgr.form == "stored" and int((mgr.slot_of < -1).sum()) == 0  # staged rows left the slot table
    slots, held = mgr.policy.resident()
    assert torch.equal(mgr.slot_of[held].to(torch.int64), slots)
    stored = mgr.store.stored_lengths()[held]
    assert torch.equal(fused.slot_len[slots], stored) and bool((stored <= fused.slot_bytes).all())
    slab = mgr.cached_weight.detach().view(torch.uint8).reshape(-1)
    host = mgr.store.data.view(torch.uint8)
    rb = mgr.store.row_bytes
    for s_, i_, n_ in zip(slots.tolist(), held.tolist(), stored.tolist()):
        assert torch.equal(slab[s_ * fused.slot_bytes: s_ * fused.slot_bytes + n_], host[i_ * rb: i_ * rb + n_])
    st = mgr.stats()
    assert st["fused_admitted"] > 0 and st["fused_staged"] > 0 and 0 < st["fused_hits"] < st["fused_lookups"]
    assert st["fused_hit_rate_recent"] > st["fused_hit_rate"] * 0.9


def test_fused_staging_reads_each_distinct_miss_once(words: torch.Tensor) -> None:
    """With staging, a step reads every distinct missed row from host memory once, however many bags ask for it;
    without, every request of a missed row does (what the lookup kernel's zero-copy reads cost)."""
    for staged in (True, False):
        mgr = _manager(words, 4)
        fused = mgr.fused_lookup()
        fused.planner.fix("multi", "staged" if staged else "zero-copy")
        ids = torch.cat([torch.arange(100, 150)] * 5)  # 50 distinct cold rows, each asked 5 times
        offsets = torch.arange(0, 250, 5)
        _same(_pool(fused, words, ids, offsets), torch.nn.functional.embedding_bag(ids, words, offsets, mode="sum"))
        st = mgr.stats()
        stored = int(mgr.store.stored_lengths()[100:150].sum())
        if staged:  # read once each: admitted (copied into a slot) or staged
            assert st["fused_host_bytes"] == stored and st["fused_staged"] + st["fused_admitted"] == 50
        else:
            assert st["fused_staged"] == 0 and st["fused_admitted"] <= 4
        assert st["fused_hits"] == 0 and st["fused_lookups"] == 250


def test_switching_forms_writes_back_and_starts_cold(words: torch.Tensor) -> None:
    """Training rows (dirty) -> an inference lookup: they are written back and leave; the inference cache holds
    stored rows; the next training batch finds the cache in its raw form, empty, and the table is current."""
    mgr = _manager(words, 10)
    ids = torch.tensor([3, 5, 7])
    slots = mgr.prepare_ids(ids)
    with torch.no_grad():
        mgr.cached_weight[slots] = words[ids] * 3
    mgr.dirty = True
    fused = mgr.fused_lookup()
    expect = words.clone()
    expect[ids] = words[ids] * 3
    probe = torch.tensor([3, 5, 9, 11])
    _same(_pool(fused, words, probe, torch.arange(4)), expect[probe], "inference reads the written-back rows")
    assert mgr.form == "stored" and mgr.stats()["form_switches"] == 1 and mgr.store.rows_written == 3
    assert fused.n_slots >= 10  # the same bytes, slots sized to compressed rows
    got = mgr.prepare_ids(torch.tensor([5, 20]))
    assert mgr.form == "raw" and mgr.stats()["form_switches"] == 2
    _same(mgr.cached_weight.detach()[got], expect[[5, 20]], "training reads current rows")
    assert sorted(_cached_rows(mgr)[0].tolist()) == [5, 20]
    _same(mgr.full_weight(), expect, "table")


def test_compressed_slots_hold_more_rows_than_raw_ones(minilm: torch.Tensor) -> None:
    """``compress_cache``: the inference cache's slots are sized to fit 99.9% of the stored (compressed) rows, so the
    same bytes hold more of them; without it, one ``row_bytes`` slot per row, as in training."""
    rows = minilm[5000:5400, :128].contiguous()  # 512 B rows of real values: every one compresses
    packed = _manager(rows, 40).fused_lookup()
    raw = _manager(rows, 40).fused_lookup(compress_cache=False)
    for f in (packed, raw):
        _pool(f, rows, torch.arange(10), torch.arange(10))
    rb = raw.mgr.store.row_bytes
    assert raw.n_slots == 40 and raw.slot_bytes == rb
    lengths = packed.mgr.store.stored_lengths()
    fit = -(-999 * lengths.numel() // 1000)  # rows a slot must fit: 99.9% of them, rounded up
    want = -(-int(torch.sort(lengths).values[fit - 1]) // 16) * 16
    assert packed.slot_bytes == want < rb and packed.n_slots == 40 * rb // want > 40


def test_prefetched_rows_are_resident_and_protected(words: torch.Tensor) -> None:
    """prefetch admits the next batch's rows (here the CPU runs it inline); later prefetches may not evict them before
    their lookup (nor rows used since: TorchRec's order, prefetch i + 1 then lookup i, keeps both batches), and that
    lookup hits every one and counts its ids once. Once looked up, rows compete again."""
    mgr = _manager(words, 8)
    fused = mgr.fused_lookup(compress_cache=False)
    fused.planner.fix("multi", "zero-copy")
    a = torch.tensor([1, 2, 3, 4, 5, 6])
    b = torch.tensor([30, 31, 32, 33, 34, 35])
    fused.prefetch(a, torch.arange(6), 0, False, None)
    assert sorted(_cached_rows(mgr)[0].tolist()) == a.tolist()
    fused.prefetch(b, torch.arange(6), 0, False, None)  # only 2 free slots left, a's 6 rows protected
    held = set(_cached_rows(mgr)[0].tolist())
    assert set(a.tolist()) <= held and len(held) == 8
    _same(_pool(fused, words, a, torch.arange(6)), words[a])
    assert mgr.stats()["fused_hits"] == 6 and mgr.stats()["fused_prefetches"] == 2
    assert mgr.policy.sketch.estimate(a).tolist() == [1] * 6  # counted by the prefetch only
    resident = set(_cached_rows(mgr)[0].tolist())
    c = torch.tensor([60, 61, 62] * 4)  # requested 4 times each: worth more than a's and b's rows
    for _ in range(3):  # b is pending (prefetched, not looked up): nothing used since its prefetch may leave
        fused.prefetch(c, torch.arange(12), 0, False, None)
        assert set(_cached_rows(mgr)[0].tolist()) == resident
    _same(_pool(fused, words, b, torch.arange(6)), words[b])
    fused._pending.clear()  # the prefetches of c are never looked up: forget them
    for _ in range(2):
        _same(_pool(fused, words, c, torch.arange(12)), words[c])
    assert set(c.tolist()) <= set(_cached_rows(mgr)[0].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_fused_pool_equals_embedding_bag(words: torch.Tensor, dtype: torch.dtype, mode: str) -> None:
    """One launch reads cached rows from the slots and the rest zero-copy from the compressed host store: equal to
    ``embedding_bag`` over the dense table; the device counters say how many ids hit."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from ibpcache.cache.row_cache import pool_supported

    dev = torch.device("cuda", torch.cuda.current_device())
    table = words.to(dtype)
    mgr = _manager(table, 40, dev)
    assert pool_supported(dtype, mgr.store.row_bytes)
    fused = mgr.fused_lookup()
    ids = torch.randint(0, ROWS, (300,), generator=torch.Generator().manual_seed(3))
    offsets = torch.arange(0, 300, 5)
    for _ in range(2):  # cold, then with the rows the first lookup admitted
        out = torch.empty((offsets.numel(), DIM), dtype=dtype, device=dev)
        fused.pool(ids.to(dev), offsets.to(dev), 0, offsets.numel(), False, mode, None, out, None)
        want = torch.nn.functional.embedding_bag(ids.to(dev), table.to(dev), offsets.to(dev), mode=mode)
        _same(out, want, "pooled rows (torch's CUDA embedding_bag over the dense table)")
    stats = fused.stats()
    assert stats["fused_lookups"] == 600 and 0 < stats["fused_hits"] <= 300 and stats["fused_admitted"] > 0
    assert int((mgr.slot_of < -1).sum()) == 0
    fused.errors.take() is None or pytest.fail("a bad id was reported for valid input")


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["lfu", "lru", "dataset"])
def test_fused_admission_kernels_equal_the_cpu_twin(words: torch.Tensor, strategy: str) -> None:
    """The admission kernels decide exactly as their CPU twin: from the same state, the same rows end up in the same
    slots (staging rows may be numbered differently), and the same sketch counters result."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(8)
    mgrs = [_manager(words, 16, d, strategy=strategy) for d in (CPU, dev)]
    lookups = [m.fused_lookup() for m in mgrs]
    for f in lookups:
        f.planner.fix("multi", "staged")
    for step in range(10):
        ids = torch.randint(0, 120, (180,), generator=gen)
        offsets = torch.arange(0, 180, 3)
        outs = [_pool(f, words, ids.to(f.mgr.device), offsets.to(f.mgr.device)) for f in lookups]
        _same(outs[0], outs[1], f"step {step}")
        cpu, gpu = (m.policy for m in mgrs)
        assert torch.equal(cpu.slot_ids, gpu.slot_ids.cpu()), f"step {step}: slot tables differ"
        assert torch.equal(mgrs[0].slot_of, mgrs[1].slot_of.cpu())
        if cpu.sketch is not None:
            assert torch.equal(cpu.sketch.table, gpu.sketch.table.cpu())
    assert mgrs[1].stats()["fused_admitted"] == mgrs[0].stats()["fused_admitted"]


def test_sorted_rows_sorts_as_int64_whatever_the_key_width() -> None:
    """The admission's sort: int32 keys below 2^31 rows, int64 above; the same sorted keys (int64) either way, and a
    permutation that sorts them (keys include n_rows, the mark of a bad id)."""
    from ibpcache.cache.row_cache import _sorted_rows

    gen = torch.Generator().manual_seed(0)
    for n_rows in (1000, 2 ** 31 - 1, 2 ** 40):
        keys = torch.randint(0, min(n_rows, 2 ** 62), (5000,), generator=gen)
        keys[::97] = n_rows
        s, perm = _sorted_rows(keys, n_rows)
        assert s.dtype == torch.int64 and torch.equal(s, torch.sort(keys).values)
        assert torch.equal(keys[perm], s)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(-3, 60), st.sampled_from([-(1 << 63), (1 << 63) - 1])), min_size=1,
                    max_size=200))
def test_sorted_unique_equals_torch_unique_without_a_sync(device: str, ids: list) -> None:
    """prepare_unique's one-read unique: the distinct ids, each id's index among them and their counts are
    torch.unique's, padded (zeros past the count), with the count left on the device."""
    from ibpcache.cache.row_cache import _sorted_unique

    flat = torch.tensor(ids, dtype=torch.int64, device=device)
    uniq, inv, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
    got_u, got_inv, got_c, n = _sorted_unique(flat)
    assert n.device == flat.device and int(n) == uniq.numel()
    assert torch.equal(got_u[: int(n)], uniq) and torch.equal(got_inv, inv) and torch.equal(got_c[: int(n)], counts)
    assert not got_c[int(n):].any()
