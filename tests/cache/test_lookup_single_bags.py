"""One-id bags of the IBP and raw kinds, several per warp (``ibp_lookup_pool_single_c*``, lookup.cu's
``ibp_lookup_single_bags``): a group of raw 16-byte-aligned rows is read word by word with many loads in flight and
pooled from registers; a group holding a compressed or unaligned row is decoded row by row through the row buffer.

GPU (``-m gpu``): the one-id kernel writes the bytes the bag loop writes for the same bags given as offsets, and
torch's embedding_bag's; bad ids give zero rows and are reported, their group's neighbours exact; counters and freq
count the pooled rows; slot hits, staging-slab hits, host misses (zero-copy and staged) in one launch; groups of 4 to
32 bags (128 B to 2 KB rows, fp32 / fp16 / bf16), rows no multiple of 16 bytes, packed (unaligned) host rows, IBP
rows of Cora (mostly coded) mixed with raw ones. The ROWS kernels (one row per warp; several, which raw stores
take) fetch the source rows. CPU: the cases plant what the GPU tests need. Real data: MiniLM rows and Cora's features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pytest
import torch

from cache_helpers import pool_one_id_bags_both_ways

from ibpcache import Codec, RawCodec

N_ROWS = 3000
OFF = 4000  # MiniLM's first rows are special tokens; real words start later

# (data, dtype, columns, codec method, host layout): G = max(4, min(32, 256 / (row_bytes / 16))) bags per warp
CASES = [
    ("minilm", torch.float32, 128, "raw", "inplace"),  # 512 B: G 8, one round of words
    ("minilm", torch.float16, 384, "raw", "inplace"),  # 768 B: G 5 (no power of two)
    ("minilm", torch.float32, 384, "raw", "inplace"),  # 1536 B: G 4, 3 rounds
    ("minilm", torch.bfloat16, 64, "raw", "inplace"),  # 128 B: G 32
    ("minilm", torch.float32, 25, "raw", "inplace"),  # 100 B: no 16-byte multiple, row by row
    ("minilm", torch.float16, 128, "raw", "packed"),  # 256 B rows at 16-byte starts, hits slab-aligned
    ("minilm", torch.float32, 128, "ibp", "inplace"),  # coded and raw rows mixed
    ("cora", torch.float32, 500, "ibp", "packed"),  # sparse rows, mostly coded, packed host store
]
IDS = [f"{n}-{str(dt).replace('torch.', '')}-d{c}-{m}-{lay}" for n, dt, c, m, lay in CASES]


@dataclass
class Case:
    rows: torch.Tensor  # [N_ROWS, d], the source rows
    codec: Any
    data: np.ndarray  # the host store's bytes
    offsets: np.ndarray  # int64 byte offset of each row in data
    lengths: np.ndarray  # int32 stored length of each row


def single_bags(row_bytes: int) -> int:
    """lookup.cu's ibp_single_bags: bags per warp of the one-id kernels."""
    n16 = -(-row_bytes // 16)
    return max(4, min(32, 32 * 8 // n16))


def make_case(real_rows: Any, name: str, dtype: torch.dtype, cols: int, method: str, layout: str) -> Case:
    """Real rows cast to ``dtype`` (finite), stored by the codec in place (16-byte row stride) or packed (rows back
    to back: raw rows land at unaligned starts)."""
    src = real_rows(name)
    src = src.features if hasattr(src, "features") else src
    x = src[OFF: OFF + N_ROWS, :cols] if name == "minilm" else src[:N_ROWS, :cols]
    x = x.repeat(-(-N_ROWS // x.shape[0]), 1)[:N_ROWS].to(dtype).contiguous()  # Cora has 2708 rows
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    codec = RawCodec(dtype, (cols,)) if method == "raw" else Codec.fit(x, method="ibp")
    rb = codec.row_bytes
    rows_u8 = x.view(torch.uint8).reshape(N_ROWS, rb).numpy()
    lengths = codec.row_lengths(rows_u8)
    if layout == "inplace":
        offsets = np.arange(N_ROWS, dtype=np.int64) * ((rb + 15) // 16 * 16)
    else:
        offsets = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) + 3  # start off 16-byte lines
    data = np.zeros(int(offsets[-1]) + rb + 16, dtype=np.uint8)
    codec.encode_rows_at(rows_u8, data, offsets, lengths)
    return Case(x, codec, data, offsets, np.asarray(lengths, dtype=np.int32))


@dataclass
class Engine:
    src: Any
    tables: Any
    hit: np.ndarray  # bool [N_ROWS]: served from a slab
    keep: list  # tensors the kernels read


def make_engine(case: Case) -> Engine:
    """Slot hits (every third row, 16-byte slot stride), staging-slab hits (slab 1, row_bytes apart) and host misses
    of the case's store, indexed by a slot table (the embedding bags' inference cache)."""
    from ibpcache.kernels.hashmap import IndexArgs
    from ibpcache.kernels.lookup import SLOT_TABLE_INDEX, RowSource

    dev = torch.device("cuda")
    rb = case.codec.row_bytes
    slot_rows = np.arange(0, N_ROWS, 3)
    slab1_rows = np.arange(1, N_ROWS, 7)
    slab1_rows = slab1_rows[slab1_rows % 3 != 0]
    stride = (rb + 15) // 16 * 16
    slab0 = np.zeros(len(slot_rows) * stride + 16, dtype=np.uint8)
    slab1 = np.zeros(len(slab1_rows) * rb + 16, dtype=np.uint8)
    slot_of = np.full(N_ROWS, -1, dtype=np.int32)
    slot_len = np.zeros(len(slot_rows) + len(slab1_rows), dtype=np.int32)
    for where, (slab, rows, step) in enumerate(((slab0, slot_rows, stride), (slab1, slab1_rows, rb))):
        for v, row in enumerate(rows):
            n, o = int(case.lengths[row]), int(case.offsets[row])
            slab[v * step: v * step + n] = case.data[o: o + n]
            slot_of[row] = v if where == 0 else -2 - v
            slot_len[v if where == 0 else len(slot_rows) + v] = n
    slab0_d, slab1_d = torch.from_numpy(slab0).to(dev), torch.from_numpy(slab1).to(dev)
    bases = torch.zeros(8, dtype=torch.int64)
    bases[0], bases[1] = slab0_d.data_ptr(), slab1_d.data_ptr()
    host = torch.from_numpy(case.data).pin_memory()
    keys = torch.from_numpy(slot_len).to(dev)
    values = torch.from_numpy(slot_of).to(dev)
    host_len = torch.from_numpy(case.lengths).to(dev)
    host_off = torch.from_numpy(case.offsets).to(dev)
    src = RowSource(IndexArgs(SLOT_TABLE_INDEX, keys, values, len(slot_rows), stride), bases.to(dev),
                    host.data_ptr(), host_off, rb, host_len, N_ROWS)
    return Engine(src, case.codec.kernel_tables(dev), slot_of != -1,
                  [slab0_d, slab1_d, host, keys, values, host_len, host_off])


def _ids(n: int, seed: int) -> torch.Tensor:
    """Random rows with repeats and four bad ids (-1, N_ROWS, ...) inside the first groups."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, N_ROWS, (n,), generator=g)
    ids[torch.tensor([1, 6, 40, 77])] = torch.tensor([-1, N_ROWS, -7, N_ROWS + 3])
    return ids


def _expected_counters(case: Case, eng: Engine, rows: np.ndarray, staged_all: bool) -> list[int]:
    """requests, hits, host bytes, slab bytes of the pooled rows; staged: each distinct miss read once."""
    hit = eng.hit[rows]
    host_rows = rows[~hit]
    lengths = case.lengths.astype(np.int64)
    host = int(lengths[np.unique(host_rows)].sum()) if staged_all else int(lengths[host_rows].sum())
    return [rows.size, int(hit.sum()), host, int(lengths[rows[hit]].sum())]


def _staging(kind: str, row_bytes: int) -> Optional[Any]:
    from ibpcache.kernels.lookup import Staging

    if kind == "none":
        return None
    return Staging.allocate(N_ROWS, row_bytes, N_ROWS * row_bytes, torch.device("cuda"))


# ---- CPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype,cols,method,layout", CASES, ids=IDS)
def test_cases_plant_what_the_gpu_tests_need(real_rows: Any, name: str, dtype: torch.dtype, cols: int, method: str,
                                             layout: str) -> None:
    """Each case's host store decodes to its rows on the CPU; IBP cases hold coded rows (the row-by-row path),
    raw in-place cases 16-byte-aligned rows (the word path); packed raw rows start off 16-byte lines."""
    case = make_case(real_rows, name, dtype, cols, method, layout)
    rb = case.codec.row_bytes
    out = np.zeros((N_ROWS, rb), dtype=np.uint8)
    case.codec.decode_rows_at(case.data, case.offsets, case.lengths, out, np.arange(N_ROWS))
    assert np.array_equal(out, case.rows.view(torch.uint8).reshape(N_ROWS, rb).numpy())
    coded = case.lengths < rb
    if method == "ibp":
        assert coded.any()
    else:
        assert not coded.any()
        aligned = (case.offsets % 16 == 0) & (rb % 16 == 0)
        assert aligned.all() == (layout == "inplace" and rb % 16 == 0)
    assert 4 <= single_bags(rb) <= 32


def test_single_bags_twin_reads_the_kernels_formula() -> None:
    """single_bags mirrors ibp_single_bags (lookup.cu): same unroll, bounds and words per row."""
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "ibpcache" / "kernels" / "lookup.cu").read_text()
    assert "#define IBP_SINGLE_UNROLL 8\n" in src and "#define IBP_SINGLE_MIN_BAGS 4\n" in src
    body = src[src.index("int ibp_single_bags(int row_bytes) {"):]
    body = body[: body.index("\n}")]
    assert "const int n16 = (row_bytes + 15) >> 4;" in body
    assert "max(IBP_SINGLE_MIN_BAGS, min(32, 32 * IBP_SINGLE_UNROLL / n16))" in body
    assert [single_bags(b) for b in (128, 512, 768, 1536, 2048, 100)] == [32, 8, 5, 4, 4, 32]


# ---- GPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("staging,ordered", [("none", False), ("none", True), ("full", False)])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)])
@pytest.mark.parametrize("name,dtype,cols,method,layout", CASES, ids=IDS)
def test_gpu_pool_one_id_bags_of_ibp_and_raw_rows(real_rows: Any, name: str, dtype: torch.dtype, cols: int,
                                                   method: str, layout: str, mode: str, weighted: bool, staging: str,
                                                   ordered: bool) -> None:
    """ibp_lookup_pool_single_c* == the bag loop over the same bags as offsets == torch's embedding_bag; bad ids
    zeros and reported; counters and freq count the pooled rows; bag_order changes nothing."""
    from ibpcache.kernels.lookup import ElemType, LookupErrors, PoolOp

    case = make_case(real_rows, name, dtype, cols, method, layout)
    eng = make_engine(case)
    rb = case.codec.row_bytes
    n = 7 * 32 * single_bags(rb) + 5  # no multiple of G: the last group is short
    ids = _ids(n, cols + 5)
    psw = None
    if weighted:
        psw = (torch.rand(n, generator=torch.Generator().manual_seed(3)) * 4 - 2).to(dtype).float().cuda()
    order = torch.argsort(ids.clamp(0, N_ROWS)).cuda() if ordered else None
    op, elem = PoolOp[mode.upper()], ElemType.of(dtype)
    keep = (ids >= 0) & (ids < N_ROWS)
    rows = ids[keep].numpy()
    runs = pool_one_id_bags_both_ways(ids, N_ROWS, rb, op, elem, psw, eng.src, eng.tables,
                                      lambda: _staging(staging, rb), order)
    outs = [run[0] for run in runs]  # the one-id kernel, then the bag loop
    for _, counters, freq, kind in runs:
        assert kind == LookupErrors.BAD_ID
        assert counters == _expected_counters(case, eng, rows, staging == "full")
        if freq is not None:
            assert np.array_equal(freq, np.bincount(rows, minlength=N_ROWS))
    assert torch.equal(outs[0], outs[1]), "one-id bags differ from the bag loop"
    assert not outs[0][~keep].any(), "a bad id's bag is not zeros"
    kept_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), keep.to(torch.int64).cumsum(0)[:-1]])
    want = torch.nn.functional.embedding_bag(ids[keep].cuda(), case.rows.cuda(), kept_offsets.cuda(), mode=mode,
                                             per_sample_weights=psw[keep.cuda()].to(dtype) if psw is not None else None)
    assert torch.equal(outs[0], want.cpu().view(torch.uint8).reshape(n, -1)), "one-id bags differ from torch"


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype,cols,method,layout", CASES, ids=IDS)
def test_gpu_rows_kernels_fetch_the_rows(real_rows: Any, name: str, dtype: torch.dtype, cols: int, method: str,
                                         layout: str) -> None:
    """Both ROWS kernels of the IBP and raw kinds (one row per warp, and several: ``ibp_lookup_rows_single_c*``,
    which raw stores take) return the source rows, zeros for bad ids, with equal counters. The several-rows kernel
    is also run on coded rows (tables marked raw), so its row-by-row path is checked too."""
    from dataclasses import replace

    from ibpcache.kernels.lookup import LookupErrors, lookup_rows

    case = make_case(real_rows, name, dtype, cols, method, layout)
    eng = make_engine(case)
    assert eng.tables.raw == (method == "raw")
    rb = case.codec.row_bytes
    n = 5 * 32 * single_bags(rb) + 3
    ids = _ids(n, cols + 9)
    keep = (ids >= 0) & (ids < N_ROWS)
    want = torch.zeros(n, rb, dtype=torch.uint8)
    want[keep] = case.rows.view(torch.uint8).reshape(N_ROWS, rb)[ids[keep]]
    seen = []
    for raw in (False, True):
        err = LookupErrors(pin=True)
        out = torch.full((n, rb), 0xAB, dtype=torch.uint8, device="cuda")
        counters = torch.zeros(4, dtype=torch.int64, device="cuda")
        lookup_rows(ids.cuda(), out, eng.src, replace(eng.tables, raw=raw), counters, err.ptr)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), want), f"rows differ (raw={raw})"
        assert err.take()[0] == LookupErrors.BAD_ID
        seen.append(counters.cpu().tolist())
    assert seen[0] == seen[1] == _expected_counters(case, eng, ids[keep].numpy(), False)
