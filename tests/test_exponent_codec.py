"""The exponent codec (bf16/fp16): lossless for every bit pattern, rows decodable one by one, save/load, and the
``Codec.fit(method=...)`` routing. Real SmolLM2 KV (bf16 target: >= 1.4x, where IBP alone reaches K 1.17x /
V 1.32x) plus property-based inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpcache import Codec
from ibpcache.errors import FormatError
from ibpcache.exponent import MAX_CODE_BITS, ExponentCodec, canonical_codes, limited_lengths


def _u16(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def _roundtrip(codec: ExponentCodec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data, lengths, offsets = codec.encode(x)
    back = codec.decode(data, lengths, offsets)
    assert torch.equal(_u16(back), _u16(x)), "exponent codec round trip is not bit-exact"
    return data, lengths, offsets


@pytest.mark.parametrize("name,which,dtype,floor", [("chat", "k", "bf16", 1.40), ("chat", "v", "bf16", 1.40),
                                                    ("code", "k", "fp16", 1.10), ("code", "v", "fp16", 1.10)])
def test_real_kv_round_trip_and_ratio(real_rows: Any, name: str, which: str, dtype: str, floor: float) -> None:
    """Per-layer codes, as the KV manager fits them; the ratio counts every stored byte (metadata apart)."""
    rows = real_rows(f"kv_{name}_{which}_{dtype}")
    layers = rows.view(30, -1, rows.shape[1])
    raw = stored = 0
    for layer in layers:
        codec = ExponentCodec.fit(layer)
        _, lengths, _ = _roundtrip(codec, layer)
        raw += layer.numel() * 2
        stored += int(lengths.sum())
    assert raw / stored >= floor, f"{name} {which} {dtype}: {raw / stored:.3f}x"


def test_bf16_beats_ibp_on_real_kv(real_rows: Any) -> None:
    rows = real_rows("kv_chat_v_bf16")
    exp = int(ExponentCodec.fit(rows).stored_lengths(rows).sum())
    ibp = int(Codec.fit(rows).stored_lengths(rows).sum())
    assert exp < ibp


_patterns = st.integers(min_value=0, max_value=0xFFFF)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       n=st.integers(min_value=1, max_value=9), d=st.integers(min_value=1, max_value=37))
def test_any_bit_pattern_round_trips(data: Any, dtype: torch.dtype, n: int, d: int) -> None:
    """Fitted on other rows (so exponents unseen at fit time occur): still exact, NaN payloads included."""
    fit_bits = data.draw(st.lists(_patterns, min_size=d, max_size=4 * d))
    fit = torch.tensor(fit_bits[: (len(fit_bits) // d) * d], dtype=torch.int32).to(torch.int16).view(dtype)
    codec = ExponentCodec.fit(fit.view(-1, d))
    bits = data.draw(st.lists(_patterns, min_size=n * d, max_size=n * d))
    x = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(dtype).view(n, d)
    _, lengths, _ = _roundtrip(codec, x)
    assert int(lengths.max()) <= codec.row_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_special_values_and_raw_fallback(dtype: torch.dtype) -> None:
    tiny = torch.finfo(dtype).tiny
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), tiny / 4, -tiny / 8, tiny, 1.0, -2.5],
                           dtype=torch.float32).to(dtype)
    nan_payloads = torch.tensor([0x7FC1, 0xFFFF, 0x7F81, 0xFE01] if dtype == torch.bfloat16 else
                                [0x7E01, 0xFFFF, 0x7C01, 0xFC11], dtype=torch.int32).to(torch.int16).view(dtype)
    row = torch.cat([special, nan_payloads])
    normal = (torch.randn(500, row.numel(), generator=torch.Generator().manual_seed(0)) * 0.1).to(dtype)
    codec = ExponentCodec.fit(normal)
    x = torch.cat([normal[:5], row.unsqueeze(0)])
    _, lengths, _ = _roundtrip(codec, x)
    assert (lengths[:5] < codec.row_bytes).all()
    # rows whose exponents are all rare cost more than raw: stored raw, flagged by length == row_bytes
    rare = torch.full((3, row.numel()), 0x7F00 if dtype == torch.bfloat16 else 0x7800,
                      dtype=torch.int32).to(torch.int16).view(dtype)
    _, lengths, _ = _roundtrip(codec, rare)
    assert (lengths == codec.row_bytes).all()


def test_rows_decode_one_by_one(real_rows: Any) -> None:
    rows = real_rows("kv_chat_k_bf16")[:3000]
    codec = ExponentCodec.fit(rows)
    data, lengths, offsets = codec.encode(rows)
    pick = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(1))[:257]
    got = codec.decode(data, lengths[pick], offsets[pick])
    assert torch.equal(_u16(got), _u16(rows[pick]))


def test_codes_are_canonical_prefix_codes_within_the_limit() -> None:
    counts = np.array([2 ** k for k in range(40)] + [1] * 216, dtype=np.int64)
    lengths = limited_lengths(counts, 12)
    assert lengths.max() <= 12 and lengths.min() >= 1
    assert np.sum(2.0 ** -lengths.astype(float)) <= 1.0
    codes = canonical_codes(lengths)
    words = {format(int(c), f"0{int(ln)}b") for c, ln in zip(codes, lengths)}
    assert len(words) == counts.size
    assert not any(a != b and b.startswith(a) for a in words for b in words)  # prefix-free


def test_save_load_and_corruption(tmp_path: Path, real_rows: Any) -> None:
    rows = real_rows("kv_chat_v_bf16")[:2000]
    codec = ExponentCodec.fit(rows)
    path = tmp_path / "exp.ibpc"
    codec.save(path)
    for loaded in (ExponentCodec.load(path), Codec.load(path)):
        assert isinstance(loaded, ExponentCodec)
        assert np.array_equal(loaded.code_lengths, codec.code_lengths)
        assert torch.equal(loaded.encode(rows)[0], codec.encode(rows)[0])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    (tmp_path / "bad.ibpc").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="checksum"):
        Codec.load(tmp_path / "bad.ibpc")
    ibp = Codec.fit(rows)
    ibp.save(tmp_path / "ibp.ibpc")
    with pytest.raises(FormatError, match="not an exponent codec"):
        ExponentCodec.load(tmp_path / "ibp.ibpc")
    assert isinstance(Codec.load(tmp_path / "ibp.ibpc"), Codec)


def test_corrupt_row_bytes_never_crash(real_rows: Any) -> None:
    rows = real_rows("kv_chat_k_bf16")[:200]
    codec = ExponentCodec.fit(rows)
    data, lengths, offsets = codec.encode(rows)
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        bad = data.clone()
        pos = torch.randint(0, bad.numel(), (8,), generator=gen)
        bad[pos] ^= 0xA5
        try:
            codec.decode(bad, lengths, offsets)  # wrong values are possible (no per-row checksum) ...
        except FormatError:
            pass  # ... or a clear error; never a crash or an out-of-bounds read
    with pytest.raises(FormatError, match="outside the stored bytes"):
        codec.decode(data, lengths, offsets + 10 ** 9)


def test_fit_method_routing(real_rows: Any, cora: Any) -> None:
    kv = real_rows("kv_chat_k_bf16")[:4000]
    assert isinstance(Codec.fit(kv, method="exponent"), ExponentCodec)
    assert isinstance(Codec.fit(kv, method="auto"), ExponentCodec)  # smallest on bf16 KV
    assert isinstance(Codec.fit(kv), Codec)  # the default is unchanged: IBP
    feats = cora.features[:1000]
    auto = Codec.fit(feats, method="auto")
    assert isinstance(auto, Codec) and int(auto.mask.sum()) > 0  # float32 bag-of-words: IBP
    noise = torch.randint(-2 ** 31, 2 ** 31 - 1, (300, 16), generator=torch.Generator().manual_seed(3),
                          dtype=torch.int64).to(torch.int32).view(torch.float32)  # uniform bits: nothing shared
    raw = Codec.fit(noise, method="auto")
    assert isinstance(raw, Codec) and int(raw.mask.sum()) == 0
    assert int(Codec.fit(kv, method="raw").mask.sum()) == 0
    with pytest.raises(ValueError, match="method must be"):
        Codec.fit(kv, method="zstd")
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        Codec.fit(feats, method="exponent")
    with pytest.raises(TypeError, match="exponent codec has no stores"):
        from ibpcache import CompressedRows

        CompressedRows(ExponentCodec.fit(kv), *ExponentCodec.fit(kv).encode(kv)[:2], layout="packed")
    assert MAX_CODE_BITS == 15


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kv_chat_k_bf16", "kv_chat_v_bf16", "kv_code_k_fp16", "kv_code_v_fp16"])
def test_gpu_bytes_equal_cpu_bytes(real_rows: Any, name: str) -> None:
    rows = real_rows(name)
    codec = ExponentCodec.fit(rows)
    data, lengths, offsets = codec.encode(rows)
    g_data, g_len, g_off = codec.encode_gpu(rows.cuda())
    assert torch.equal(g_len.cpu(), lengths) and torch.equal(g_off.cpu(), offsets)
    assert torch.equal(g_data.cpu(), data), "GPU encode bytes differ from the CPU encoder's"
    from_device = codec.decode_gpu(g_data, g_len, g_off)
    pinned = data.pin_memory()
    pick = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(5))[:999]
    from_host = codec.decode_gpu(pinned, lengths[pick].cuda(), offsets[pick].cuda())  # zero-copy reads
    assert torch.equal(_u16(from_device.cpu()), _u16(rows))
    assert torch.equal(_u16(from_host.cpu()), _u16(rows[pick]))


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       n=st.integers(min_value=1, max_value=40), d=st.integers(min_value=1, max_value=37))
def test_gpu_any_bit_pattern(data: Any, dtype: torch.dtype, n: int, d: int) -> None:
    fit = (torch.randn(64, d, generator=torch.Generator().manual_seed(d)) * 0.05).to(dtype)
    codec = ExponentCodec.fit(fit)
    bits = data.draw(st.lists(_patterns, min_size=n * d, max_size=n * d))
    x = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(dtype).view(n, d)
    x = torch.cat([x, fit[:5]])
    cpu = codec.encode(x)
    gpu = codec.encode_gpu(x.cuda())
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())
    assert torch.equal(_u16(codec.decode_gpu(*gpu).cpu()), _u16(x))


@pytest.mark.gpu
def test_gpu_overrun_is_a_clear_error(real_rows: Any) -> None:
    rows = real_rows("kv_chat_k_bf16")[:100]
    codec = ExponentCodec.fit(rows)
    data, lengths, offsets = codec.encode_gpu(rows.cuda())
    short = torch.where(lengths < codec.row_bytes, lengths // 2, lengths)  # streams cut in half
    with pytest.raises(FormatError, match="no codeword ends inside the row"):
        codec.decode_gpu(data, short, offsets)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 129, 300])  # staged (<= 256 bytes per row) and direct decode paths
def test_gpu_row_sizes_around_the_staging_limit(real_rows: Any, d: int) -> None:
    rows = real_rows("kv_chat_v_bf16")[: 64 * 300].reshape(-1)[: 300 * d].view(300, d)
    codec = ExponentCodec.fit(rows)
    for src in (codec.encode_gpu(rows.cuda()), tuple(t.cuda() if i else t.pin_memory()
                                                        for i, t in enumerate(codec.encode(rows)))):
        assert torch.equal(_u16(codec.decode_gpu(*src).cpu()), _u16(rows))


@pytest.mark.gpu
@pytest.mark.parametrize("shift", [0, 1, 2, 3])
def test_gpu_staged_rows_at_every_alignment(real_rows: Any, shift: int) -> None:
    """The staged decode reads rows with aligned 4-byte words and realigns them in registers: real rows (~170 bytes)
    mixed with random bit patterns stored raw (256 bytes: the most words a lane loads), at every start alignment
    of the buffer, from device memory and zero-copy from pinned host memory."""
    real = real_rows("kv_chat_k_bf16")[:600]
    codec = ExponentCodec.fit(real)
    noise = torch.randint(-(2 ** 15), 2 ** 15, (200, real.shape[1]), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(shift)).to(torch.int16).view(torch.bfloat16)
    rows = torch.cat([real, noise])[torch.randperm(800, generator=torch.Generator().manual_seed(9))]
    data, lengths, offsets = codec.encode(rows)
    assert int(lengths.max()) == codec.row_bytes and int(lengths.min()) < codec.row_bytes
    moved = torch.zeros(data.numel() + shift, dtype=torch.uint8)
    moved[shift:] = data
    pick = torch.randperm(800, generator=torch.Generator().manual_seed(shift))[:777]  # not a multiple of 32
    for buf in (moved.cuda(), moved.pin_memory()):
        out = codec.decode_gpu(buf, lengths[pick].cuda(), (offsets[pick] + shift).cuda())
        assert torch.equal(_u16(out.cpu()), _u16(rows[pick])), f"rows misdecoded at alignment {shift}"
