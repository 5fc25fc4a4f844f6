"""Every store of the engine takes any codec (IBP, exponent coding, raw), and the planner picks among them.

CPU (runs everywhere): the host store, FeatureCache (every policy and compress combination), CompressedRows of any
codec as a store, the planner's three-way rule and its CPU fallback (smallest stored size), bad rows refused before
anything is stored, the cpu-gather staging of exponent rows. GPU (``-m gpu``): the one lookup kernel decodes
exponent rows (rows, pooling, zero-copy host reads, slab hits, staged misses), descriptor decodes, write-back and
slab admission encode on the GPU; every output is compared bit for bit with the CPU reference (the Numba decoder
or the source rows themselves).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cache_helpers import assert_same_rows, id_batches

from ibpcache import Codec, CompressedRows, ExponentCodec
from ibpcache.cache.feature_cache import FeatureCache
from ibpcache.cache.host_store import FAST_SEG, FitOptions, HostStore, fit_candidates
from ibpcache.cache.plan_layout import MARGIN, MIN_RATIO, best_compressed, candidate_names, decide_codec, pick_codec
from ibpcache.errors import FormatError, InvalidArgumentError, RowDtypeError, RowShapeError

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OFF = 4000
"""MiniLM's first rows are special tokens (nearly constant: IBP codes them 1.5-2x); real words start later."""
_SPECIALS = {torch.float32: [0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x00000001],
             torch.bfloat16: [0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x7F81, 0xFFFF, 0x0001],
             torch.float16: [0x8000, 0x7C00, 0xFC00, 0x7E01, 0x7C01, 0xFFFF, 0x0001]}


def dense_rows(minilm: torch.Tensor, dtype: torch.dtype, n: int = 1500, cols: int = 384) -> torch.Tensor:
    """Real MiniLM rows cast to ``dtype``, with -0.0, infinities, NaN payloads and denormals planted in a few rows
    (a codec must store every bit pattern, not only the ones it was fitted on)."""
    x = minilm[OFF: OFF + n, :cols].to(dtype).clone()  # never a view: tests write into it
    ints = x.view(torch.int32 if dtype == torch.float32 else torch.int16)
    gen = torch.Generator().manual_seed(11)
    for k, pattern in enumerate(_SPECIALS[dtype]):
        r, c = int(torch.randint(0, n, (1,), generator=gen)), (7 * k) % cols
        ints[r, c] = pattern if pattern < 2 ** (8 * x.element_size() - 1) else pattern - 2 ** (8 * x.element_size())
    return x


def exp_codec(rows: torch.Tensor, seg: "int | str | None" = "auto") -> ExponentCodec:
    codec = ExponentCodec.fit(rows, seg=seg)
    assert isinstance(codec, ExponentCodec)
    return codec


# ---- the planner's rule ----------------------------------------------------------------------------------------


def test_rule_three_way_keeps_compression_only_where_faster_than_raw() -> None:
    ratios = {"ibp": 1.15, "exponent": 1.19}
    within = decide_codec(ratios, {"ibp": 0.99, "exponent": 0.985, "raw": 1.0})
    assert not within.compress and within.method == "raw" and "of raw" in within.reason
    exp = decide_codec(ratios, {"ibp": 0.99, "exponent": 0.90, "raw": 1.0})
    assert exp.compress and exp.method == "exponent" and exp.compressed_ms == 0.90 and exp.raw_ms == 1.0
    assert exp.timings_ms == {"ibp": 0.99, "exponent": 0.90, "raw": 1.0} and exp.ratios == ratios
    ibp = decide_codec(ratios, {"ibp": 0.80, "exponent": 0.90, "raw": 1.0})  # IBP 11% faster than exponent
    assert ibp.method == "ibp" and ibp.ratio == 1.15


def test_rule_weighs_cache_hits_decoded_from_device_memory() -> None:
    """Dense float rows (bench_dlrm, 512 B MiniLM fp32 on an H200): IBP misses 1.06x faster than raw, but IBP hits
    decode ~3x slower than raw rows read from HBM, so at 90% hits raw rows win; sparse rows (Cora: IBP 25x) win
    both ways; without hit timings the miss rule alone decides."""
    ratios = {"ibp": 1.145, "exponent": 1.19}
    misses = {"ibp": 0.0845, "exponent": 0.148, "raw": 0.0892}
    dense = decide_codec(ratios, misses, hit_timings_ms={"ibp": 0.030, "exponent": 0.060, "raw": 0.010})
    assert not dense.compress and dense.method == "raw" and "cache hits" in dense.reason
    assert dense.hit_timings_ms["ibp"] == 0.030
    assert decide_codec(ratios, misses).method == "ibp"  # misses only: compression
    sparse = decide_codec({"ibp": 25.4}, {"ibp": 0.01, "raw": 0.10}, hit_timings_ms={"ibp": 0.009, "raw": 0.011})
    assert sparse.compress and sparse.method == "ibp"
    # a codec that pays on misses and costs a little on hits is kept while the blend still pays
    blend = decide_codec({"ibp": 1.5}, {"ibp": 0.60, "raw": 1.0}, hit_timings_ms={"ibp": 0.12, "raw": 0.10})
    assert blend.compress  # 0.1 * 0.6 + 0.9 * 0.12 = 0.168 <= (0.1 * 1.0 + 0.9 * 0.10) * (1 - margin) = 0.184
    near = decide_codec({"ibp": 1.5}, {"ibp": 0.60, "raw": 1.0}, hit_timings_ms={"ibp": 0.14, "raw": 0.10})
    assert not near.compress  # 0.186: ahead of raw's 0.19 by less than the margin, so a rebuild could flip it
    lose = decide_codec({"ibp": 1.5}, {"ibp": 0.60, "raw": 1.0}, hit_timings_ms={"ibp": 0.20, "raw": 0.10})
    assert not lose.compress  # 0.24 > 0.19


