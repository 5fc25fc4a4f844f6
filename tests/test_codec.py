"""Codec on the CPU (Numba): lossless round trips, real-data ratio floors, golden bytes, errors, files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ibpcache import Codec, CompressedRows, FormatError, InvalidIdsError, RowDtypeError, RowShapeError
from ibpcache.format import FORMAT_VERSION

GOLDEN = Path(__file__).parent / "golden"


def raw(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(raw(a), raw(b))


# -- ratio floors on real data (issue 2 §3; metadata excluded, as in the paper) ----------------------------
# Cora: the issue quotes 25.8x; on the bundled Planetoid Cora (2708 x 1433) the paper's algorithm gives
# 25.39x with byte-aligned rows, which test_cora_ratio_is_the_models_optimum checks independently.
FLOORS = {
    "cora": 25.38,
    "pubmed": 7.38,
    "minilm": 1.146,
    "kv_chat_k_fp16": 1.04,
    "kv_chat_v_fp16": 1.09,
    "kv_chat_k_bf16": 1.16,
    "kv_chat_v_bf16": 1.31,
    "kv_code_k_fp16": 1.04,
    "kv_code_v_fp16": 1.08,
}


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_real_data_ratio_floor_and_round_trip(real_rows, name: str) -> None:
    x = real_rows(name)
    codec = Codec.fit(x)
    packed = codec.compress(x)
    assert packed.ratio >= FLOORS[name], f"{name}: ratio {packed.ratio:.4f} < floor {FLOORS[name]}"
    assert packed.metadata_nbytes > 0 and packed.nbytes < packed.raw_nbytes
    assert_bit_equal(packed.decompress(), x)


def test_cora_ratio_is_the_models_optimum(real_rows) -> None:
    """An independent NumPy model of the paper's size formula over all (T, chunk) agrees with the fit."""
    x = real_rows("cora")
    rows = raw(x).reshape(x.shape[0], -1).numpy()
    n, rb = rows.shape
    best = None
    for c in (2, 4, 8):
        pad = np.zeros((n, -(-rb // c) * c), np.uint8)
        pad[:, :rb] = rows
        bits = np.unpackbits(pad, axis=1, bitorder="little").reshape(n, -1, 8 * c)
        ones = bits.sum(axis=0)
        for t in np.arange(70, 96):
            masked = np.maximum(ones, n - ones) * 100 >= t * n
            val = (2 * ones > n)
            match = ~np.any(masked[None] & (bits != val[None]), axis=2)
            nbits = bits.shape[1] * (8 * c + 1) - (match * masked.sum(axis=1)[None]).sum(axis=1)
            stored = np.minimum((nbits + 7) // 8, rb).sum()
            best = stored if best is None else min(best, stored)
    fitted = Codec.fit(x).compress(x)
    assert fitted.nbytes == best


def test_sampled_fit_loses_little(real_rows) -> None:
    x = real_rows("minilm")
    full = Codec.fit(x).compress(x).ratio
    sampled = Codec.fit(x, sample=0.1).compress(x)
    assert sampled.ratio >= 0.99 * full
    assert_bit_equal(sampled.decompress(), x)


def test_fit_many_equals_separate_fits(real_rows) -> None:
    """Fitting several codecs together (two syncs on a GPU) chooses exactly what separate fits choose."""
    xs = [real_rows("kv_chat_k_bf16")[:4000], real_rows("kv_code_v_fp16")[:4000], real_rows("cora")[:500]]
    together = Codec.fit_many(xs, chunk_bytes=["auto", 2, "auto"], sample=0.5)
    alone = [Codec.fit(xs[0], sample=0.5), Codec.fit(xs[1], chunk_bytes=2, sample=0.5), Codec.fit(xs[2], sample=0.5)]
    for a, b in zip(together, alone):
        assert a.same_tables(b) and a.chunk_bytes == b.chunk_bytes and a.threshold == b.threshold
        assert a.scores == b.scores and a.dtype == b.dtype
    assert Codec.fit_many([]) == []
    with pytest.raises(ValueError, match="chunk_bytes"):
        Codec.fit_many(xs, chunk_bytes=[2])


# -- golden vectors: the CPU encoder must keep producing these exact bytes -----------------------------
def golden_files() -> list[Path]:
    """The IBP golden vectors (``exp_*.npz`` are the exponent codec's: tests/test_exponent_codec.py)."""
    return sorted(p for p in GOLDEN.glob("*.npz") if not p.name.startswith("exp_"))


def load_golden(path: Path) -> tuple[Codec, torch.Tensor, dict]:
    g = dict(np.load(path))
    dtype = getattr(torch, str(g["dtype"]).replace("torch.", ""))
    shape = tuple(int(s) for s in g["shape"])
    x = torch.from_numpy(g["x"].copy()).view(dtype).reshape(shape)
    codec = Codec(g["mask"], g["bitval"], chunk_bytes=int(g["chunk_bytes"]), row_bytes=g["x"].shape[1], dtype=dtype,
                  row_shape=shape[1:], threshold=float(g["threshold"]))
    return codec, x, g


def test_golden_vectors_exist() -> None:
    assert len(golden_files()) >= 16


@pytest.mark.parametrize("path", golden_files(), ids=lambda p: p.stem)
def test_golden_vectors_cpu(path: Path) -> None:
    codec, x, g = load_golden(path)
    assert int(g["version"]) == FORMAT_VERSION
    layout = "packed" if path.stem.endswith("packed") else "inplace"
    p = codec.compress(x, layout=layout, pin=False)
    assert np.array_equal(p.lengths.numpy(), g["lengths"])
    assert np.array_equal(p.data.numpy(), g["data"])
    assert_bit_equal(p.decompress(), x)


# -- property-based round trips ---------------------------------------------------------------------------
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.int8]
SPECIAL_F32 = [0x7FC00001, 0x7F800001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x807FFFFF,
               0x3F800000, 0x00000000]


@st.composite
def row_tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    itemsize = torch.empty((), dtype=dtype).element_size()
    elems = draw(st.integers(1, 96))
    if draw(st.booleans()):
        elems = draw(st.integers(1, 65536 // itemsize)) if draw(st.integers(0, 20)) == 0 else elems
    n = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["narrow", "random", "sparse", "special"]))
    nbytes = n * elems * itemsize
    if kind == "random":
        b = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    elif kind == "sparse":
        b = (torch.rand(nbytes, generator=g) < 0.05).to(torch.uint8) * torch.randint(0, 256, (nbytes,), generator=g,
                                                                                      dtype=torch.uint8)
    else:
        v = (torch.randn(n * elems, generator=g) * 0.05).to(torch.float32)
        if kind == "special":
            bits = v.view(torch.int32)
            pos = torch.randint(0, v.numel(), (max(1, v.numel() // 4),), generator=g)
            picks = torch.tensor([np.int32(np.uint32(s)) for s in SPECIAL_F32], dtype=torch.int32)
            bits[pos] = picks[torch.randint(0, len(SPECIAL_F32), (pos.numel(),), generator=g)]
        b = v.view(torch.uint8)
        b = b.repeat(-(-nbytes // b.numel()))[:nbytes]
    x = b.clone().view(dtype) if nbytes % itemsize == 0 else b.view(dtype)
    return x.reshape(n, elems)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(x=row_tensors(), c=st.sampled_from([1, 2, 4, 8, "auto"]),
       t=st.sampled_from([0.7, 0.8, 0.95, 1.0, "auto"]), layout=st.sampled_from(["inplace", "packed"]))
def test_round_trip_property(x: torch.Tensor, c, t, layout: str) -> None:
    codec = Codec.fit(x, threshold=t, chunk_bytes=c)
    p = codec.compress(x, layout=layout)
    assert p.nbytes <= p.raw_nbytes
    assert_bit_equal(p.decompress(), x)
    ids = torch.randint(0, x.shape[0], (7,))
    assert_bit_equal(p.gather(ids, device="cpu"), x[ids])


@settings(max_examples=150)
@given(x=row_tensors(), fit_on=row_tensors())
def test_codec_fitted_elsewhere_stays_lossless(x: torch.Tensor, fit_on: torch.Tensor) -> None:
    """Rows that do not match the mask are stored raw, whatever data the mask was fitted on."""
    row_bytes = raw(x).reshape(x.shape[0], -1).shape[1]
    donor = raw(fit_on).reshape(-1)
    donor = donor.repeat(-(-(row_bytes * 4) // donor.numel()))[: row_bytes * 4].reshape(4, row_bytes)
    codec = Codec.fit(donor.view(x.dtype).reshape(4, *x.shape[1:]) if row_bytes % x.element_size() == 0 else donor)
    codec = Codec(codec.mask, codec.bitval, chunk_bytes=codec.chunk_bytes, row_bytes=row_bytes, dtype=x.dtype,
                  row_shape=tuple(x.shape[1:]), threshold=codec.threshold)
    assert_bit_equal(codec.compress(x).decompress(), x)


def test_incompressible_rows_are_stored_raw() -> None:
    x = torch.randint(0, 256, (50, 333), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    p = Codec.fit(x).compress(x)
    assert p.ratio == pytest.approx(1.0, abs=0.02)
    assert_bit_equal(p.decompress(), x)


def test_single_row_and_shapes() -> None:
    x = torch.zeros(1, 3, 5, dtype=torch.float16)
    x[0, 1, 2] = -0.0
    p = Codec.fit(x).compress(x)
    y = p.decompress()
    assert y.shape == (1, 3, 5)
    assert_bit_equal(y, x)
    v = torch.arange(10, dtype=torch.int64)  # 1-D: each element is a row
    assert_bit_equal(Codec.fit(v).compress(v).decompress(), v)


# -- errors -----------------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors() -> None:
    x = torch.zeros(8, 16)
    with pytest.raises(TypeError, match="torch.Tensor"):
        Codec.fit(np.zeros((4, 4)))
    with pytest.raises(ValueError, match="zero rows"):
        Codec.fit(torch.zeros(0, 4))
    with pytest.raises(ValueError, match="chunk_bytes"):
        Codec.fit(x, chunk_bytes=3)
    with pytest.raises(ValueError, match="threshold"):
        Codec.fit(x, threshold=0.3)
    codec = Codec.fit(x)
    with pytest.raises(RowDtypeError, match="dtype"):  # a TypeError
        codec.compress(x.double())
    with pytest.raises(RowShapeError, match="shape"):  # a ValueError
        codec.compress(torch.zeros(8, 17))
    with pytest.raises(ValueError, match="layout"):
        codec.compress(x, layout="zigzag")


def test_bad_ids_raise() -> None:
    x = torch.randn(10, 4)
    p = Codec.fit(x).compress(x)
    with pytest.raises(InvalidIdsError, match="negative"):
        p.gather(torch.tensor([1, -1]), device="cpu")
    with pytest.raises(InvalidIdsError, match="out of range"):
        p.gather(torch.tensor([10]), device="cpu")
    with pytest.raises(InvalidIdsError, match="dtype"):
        p.gather(torch.tensor([1.0]), device="cpu")
    with pytest.raises(InvalidIdsError, match="1-D"):
        p.gather(torch.tensor([[1]]), device="cpu")
    assert p.gather(torch.tensor([], dtype=torch.int64), device="cpu").shape == (0, 4)
    out = torch.empty(2, 4)
    assert p.gather(torch.tensor([3, 3]), device="cpu", out=out) is out
    assert_bit_equal(out, x[[3, 3]])
    with pytest.raises(ValueError, match="out"):
        p.gather(torch.tensor([3]), device="cpu", out=torch.empty(2, 4))


# -- files ------------------------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path: Path, real_rows) -> None:
    x = real_rows("cora")[:300]
    codec = Codec.fit(x)
    codec.save(tmp_path / "c.ibp")
    again = Codec.load(tmp_path / "c.ibp")
    assert again.same_tables(codec) and again.dtype == codec.dtype and again.row_shape == codec.row_shape
    for layout in ("inplace", "packed"):
        p = codec.compress(x, layout=layout)
        p.save(tmp_path / f"r_{layout}.ibp")
        q = CompressedRows.load(tmp_path / f"r_{layout}.ibp")
        assert q.layout == p.layout and q.ratio == p.ratio
        assert_bit_equal(q.decompress(), x)


def test_files_of_the_previous_release_still_load(cora) -> None:
    """Files written before codecs recorded their method (tests/golden/v1_files, written by that release's code)
    load as IBP and decode bit-exactly."""
    x = cora.features[:40]
    codec = Codec.load(GOLDEN / "v1_files" / "cora40_ibp.codec")
    assert codec.method == "ibp" and codec.same_tables(Codec.fit(x))
    rows = CompressedRows.load(GOLDEN / "v1_files" / "cora40_ibp_packed.rows", pin=False)
    assert rows.codec.same_tables(codec) and rows.layout.value == "packed"
    assert_bit_equal(rows.decompress(), x)
    assert torch.equal(rows.data, codec.compress(x, layout="packed", pin=False).data)


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "empty"])
def test_corrupt_files_raise(tmp_path: Path, damage: str) -> None:
    x = torch.randn(20, 8)
    path = tmp_path / "r.ibp"
    Codec.fit(x).compress(x).save(path)
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x10
    elif damage == "truncate":
        blob = blob[: len(blob) - 9]
    elif damage == "magic":
        blob[0] ^= 0xFF
    else:
        blob = bytearray()
    path.write_bytes(bytes(blob))
    with pytest.raises(FormatError):
        CompressedRows.load(path)
    with pytest.raises(FormatError):
        Codec.load(path)
