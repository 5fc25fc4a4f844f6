"""The host-layout planner: keep a table's host rows compressed only where this machine reads them faster.

The rule is tested with injected timings (CPU); the embedding bags' default ``compress='auto'`` on real MiniLM
rows (CPU: compressed, there is no transfer to time) and on rows with no shared bits (raw: nothing to save);
on CUDA the calibration times both layouts and the module's outputs stay bit-exact whichever it picks.
"""

from __future__ import annotations

import pytest
import torch

from ibpcache.cache.plan_layout import MARGIN, MIN_RATIO, calibrate_layout, decide_codec, decide_layout


def test_rule_keeps_compression_only_when_measurably_faster() -> None:
    assert decide_layout(1.5, 1.0, 2.0).compress
    assert decide_layout(1.5, 1.0 * (1 - MARGIN), 1.0).compress
    assert not decide_layout(1.5, 0.99, 1.0).compress  # within the margin: raw (never slower than raw)
    assert not decide_layout(1.5, 1.0, 1.0).compress
    slower = decide_layout(1.5, 1.3, 1.0)
    assert not slower.compress and "0.77x" in slower.reason
    assert slower.compressed_ms == 1.3 and slower.raw_ms == 1.0


def test_rule_ratio_floor_and_no_timings() -> None:
    floor = decide_layout(MIN_RATIO - 0.01, 0.1, 10.0)  # nothing to save: raw whatever the timings say
    assert not floor.compress and "nothing to save" in floor.reason
    cpu = decide_layout(1.3, None, None)
    assert cpu.compress and "CPU" in cpu.reason
    assert decide_layout(1.3, None, None).as_dict()["ratio"] == 1.3


def test_calibrate_on_cpu_reports_the_sample_ratio(minilm: torch.Tensor) -> None:
    from ibpcache.codec import Codec

    w = minilm[:4000, :128].contiguous()
    codec = Codec.fit(w)
    choice = calibrate_layout(w, codec, torch.device("cpu"))
    assert choice.compress and choice.compressed_ms is None
    want = w.numel() * 4 / int(codec.compress(w).lengths.sum())
    assert choice.ratio == pytest.approx(want, rel=1e-9)


def _bag(weight: torch.Tensor, device: str, **kw):
    from ibpcache.loaders.embedding_bag import CachedEmbeddingBag

    return CachedEmbeddingBag(weight.shape[0], weight.shape[1], _weight=weight.clone(), device=device,
                              cache_ratio=0.05, mode="sum", **kw)


def _check_exact(m, w: torch.Tensor, device: str) -> None:
    ids = torch.randint(0, w.shape[0], (512, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = m(ids.to(device))
    want = torch.nn.functional.embedding_bag(ids, w, mode="sum")
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_default_is_auto_and_says_why(minilm: torch.Tensor) -> None:
    w = minilm[3000:4000, :128].clone()
    m = _bag(w, "cpu")
    layout = m.stats()["host_layout"]
    assert layout["compress"] and "CPU" in layout["reason"] and layout["ratio"] > 1.05
    assert m.stats()["host_compress"] is True
    _check_exact(m, w, "cpu")


def test_auto_stores_incompressible_rows_raw() -> None:
    """Rows whose bits share nothing (uniform random bit patterns, NaN payloads included) are kept raw."""
    bits = torch.randint(-2**31, 2**31 - 1, (800, 32), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    w = bits.to(torch.int32).view(torch.float32)
    m = _bag(w, "cpu")
    st = m.stats()
    assert st["host_layout"]["compress"] is False and "nothing to save" in st["host_layout"]["reason"]
    assert st["host_compress"] is False and st["host_ratio"] == 1.0
    assert torch.equal(m.weight.view(torch.int32), w.view(torch.int32))


def test_explicit_setting_is_kept_and_reported(minilm: torch.Tensor) -> None:
    w = minilm[:600, :64].clone()
    assert _bag(w, "cpu", compress=False).stats()["host_layout"] == {"compress": False,
                                                                     "reason": "compress=False (set)"}
    with pytest.raises(ValueError, match="compress must be"):
        _bag(w, "cpu", compress="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [32, 128, 384])
def test_gpu_calibration_times_both_layouts_and_stays_exact(minilm: torch.Tensor, cols: int) -> None:
    from ibpcache.codec import Codec

    w = minilm[:, :cols].contiguous()
    codec = Codec.fit(w.cuda())
    choice = calibrate_layout(w, codec, torch.device("cuda"))
    assert choice.compressed_ms is not None and choice.raw_ms is not None
    assert choice.compressed_ms > 0 and choice.raw_ms > 0
    assert set(choice.hit_timings_ms) == set(choice.timings_ms)  # misses and device-memory hits, every candidate
    again = decide_codec(choice.ratios, choice.timings_ms, batch=choice.batch, hit_timings_ms=choice.hit_timings_ms)
    assert choice.compress == again.compress and choice.method == again.method
    m = _bag(w, "cuda")
    layout = m.stats()["host_layout"]
    assert layout["raw_ms"] is not None and m.stats()["host_compress"] == layout["compress"]
    m.eval()
    _check_exact(m, w, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_feature_cache_host_layout_auto(cora, minilm: torch.Tensor, device: str) -> None:
    """FeatureCache takes the same planner (opt-in): exact rows whichever layout it picks; incompressible rows
    stay raw; an explicit setting is reported as set."""
    from ibpcache import FeatureCache

    ids = torch.randint(0, 2000, (3000,), generator=torch.Generator().manual_seed(2))
    for rows in (cora.features[:2000], minilm[:2000, :128].contiguous()):
        cache = FeatureCache(rows, budget_bytes=0.02, device=device, compress_host="auto")
        layout = cache.stats()["host_layout"]
        assert layout["compress"] == cache.compress_host and "reason" in layout
        assert (layout["raw_ms"] is not None) == (device == "cuda")
        assert torch.equal(cache.fetch(ids).cpu().view(torch.uint8), rows[ids].view(torch.uint8))
    noise = torch.randint(-2 ** 31, 2 ** 31 - 1, (500, 16), generator=torch.Generator().manual_seed(3),
                          dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert FeatureCache(noise, budget_bytes=0.05, device=device, compress_host="auto").compress_host is False
    assert FeatureCache(noise, budget_bytes=0.05, device=device).stats()["host_layout"]["reason"] == \
        "compress_host=True (set)"
    with pytest.raises(ValueError, match="compress_host must be"):
        FeatureCache(noise, budget_bytes=0.05, device=device, compress_host="yes")