def test_rule_hysteresis_keeps_the_smaller_store_at_equal_speed() -> None:
    ratios = {"ibp": 1.15, "exponent": 1.19}
    near = decide_codec(ratios, {"ibp": 0.89, "exponent": 0.90, "raw": 1.0})  # IBP only 1% faster
    assert near.method == "exponent" and "smaller store stays" in near.reason
    edge = decide_codec(ratios, {"ibp": 0.90 * (1 - MARGIN), "exponent": 0.90, "raw": 1.0})
    assert edge.method == "ibp"


def test_rule_floor_forced_compression_and_cpu() -> None:
    assert decide_codec({"ibp": MIN_RATIO - 0.01, "exponent": 1.001}, {"raw": 1.0}).method == "raw"
    forced = decide_codec({"ibp": 1.15, "exponent": 1.19}, {"ibp": 1.2, "exponent": 1.3}, allow_raw=False)
    assert forced.compress and forced.method == "ibp"  # no raw rows to beat: the fastest codec
    assert decide_codec({"ibp": 1.01}, {}, allow_raw=False).method == "ibp"  # asked for, kept however small
    cpu = decide_codec({"ibp": 25.4, "exponent": 1.28}, {})
    assert cpu.compress and cpu.method == "ibp" and "smallest stored size" in cpu.reason and cpu.samples == 0
    assert best_compressed(decide_codec({"ibp": 1.15, "exponent": 1.19}, {"ibp": 0.99, "exponent": 0.98,
                                                                           "raw": 1.0})) == "exponent"
    assert best_compressed(cpu) == "ibp"


def test_fit_options_validate_and_refit_like_a_codec(minilm: torch.Tensor) -> None:
    with pytest.raises(InvalidArgumentError, match="method must be one of"):
        FitOptions(method="zstd")
    x = minilm[OFF: OFF + 300, :64].contiguous()
    assert FitOptions.of(exp_codec(x, 16)) == FitOptions(method="exponent", seg=16)
    ibp = Codec.fit(x, chunk_bytes=2)
    assert FitOptions.of(ibp) == FitOptions(threshold=ibp.threshold, chunk_bytes=2)
    assert FitOptions.of(Codec.raw(torch.float32, (64,))).method == "raw"
    assert FitOptions(method="auto").methods(torch.float32) == ("ibp", "exponent")
    assert FitOptions(method="auto").methods(torch.int64) == ("ibp",)  # exponent coding needs floats


