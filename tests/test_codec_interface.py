"""One codec interface: ``Codec.fit(x, method=...)`` returns an IBPCodec, ExponentCodec or RawCodec with the same
contract (compress -> CompressedRows; gather, decompress, save/load, share/attach; the host row functions stores
use; sizes and metadata), checked on real data for every method: Cora (sparse float32), MiniLM (float32 and its
bfloat16 / float16 casts) and SmolLM2 KV rows."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ibpcache import Codec, CompressedRows, ExponentCodec, FormatError, IBPCodec, RawCodec

KINDS = {"ibp": IBPCodec, "exponent": ExponentCodec, "raw": RawCodec}

TABLES = {
    "cora": lambda rows: rows("cora")[:600],
    "minilm_f32": lambda rows: rows("minilm")[:1500],
    "minilm_bf16": lambda rows: rows("minilm")[:1500].to(torch.bfloat16),
    "minilm_f16": lambda rows: rows("minilm")[:1500].to(torch.float16),
    "kv_chat_k_bf16": lambda rows: rows("kv_chat_k_bf16")[:3000],
    "kv_code_v_fp16": lambda rows: rows("kv_code_v_fp16")[:3000],
    "kv_chat_v_fp32": lambda rows: rows("kv_chat_v_fp32")[:3000],
}


def _u8(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_u8(a), _u8(b))


def _container_header(path: Path) -> dict:
    blob = path.read_bytes()
    json_len = struct.unpack_from("<Q", blob, 16)[0]
    return json.loads(blob[24: 24 + json_len])


@pytest.mark.parametrize("method", sorted(KINDS))
@pytest.mark.parametrize("table", sorted(TABLES))
def test_contract(real_rows: Any, table: str, method: str, tmp_path: Path) -> None:
    x = TABLES[table](real_rows)
    codec = Codec.fit(x, method=method)
    assert type(codec) is KINDS[method] and isinstance(codec, Codec) and codec.method == method
    assert (codec.dtype, codec.row_shape, codec.row_bytes) == (x.dtype, tuple(x.shape[1:]), _u8(x).shape[1])
    lengths = codec.stored_lengths(x)
    assert lengths.dtype == torch.int32 and int(lengths.min()) >= 1 and int(lengths.max()) <= codec.row_bytes
    if method == "raw":
        assert codec.metadata_nbytes == 0 and bool((lengths == codec.row_bytes).all())
    ids = torch.randint(0, x.shape[0], (700,), generator=torch.Generator().manual_seed(1))
    for layout in ("inplace", "packed"):
        p = codec.compress(x, layout=layout, pin=False)
        n = p.n_rows
        assert torch.equal(p.lengths, lengths) and p.nbytes == int(lengths.sum())
        assert p.ratio == pytest.approx(p.raw_nbytes / p.nbytes)
        assert torch.equal(p.is_compressed(), (lengths < codec.row_bytes).to(torch.uint8))
        extra = 8 * n if layout == "packed" else 0
        assert p.metadata_nbytes == codec.metadata_nbytes + (n + 7) // 8 + 4 * n + extra
        assert p.stored_ratio == pytest.approx(p.raw_nbytes / (p.nbytes + p.metadata_nbytes))
        assert p.host_nbytes == (n * codec.row_bytes if layout == "inplace" else p.nbytes)
        assert _same(p.decompress(), x)
        assert _same(p.gather(ids, device="cpu"), x[ids])
        path = tmp_path / f"{table}_{method}_{layout}.rows"
        p.save(path)
        assert _container_header(path)["codec"]["method"] == method  # the file says which codec
        q = CompressedRows.load(path, pin=False)
        assert type(q.codec) is KINDS[method] and q.codec.same_tables(codec) and q.layout == p.layout
        assert torch.equal(q.data, p.data) and _same(q.gather(ids, device="cpu"), x[ids])
    codec.save(tmp_path / "codec.ibpc")
    again = Codec.load(tmp_path / "codec.ibpc")
    assert type(again) is KINDS[method] and again.same_tables(codec) and again.header() == codec.header()


@pytest.mark.parametrize("method", sorted(KINDS))
def test_host_row_functions_place_rows_anywhere(real_rows: Any, method: str) -> None:
    """What the stores use: lengths first, rows encoded at arbitrary offsets of a shared buffer, any subset decoded
    into any output rows."""
    x = real_rows("minilm")[:300].to(torch.bfloat16)
    codec = Codec.fit(x, method=method)
    rows = _u8(x).numpy()
    lengths = codec.row_lengths(rows)
    gaps = np.random.default_rng(2).integers(0, 9, rows.shape[0])
    offsets = np.cumsum(np.concatenate([[5], (lengths + gaps)[:-1]])).astype(np.int64)
    buf = np.zeros(int(offsets[-1] + lengths[-1] + 16), dtype=np.uint8)
    assert np.array_equal(codec.encode_rows_at(rows, buf, offsets, lengths), lengths)
    pick = np.random.default_rng(3).permutation(rows.shape[0])[:120]
    out = np.zeros((200, rows.shape[1]), dtype=np.uint8)
    dest = np.random.default_rng(4).permutation(200)[:120]
    codec.decode_rows_at(buf, offsets[pick], lengths[pick], out, dest)
    assert np.array_equal(out[dest], rows[pick])


@pytest.mark.parametrize("method", sorted(KINDS))
def test_share_and_attach(real_rows: Any, method: str, store_name: str) -> None:
    from ibpcache import _shm

    x = real_rows("kv_chat_k_fp32")[:2000]
    p = Codec.fit(x, method=method).compress(x, layout="packed", pin=False)
    seg = p.share(store_name)
    try:
        assert seg.manifest["codec"]["method"] == method
        att = CompressedRows.attach(store_name, verify=True)
        assert type(att.codec) is KINDS[method] and att.codec.same_tables(p.codec)
        ids = torch.randint(0, 2000, (500,), generator=torch.Generator().manual_seed(5))
        assert _same(att.gather(ids, device="cpu"), x[ids])
        assert att.nbytes == p.nbytes and att.metadata_nbytes == p.metadata_nbytes
        att.shared.close()
    finally:
        seg.unlink()
        seg.close()
    assert not _shm.segment_path(store_name).exists()


def test_auto_picks_the_smallest_store(real_rows: Any) -> None:
    """method="auto" compares stored bytes, tables included: IBP on sparse rows (Cora keeps its 25.39x), exponent
    coding on dense floats of every width, raw where nothing saves."""
    cora = real_rows("cora")
    auto = Codec.fit(cora, method="auto")
    assert auto.method == "ibp" and auto.compress(cora, pin=False).ratio >= 25.38
    minilm = real_rows("minilm")[:3000]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert Codec.fit(minilm.to(dtype), method="auto").method == "exponent"
    noise = torch.randint(0, 256, (200, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    assert Codec.fit(noise, method="auto").method == "raw"
    sampled = Codec.fit(minilm, method="auto", sample=0.1)
    assert sampled.method == "exponent" and 0 < sampled.fitted_rows <= 300


def test_codec_constructor_still_builds_ibp_codecs(real_rows: Any) -> None:
    """``Codec(mask, bitval, ...)`` (scripts and tests build IBP codecs from stored tables) gives an IBPCodec."""
    x = real_rows("cora")[:100]
    fitted = Codec.fit(x)
    rebuilt = Codec(fitted.mask, fitted.bitval, chunk_bytes=fitted.chunk_bytes, row_bytes=fitted.row_bytes,
                    dtype=x.dtype, row_shape=fitted.row_shape, threshold=fitted.threshold)
    assert type(rebuilt) is IBPCodec and rebuilt.same_tables(fitted)
    assert torch.equal(rebuilt.compress(x, pin=False).data, fitted.compress(x, pin=False).data)
    raw = Codec.raw(torch.float16, (3, 5))
    assert type(raw) is RawCodec and raw.row_bytes == 30 and int(raw.mask.sum()) == 0
    assert Codec.kind("exponent") is ExponentCodec


def test_malformed_codec_headers_raise(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="unknown codec method 'zstd'"):
        Codec.from_header({"method": "zstd"})
    with pytest.raises(FormatError, match="section"):
        Codec.from_header({"method": "exponent", "dtype": "bfloat16", "row_shape": [4]})
    with pytest.raises(FormatError, match="bad exponent codec header"):
        Codec.from_header({"method": "exponent"}, np.full(256, 8, dtype=np.uint8))
    with pytest.raises(FormatError, match="row_bytes"):
        Codec.from_header({"method": "raw", "dtype": "float32", "row_shape": [4], "row_bytes": 12})


@pytest.mark.gpu
@pytest.mark.parametrize("method", sorted(KINDS))
@pytest.mark.parametrize("table", ["minilm_f32", "minilm_bf16", "kv_code_v_fp16", "cora"])
def test_contract_on_the_gpu(real_rows: Any, table: str, method: str) -> None:
    """The GPU paths of the same contract: compress on the GPU writes the CPU's bytes; gather reads them zero-copy
    from pinned memory."""
    x = TABLES[table](real_rows)
    codec = Codec.fit(x, method=method)
    assert torch.equal(codec.stored_lengths(x.cuda()).cpu(), codec.stored_lengths(x))
    ids = torch.randint(0, x.shape[0], (999,), generator=torch.Generator().manual_seed(7))
    for layout in ("inplace", "packed"):
        gpu = codec.compress(x.cuda(), layout=layout)
        cpu = codec.compress(x, layout=layout, pin=False)
        assert torch.equal(gpu.lengths, cpu.lengths) and torch.equal(gpu.data, cpu.data)
        assert _same(gpu.gather(ids, device="cuda").cpu(), x[ids])
        assert _same(gpu.decompress(device="cuda").cpu(), x)


def test_codec_module_imports_nothing_of_compressed_rows() -> None:
    """codec.py <- compressed.py, one way (Codec.compress runs what compressed.py installs): no import of it in
    codec.py or exponent.py, lazy or under TYPE_CHECKING."""
    from test_import_arrows import PKG, _imports

    for name in ("codec.py", "exponent.py"):
        mods = [m for _, m in _imports(PKG / name)]
        assert not [m for m in mods if m.startswith("ibpcache.compressed")], f"{name} imports {mods}"