# ---- the host store ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_store_exponent_rows_read_write_dense(minilm: torch.Tensor, dtype: torch.dtype) -> None:
    x = dense_rows(minilm, dtype, n=800, cols=256)
    codec = exp_codec(x)
    store = HostStore(x, codec=codec, compress=True, device=CPU)
    assert store.compress and store.codec is codec and store.ratio > 1.05
    st = store.stats()
    assert st["codec_method"] == "exponent" and st["segment_elems"] == codec.seg and st["chunk_bytes"] is None
    ids = torch.tensor([5, 0, 799, 5, 300])
    out = torch.empty((5, store.row_bytes), dtype=torch.uint8)
    store.read_into(ids, out)
    assert torch.equal(out, x.view(torch.uint8).reshape(800, -1)[ids])
    # write-back: rows that code (real rows) and rows that do not (uniform bit patterns: stored raw)
    new = x[:4].clone()
    new[1] = torch.randint(-2 ** 15, 2 ** 15 - 1, (256 * new.element_size() // 2,), dtype=torch.int16,
                           generator=torch.Generator().manual_seed(4)).view(dtype)
    where = torch.tensor([10, 11, 12, 13])
    store.write_rows(where, new.view(torch.uint8).reshape(4, -1))
    want = x.clone()
    want[where] = new
    assert torch.equal(store.dense().view(torch.uint8), want.view(torch.uint8))
    lens = store.stored_lengths()[where]
    assert int(lens[1]) == store.row_bytes and bool((lens[[0, 2, 3]] < store.row_bytes).all())
    assert torch.equal(lens, torch.from_numpy(codec.row_lengths(new.view(torch.uint8).reshape(4, -1).numpy())))


def test_host_store_refuses_rows_of_another_dtype_or_width(minilm: torch.Tensor) -> None:
    """Bad rows raise the codec's errors before anything is stored: the table reads back unchanged."""
    x = minilm[OFF: OFF + 200, :64].contiguous()
    store = HostStore(x, codec=exp_codec(x), compress=True, device=CPU)
    before = store.dense()
    rows = x[:2].view(torch.uint8).reshape(2, -1)
    with pytest.raises(RowShapeError, match="256"):
        store.write_rows(torch.tensor([0, 1]), rows[:, :128])
    with pytest.raises(RowDtypeError, match="uint8"):
        store.write_rows(torch.tensor([0, 1]), x[:2])
    with pytest.raises(RowShapeError, match="one id per row"):
        store.write_rows(torch.tensor([0, 1, 2]), rows)
    with pytest.raises(RowDtypeError, match="float32"):
        store.refit(x.to(torch.bfloat16))
    with pytest.raises(RowShapeError, match="shape"):
        store.refit(x[:, :32])
    with pytest.raises(RowDtypeError):  # a codec fitted on other rows never stores these
        HostStore(x.to(torch.float16), codec=exp_codec(x), compress=True, device=CPU)
    with pytest.raises(RowShapeError):
        HostStore(minilm[OFF: OFF + 200, :32].contiguous(), codec=exp_codec(x), compress=True, device=CPU)
    assert torch.equal(store.dense().view(torch.int32), before.view(torch.int32))


def test_keep_raw_turns_a_planned_store_raw_and_refuses_another_table(minilm: torch.Tensor) -> None:
    """keep_raw (a planned store whose table starts training): the same rows, raw, the reason in stats; a table of
    another dtype or shape raises the error naming it and leaves the store as it was."""
    dense = minilm[OFF: OFF + 600, :64].contiguous()
    st = HostStore(dense, codec=FitOptions(method="auto"), compress="auto", device=CPU)
    assert st.compress and st.stats()["host_layout"]["method"] == "exponent"
    with pytest.raises(RowDtypeError, match="float32"):
        st.keep_raw(dense.half(), "x")
    with pytest.raises(RowShapeError, match="shape"):
        st.keep_raw(dense[:-1], "x")
    assert st.compress and torch.equal(st.dense(), dense)
    st.keep_raw(dense, "trained: because")
    lay = st.stats()["host_layout"]
    assert not st.compress and st.codec.method == "raw" and lay["method"] == "raw"
    assert lay["reason"] == "trained: because"
    assert torch.equal(st.dense().view(torch.int32), dense.view(torch.int32))
    ids = torch.tensor([5, 0, 599, 5])
    assert torch.equal(st.raw_rows(ids).view(torch.float32), dense[ids])


def test_host_store_auto_picks_the_smallest_without_cuda(minilm: torch.Tensor, cora: Any) -> None:
    """compress='auto' with FitOptions(method='auto'): on the CPU nothing can be timed, so the smallest stored size
    wins among IBP, exponent coding and raw rows; stats say which and with what ratios."""
    dense = minilm[OFF: OFF + 1500, :128].contiguous()
    st = HostStore(dense, codec=FitOptions(method="auto"), compress="auto", device=CPU)
    lay = st.stats()["host_layout"]
    assert lay["method"] == "exponent" and st.codec.method == "exponent" and st.compress
    assert set(lay["ratios"]) == {"ibp", "exponent", "exponent_seg32"}  # fitted segments > 32: the short ones too
    assert lay["ratios"]["exponent"] > lay["ratios"]["exponent_seg32"] > lay["ratios"]["ibp"] > 1.05
    assert "smallest stored size" in lay["reason"] and lay["timings_ms"] == {}
    assert torch.equal(st.dense().view(torch.int32), dense.view(torch.int32))
    sparse = cora.features[:600].contiguous()
    ibp = HostStore(sparse, codec=FitOptions(method="auto"), compress="auto", device=CPU)
    assert ibp.codec.method == "ibp" and ibp.stats()["host_layout"]["ratios"]["ibp"] > 10
    noise = torch.randint(-2 ** 31, 2 ** 31 - 1, (400, 16), generator=torch.Generator().manual_seed(3),
                          dtype=torch.int64).to(torch.int32).view(torch.float32)
    raw = HostStore(noise, codec=FitOptions(method="auto"), compress="auto", device=CPU)
    assert not raw.compress and raw.stats()["host_layout"]["method"] == "raw"
    ints = HostStore(cora.features[:600].to(torch.int32), codec=FitOptions(method="auto"), compress="auto",
                     device=CPU)
    assert set(ints.stats()["host_layout"]["ratios"]) == {"ibp"}  # no exponent candidate for integers
    forced = HostStore(dense, codec=FitOptions(method="auto"), compress=True, device=CPU)
    assert forced.codec.method == "exponent" and forced.stats()["host_layout"]["method"] == "exponent"


def test_refit_keeps_the_planned_method(minilm: torch.Tensor) -> None:
    x = minilm[OFF: OFF + 600, :96].contiguous()
    store = HostStore(x, codec=FitOptions(method="auto"), compress="auto", device=CPU)
    assert store.codec.method == "exponent"
    shifted = (x * 3.0).contiguous()  # other binades: the code is refitted, its method stays
    store.refit(shifted)
    assert store.codec.method == "exponent" and store.refits == 1
    assert torch.equal(store.dense().view(torch.int32), shifted.view(torch.int32))
    adopted = HostStore.adopt(exp_codec(x, 32).compress(x, pin=False), device=CPU)
    adopted.refit(shifted)  # an adopted store refits like its codec was fitted: exponent, 32-element segments
    assert adopted.codec.method == "exponent" and adopted.codec.seg == 32 and not adopted.read_only


def test_cpu_gather_staging_carries_exponent_rows_as_stored(minilm: torch.Tensor) -> None:
    """HostStore.stage (the cpu_gather transfer's host half) copies every row's STORED bytes and writes a
    descriptor per id; decoding those descriptors (here with the CPU decoder) gives the rows back: the path is the
    same for any codec, only the GPU decode kernel differs."""
    x = dense_rows(minilm, torch.bfloat16, n=700, cols=200)
    codec = exp_codec(x)
    store = HostStore(x, codec=codec, compress=True, device=CPU)
    ids = np.array([3, 3, 699, 0, 250, 12], dtype=np.int64)
    st = store.stage(ids)
    staged_buf = torch.empty(0, dtype=torch.uint8).set_(st.src.untyped_storage())  # the one staged buffer
    offsets = st.src.numpy() - staged_buf.data_ptr()  # descriptors hold absolute addresses into it
    out = np.zeros((ids.size, store.row_bytes), dtype=np.uint8)
    codec.decode_rows_at(staged_buf.numpy(), offsets, st.lengths.numpy(), out, np.arange(ids.size),
                         compressed=st.compressed.numpy())
    assert np.array_equal(out, x.view(torch.uint8).reshape(700, -1).numpy()[ids])
    staged = int(st.counters[2])
    assert staged == int(store.stored_lengths()[torch.from_numpy(ids)].sum()) < ids.size * store.row_bytes


# ---- FeatureCache over any codec (CPU) -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["static", "lru", "lfu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_feature_cache_exponent_every_combination(minilm: torch.Tensor, dtype: torch.dtype, policy: str) -> None:
    x = dense_rows(minilm, dtype, n=1200, cols=128)
    codec = exp_codec(x)
    for cc, ch in ((True, True), (True, False), (False, True)):
        fc = FeatureCache(x, 0.1, policy=policy, device="cpu", codec=codec, compress_cache=cc, compress_host=ch)
        for ids in id_batches(x.shape[0], seed=3):
            assert_same_rows(fc.fetch(ids), x, ids)
        st = fc.stats()
        assert st["hits"] > 0 and st["misses"] > 0
        if cc:
            assert st["capacity_increase"] > 1.05  # the slab holds exponent-coded rows: more of them
        assert st["host_layout"]["method"] == ("exponent" if ch else "raw")


@pytest.mark.parametrize("layout", ["inplace", "packed"])
def test_feature_cache_over_exponent_compressed_rows(minilm: torch.Tensor, layout: str) -> None:
    x = dense_rows(minilm, torch.float32, n=900, cols=384)
    packed = exp_codec(x).compress(x, layout=layout, pin=False)
    fc = FeatureCache(packed, 0.05, device="cpu")
    assert fc.codec is packed.codec and fc.stats()["host_layout"]["method"] == "exponent"
    for ids in id_batches(900, seed=5):
        assert_same_rows(fc.fetch(ids), x, ids)


def test_feature_cache_codec_auto(minilm: torch.Tensor, cora: Any) -> None:
    """codec='auto' on the CPU: the smallest stored size among the candidates (dense floats: exponent coding,
    bag of words: IBP); with compress_host=False the slab still gets the smallest codec."""
    dense = minilm[OFF: OFF + 1000, :128].contiguous()
    ids = torch.randint(0, 1000, (2500,), generator=torch.Generator().manual_seed(9))
    fc = FeatureCache(dense, 0.05, device="cpu", codec="auto", compress_host="auto")
    lay = fc.stats()["host_layout"]
    assert fc.codec.method == "exponent" and lay["method"] == "exponent" and fc.compress_host
    assert lay["ratios"]["exponent"] > lay["ratios"]["ibp"]
    assert_same_rows(fc.fetch(ids), dense, ids)
    slab_only = FeatureCache(dense, 0.05, device="cpu", codec="auto", compress_host=False)
    assert slab_only.codec.method == "exponent" and not slab_only.compress_host
    assert_same_rows(slab_only.fetch(ids), dense, ids)
    bow = cora.features[:1000].contiguous()
    fc = FeatureCache(bow, 0.05, device="cpu", codec="auto")
    assert fc.codec.method == "ibp"
    assert_same_rows(fc.fetch(ids), bow, ids)


def test_feature_cache_refuses_a_codec_for_other_rows(minilm: torch.Tensor) -> None:
    x = minilm[OFF: OFF + 300, :64].contiguous()
    codec = exp_codec(x)
    with pytest.raises(RowDtypeError, match="float32"):
        FeatureCache(x.to(torch.bfloat16), 0.1, device="cpu", codec=codec)
    with pytest.raises(RowShapeError, match="shape"):
        FeatureCache(minilm[OFF: OFF + 300, :32].contiguous(), 0.1, device="cpu", codec=codec)
    with pytest.raises(InvalidArgumentError, match="codec differs"):
        FeatureCache(codec.compress(x, pin=False), 0.1, device="cpu", codec=Codec.fit(x))


def test_a_corrupt_exponent_row_is_an_error_not_wrong_rows(minilm: torch.Tensor) -> None:
    """A stored row whose codewords run past its length (a corrupt store) raises FormatError on the CPU path;
    nothing reads past the row."""
    x = minilm[OFF: OFF + 100, :64].contiguous()
    packed = exp_codec(x).compress(x, layout="inplace", pin=False)
    coded = int(torch.nonzero(packed.lengths < packed.row_bytes)[0])
    packed.lengths[coded] = 2  # shorter than its raw fields: cannot decode
    fc = FeatureCache(packed, None, device="cpu")
    with pytest.raises(FormatError, match="corrupt"):
        fc.fetch(torch.tensor([coded]))


# ---- CompressedRows of any codec behind the shared store ---------------------------------------------------------


def test_shared_exponent_store_serves_caches_and_host_stores(minilm: torch.Tensor, store_name: str) -> None:
    x = dense_rows(minilm, torch.bfloat16, n=1000, cols=384)
    seg = exp_codec(x).compress(x, layout="inplace", pin=False).share(store_name)
    try:
        rows = CompressedRows.attach(store_name)
        assert rows.codec.method == "exponent"
        ids = torch.randint(0, 1000, (3000,), generator=torch.Generator().manual_seed(2))
        assert_same_rows(FeatureCache(rows, 0.05, device="cpu").fetch(ids), x, ids)
        store = HostStore.adopt(rows, device=CPU)
        out = torch.empty((ids.numel(), store.row_bytes), dtype=torch.uint8)
        store.read_into(ids, out)
        assert torch.equal(out, x.view(torch.uint8).reshape(1000, -1)[ids])
        assert_same_rows(rows.gather(ids, device="cpu"), x, ids)
    finally:
        seg.unlink()
        seg.close()


def test_fit_candidates_share_one_sample(minilm: torch.Tensor) -> None:
    x = minilm[OFF: OFF + 500, :64].contiguous()
    got = fit_candidates(x, CPU, FitOptions(method="auto", seg=16))
    assert [c.method for c in got] == ["ibp", "exponent"] and got[1].seg == 16
    assert got[0].fitted_rows == got[1].fitted_rows == 500


def test_fit_candidates_offer_short_segments_beside_the_fitted_ones(minilm: torch.Tensor) -> None:
    """seg="auto" fits the segment length of the smallest store; when that is longer than FAST_SEG, the planner also
    gets an exponent codec of FAST_SEG-element segments (faster cache hits), named apart from the first."""
    x = minilm[OFF: OFF + 500, :128].contiguous()  # 512-byte rows: the fitted segments are 64 elements
    got = fit_candidates(x, CPU, FitOptions(method="auto"))
    assert [(c.method, getattr(c, "seg", None)) for c in got] == [("ibp", None), ("exponent", 64),
                                                                  ("exponent", FAST_SEG)]
    assert candidate_names([*got, Codec.raw(torch.float32, (128,))]) == ["ibp", "exponent", "exponent_seg32", "raw"]
    assert len(fit_candidates(x[:, :32].contiguous(), CPU, FitOptions(method="auto"))) == 2  # fitted seg: 32
    assert [getattr(c, "seg", None) for c in fit_candidates(x, CPU, FitOptions(method="auto", seg=64))] == [None, 64]


def test_the_planner_can_choose_the_short_segments_and_a_refit_keeps_them(minilm: torch.Tensor) -> None:
    x = minilm[OFF: OFF + 500, :128].contiguous()
    got = fit_candidates(x, CPU, FitOptions(method="auto"))
    ratios = {"ibp": 1.14, "exponent": 1.19, "exponent_seg32": 1.18}
    misses = {"raw": 1.0, "ibp": 0.97, "exponent": 0.88, "exponent_seg32": 0.87}
    hits = {"raw": 1.0, "ibp": 1.6, "exponent": 1.7, "exponent_seg32": 0.95}  # only the short segments pay at 90%
    choice = decide_codec(ratios, misses, hit_timings_ms=hits)
    assert choice.compress and choice.method == "exponent_seg32", choice.reason
    assert pick_codec([*got, Codec.raw(torch.float32, (128,))], choice) is got[2]
    store = HostStore(x, device=CPU, compress=True, codec=FitOptions(method="auto"))
    store.layout_choice = choice
    refit = store._fit(x)
    assert refit.method == "exponent" and refit.seg == FAST_SEG
    with pytest.raises(InvalidArgumentError, match="two candidates"):
        candidate_names([got[2], got[2], got[2]])  # "exponent", "exponent_seg32", then a second "exponent_seg32"


# ---- GPU: the lookup kernels decode exponent rows ----------------------------------------------------------------


def _gpu_ref(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8).reshape(x.shape[0], -1)[ids.cpu()]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seg", [None, "auto", 16])
@pytest.mark.parametrize("layout", ["inplace", "packed"])
def test_gpu_lookup_rows_exponent_zero_copy_and_slab(minilm: torch.Tensor, dtype: torch.dtype, seg: Any,
                                                     layout: str) -> None:
    """ROWS through the one lookup kernel (static CUDA FeatureCache): slab hits (exponent-coded slab) and misses read
    zero-copy from pinned host rows, decoded by the *_e{2,4} kernels; equal to the source rows bit for bit, and to
    the CPU decoder's output."""
    x = dense_rows(minilm, dtype, n=3000, cols=384)
    codec = exp_codec(x, seg)
    packed = codec.compress(x, layout=layout)
    fc = FeatureCache(packed, 0.1, device="cuda", validate="lazy")
    for ids in id_batches(3000, seed=7):
        got = fc.fetch(ids.cuda())
        assert_same_rows(got, x, ids)
        cpu = packed.gather(ids, device="cpu")
        assert torch.equal(got.cpu().view(torch.uint8), cpu.view(torch.uint8))
    st = fc.stats()
    assert st["hits"] > 0 and st["misses"] > 0 and st["kernel_status"] == 0
    fc.check_errors()


@pytest.mark.gpu
def test_gpu_lookup_rows_wider_than_2kb_and_odd_widths(minilm: torch.Tensor) -> None:
    """Rows past the warp decoder's 2 KB stage (fp32 x 700 = 2800 B: the direct decode) and odd 16-bit widths (no
    4-byte stores) through the lookup kernel, hits and misses."""
    wide = torch.cat([minilm[OFF: OFF + 2000], minilm[OFF: OFF + 2000, :316]], 1).contiguous()  # 700 floats
    odd = minilm[OFF: OFF + 2000, :33].to(torch.float16).contiguous()
    for x in (wide, odd):
        fc = FeatureCache(x, 0.2, device="cuda", codec=exp_codec(x))
        for ids in id_batches(2000, seed=1):
            assert_same_rows(fc.fetch(ids.cuda()), x, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dynamic_cache_exponent_admission_and_descriptors(minilm: torch.Tensor, dtype: torch.dtype,
                                                              policy: str) -> None:
    """Dynamic policies: probe + descriptor decode (exp_decode_desc) of slab hits and host misses, and admissions
    encoded on the GPU into the exponent-coded slab (the slab's bytes equal the CPU encoder's)."""
    x = dense_rows(minilm, dtype, n=2500, cols=256)
    codec = exp_codec(x)
    fc = FeatureCache(x, 0.08, policy=policy, device="cuda", codec=codec)
    for ids in id_batches(2500, seed=2) * 2:
        assert_same_rows(fc.fetch(ids.cuda()), x, ids)
    st = fc.stats()
    assert st["hits"] > 0
    fc.check_errors()
    # the admitted slots hold exactly the CPU encoder's bytes
    slots, ids = fc.policy.resident()
    ids_cpu = ids.cpu()
    rows = x.view(torch.uint8).reshape(2500, -1)[ids_cpu].numpy()
    lens = codec.row_lengths(rows)
    buf = np.zeros(rows.shape[0] * fc.row_bytes, dtype=np.uint8)
    codec.encode_rows_at(rows, buf, np.arange(rows.shape[0]) * fc.row_bytes, lens)
    slab = fc.slot_view[slots].cpu().numpy()
    for k in range(rows.shape[0]):
        n = int(lens[k])
        assert np.array_equal(slab[k, :n], buf[k * fc.row_bytes: k * fc.row_bytes + n])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_cpu_gather_and_host_read_paths(minilm: torch.Tensor, dtype: torch.dtype) -> None:
    """The cpu-gather transfer (stored bytes staged by the CPU, one copy, decode_descriptors on exponent rows) and
    zero-copy HostStore.read_into, equal to the rows."""
    x = dense_rows(minilm, dtype, n=3000, cols=384)
    codec = exp_codec(x)
    for transfer in ("cpu_gather", "zero_copy"):
        fc = FeatureCache(x, 0.05, device="cuda", codec=codec, transfer=transfer)
        for ids in id_batches(3000, seed=4):
            assert_same_rows(fc.fetch(ids), x, ids)  # CPU ids: the cpu-gather path where chosen
        assert fc.stats()["fetch_paths"][transfer] > 0
        store = fc.host
        out = torch.empty((500, store.row_bytes), dtype=torch.uint8, device="cuda")
        ids = torch.randint(0, 3000, (500,), generator=torch.Generator().manual_seed(1))
        store.read_into(ids.cuda() if transfer == "zero_copy" else ids, out)
        assert torch.equal(out.cpu(), _gpu_ref(x, ids))
        store.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage_bytes", [0, 1 << 20])
def test_gpu_pooled_lookup_over_exponent_rows(minilm: torch.Tensor, dtype: torch.dtype, mode: str,
                                              stage_bytes: int) -> None:
    """The embedding bags' fused pooling kernel over an exponent-coded host store (adopted CompressedRows), with
    and without the staged (dedup) path: bit-exact against torch's embedding_bag on the dense table."""
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    w = dense_rows(minilm, dtype, n=4000, cols=128)
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))  # pooling compares values: keep them finite
    rows = exp_codec(w).compress(w, layout="inplace")
    m = CachedEmbeddingBag(4000, 128, _weight=rows, mode=mode, device="cuda", cache_ratio=0.02,
                           stage_bytes=stage_bytes).eval()
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, 4000, (256, 6), generator=gen)
        ids[:, 3] = ids[:, 0]  # duplicate misses in a step: what staging reads once
        with torch.no_grad():
            got = m(ids.cuda())
        want = torch.nn.functional.embedding_bag(ids.cuda(), w.cuda(), mode=mode)
        assert torch.equal(got.cpu().view(torch.uint8), want.cpu().view(torch.uint8))
    m.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_write_back_encodes_like_the_cpu(minilm: torch.Tensor, dtype: torch.dtype) -> None:
    """Training write-back through an exponent-coded host store: the GPU encoder writes the CPU encoder's bytes and
    lengths into the in-place slots."""
    x = dense_rows(minilm, dtype, n=2000, cols=128)
    codec = exp_codec(x)
    store = HostStore(x, codec=codec, compress=True, device=torch.device("cuda"))
    ids = torch.randperm(2000, generator=torch.Generator().manual_seed(8))[:700]
    new = (x[ids].float() * 1.5).to(dtype)
    store.write_rows(ids.cuda(), new.view(torch.uint8).reshape(700, -1).cuda())
    store.sync_host()
    rows = new.view(torch.uint8).reshape(700, -1).numpy()
    lens = codec.row_lengths(rows)
    assert np.array_equal(store.lengths_cpu.numpy()[ids.numpy()], lens)
    data = store.data.numpy().reshape(2000, -1)
    buf = np.zeros(rows.size, dtype=np.uint8)
    codec.encode_rows_at(rows, buf, np.arange(700) * store.row_bytes, lens)
    ref = buf.reshape(700, -1)
    for k, i in enumerate(ids.tolist()):
        assert np.array_equal(data[i, : lens[k]], ref[k, : lens[k]])
    want = x.clone()
    want[ids] = new
    assert torch.equal(store.dense().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_corrupt_row_is_reported_never_read_past(minilm: torch.Tensor) -> None:
    """A coded row whose codewords run past its stored length: the lookup returns zeros for it and the cache raises
    FormatError; the descriptor decode (dynamic policy) reports it through the host store."""
    x = minilm[OFF: OFF + 400, :128].contiguous()
    packed = exp_codec(x).compress(x, layout="inplace")
    coded = int(torch.nonzero(packed.lengths < packed.row_bytes)[0])
    packed.lengths[coded] = 2
    fc = FeatureCache(packed, None, device="cuda", validate="lazy")
    got = fc.fetch(torch.tensor([coded, 0], device="cuda"))
    with pytest.raises(FormatError, match="corrupt"):
        fc.check_errors()
    assert not bool(got[0].any())
    dyn = FeatureCache(packed, 0.1, policy="lru", device="cuda")
    dyn.fetch(torch.tensor([coded, 1], device="cuda"))
    with pytest.raises(FormatError, match="corrupt"):
        dyn.check_errors()


@pytest.mark.gpu
def test_gpu_planner_times_three_candidates(minilm: torch.Tensor, cora: Any) -> None:
    """codec='auto' + compress_host='auto' on CUDA: IBP, exponent (also with 32-element segments where the fitted
    ones are longer) and raw rows are timed (21 lookups each); the choice follows the rule on the recorded medians,
    and fetches stay exact."""
    from ibpcache.cache.plan_layout import REPS, ROUNDS

    for rows in (minilm[OFF: OFF + 20000].contiguous(), cora.features.contiguous()):
        fc = FeatureCache(rows, 0.02, device="cuda", codec="auto", compress_host="auto")
        lay = fc.stats()["host_layout"]
        assert {"ibp", "exponent", "raw"} <= set(lay["timings_ms"]) <= {"ibp", "exponent", "exponent_seg32", "raw"}
        assert lay["samples"] == ROUNDS * REPS
        again = decide_codec(lay["ratios"], lay["timings_ms"], hit_timings_ms=lay["hit_timings_ms"])
        # the rule on the recorded medians, unless the CPU's raw gather then beat the chosen codec (static caches)
        assert lay["method"] == again.method or (lay["method"] == "raw" and "CPU gather" in lay["reason"])
        ids = torch.randint(0, rows.shape[0], (5000,), generator=torch.Generator().manual_seed(6))
        assert_same_rows(fc.fetch(ids.cuda()), rows, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_staged_dedup_path_decodes_exponent_rows(minilm: torch.Tensor, dtype: torch.dtype) -> None:
    """The three-launch staged lookup (CLAIM, STAGE decoding each distinct missed row once into device memory,
    then POOL / ROWS reading staged rows) on exponent-coded host rows, against the one-launch lookup and torch."""
    from ibpcache.kernels.hashmap import IndexArgs, IndexMode
    from ibpcache.kernels.lookup import (ElemType, LookupErrors, PoolOp, RowSource, Staging, lookup_pool,
                                         lookup_rows)

    w = dense_rows(minilm, dtype, n=3000, cols=128)
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    packed = exp_codec(w).compress(w, layout="packed")
    dev = torch.device("cuda")
    tables = packed.codec.kernel_tables(dev)
    meta = packed.device_meta(dev)
    empty = torch.empty(0, dtype=torch.int64, device=dev)
    src = RowSource(IndexArgs(IndexMode.NONE, empty, empty, 0, 0), torch.zeros(8, dtype=torch.int64, device=dev),
                    packed.host_data_for_gpu().data_ptr(), meta["offsets"], packed.row_bytes, meta["lengths"], 3000)
    err = LookupErrors(pin=True)
    staging = Staging.allocate(3000, packed.row_bytes, 64 * packed.row_bytes, dev)  # smaller than a step's misses
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # steps: the generation counter must advance between them
        ids = torch.randint(0, 3000, (400, 4), generator=gen)
        ids[:, 2] = ids[:, 0]
        flat = ids.reshape(-1).cuda()
        out = torch.empty((400, packed.row_bytes), dtype=torch.uint8, device=dev)
        lookup_pool(flat, None, 4, 400, False, PoolOp.SUM, ElemType.of(dtype), None, out, src, tables, None,
                    err.ptr, staging=staging)
        want = torch.nn.functional.embedding_bag(ids.cuda(), w.cuda(), mode="sum")
        assert torch.equal(out.cpu(), want.cpu().view(torch.uint8).reshape(400, -1))
        rows_out = torch.empty((flat.numel(), packed.row_bytes), dtype=torch.uint8, device=dev)
        lookup_rows(flat, rows_out, src, tables, None, err.ptr, staging=staging)
        assert torch.equal(rows_out.cpu(), _gpu_ref(w, flat))
    torch.cuda.synchronize()
    assert err.take() is None


def test_serve_task_publishes_an_exponent_store_clients_read_exactly(minilm: torch.Tensor, store_name: str,
                                                                    tmp_path: Path) -> None:
    """``python -m ibpcache task=serve`` hosts a saved exponent-coded CompressedRows file; two client processes
    attach it and fetch through a FeatureCache and ``gather`` (shm_client.py), bit-exact; SIGTERM removes it."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from ibpcache import _shm

    here = Path(__file__).resolve().parent
    root = here.parents[1]
    x = dense_rows(minilm, torch.float16, n=2500, cols=384)
    path = tmp_path / "dense.ibp"
    exp_codec(x).compress(x, layout="packed", pin=False).save(path)
    ready = tmp_path / "ready.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    host = subprocess.Popen([sys.executable, "-m", "ibpcache", "task=serve", f"+task.stores.{store_name}={path}",
                             f"task.ready_file={ready}"], cwd=tmp_path, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert host.poll() is None, host.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert store_name in json.loads(ready.read_text())["stores"]
        assert CompressedRows.attach(store_name).codec.method == "exponent"
        clients = [subprocess.Popen([sys.executable, str(here / "shm_client.py"), store_name, "fetch", str(s),
                                     str(tmp_path / f"c{s}.npz")], env=env, stderr=subprocess.PIPE) for s in (1, 2)]
        raw = x.view(torch.uint8).reshape(x.shape[0], -1).numpy()
        for s, c in zip((1, 2), clients):
            _, err = c.communicate(timeout=300)
            assert c.returncode == 0, err.decode()[-2000:]
            r = np.load(tmp_path / f"c{s}.npz")
            assert np.array_equal(r["cache"].reshape(-1, raw.shape[1]), raw[r["ids"]])
            assert np.array_equal(r["gather"].reshape(-1, raw.shape[1]), raw[r["ids"]])
        host.send_signal(signal.SIGTERM)
        assert host.wait(timeout=60) == 0, host.stderr.read().decode()[-2000:]
        assert not _shm.segment_path(store_name).exists()
    finally:
        if host.poll() is None:
            host.kill()
        _shm.segment_path(store_name).unlink(missing_ok=True)
