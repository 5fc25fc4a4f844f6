"""Grouped exponent decode: a warp decodes G narrow rows at once (``ibp_exp_decode_rows_warp`` in exponent.cu: lanes
over (row, segment) walks), in the engine's lookup kernels (ROWS: G consecutive bags; POOL: G rows of a bag, folded
in the bag's order, or G one-id bags) and in exponent.cu's gather / descriptor kernels.

CPU (runs everywhere): the G formula's invariants (shared memory budget, <= 32 walks, room for the bit windows'
read past a row), and the test geometries below: each groups (G > 1), mixes raw and coded rows, and its planted
corruptions are malformed by the CPU decoder too. GPU (``-m gpu``): every output equals the source rows (the CPU
codec's twin decodes them bit for bit) or torch's embedding_bag; rows of 1, 2 and 3 segments, fp32 / bf16 / fp16,
odd widths, batches and bags that are no multiple of G, slab hits + host misses + staged misses in one launch, bad ids
and malformed rows inside a group with their neighbours exact, the statistics counters and freq atomics.
Real data: SmolLM2 KV rows (``../shared/data/llm``) and MiniLM rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch

from cache_helpers import pool_one_id_bags_both_ways

from ibpcache import ExponentCodec
from ibpcache.errors import FormatError
from ibpcache.kernels.exponent import WARP_MAX_ROW, WARP_SMEM_BYTES, group_rows

POOL_MAX_ROW = 2048  # lookup.cu's IBP_POOL_MAX_ROW: the pooling kernel's row buffer holds G rows
OFF = 4000  # MiniLM's first rows are special tokens; real words start later

# (rows, dtype, columns, seg): n_seg 1, 2 and 3; 16- and 32-bit elements; an odd 16-bit width (2-byte stores)
GEOMETRIES = [
    ("kv_chat_v_bf16", torch.bfloat16, 64, None),
    ("kv_chat_v_bf16", torch.bfloat16, 64, 32),
    ("kv_chat_k_bf16", torch.bfloat16, 64, 22),
    ("kv_chat_k_fp32", torch.float32, 64, 22),
    ("kv_code_v_fp16", torch.float16, 64, 32),
    ("minilm", torch.float16, 256, "auto"),
    ("minilm", torch.float32, 128, 64),
    ("minilm", torch.bfloat16, 33, 16),
]
IDS = [f"{n}-{str(dt).replace('torch.', '')}-d{c}-seg{s}" for n, dt, c, s in GEOMETRIES]
N_ROWS = 3000
# rows scaled by this are made of exponents the codec saw rarely: they are stored raw (and stay finite)
RARE_SCALE = {torch.float32: 2.0 ** -60, torch.bfloat16: 2.0 ** -60, torch.float16: 2.0 ** -14}


@dataclass
class Case:
    rows: torch.Tensor  # [N_ROWS, d], the source rows
    codec: ExponentCodec
    data: torch.Tensor  # the CPU encoder's bytes (packed), lengths, offsets
    lengths: torch.Tensor
    offsets: torch.Tensor
    bad_lengths: dict[int, int]  # row -> a stored length that makes it malformed (truncated codewords, or 0)


def make_case(real_rows: Any, name: str, dtype: torch.dtype, cols: int, seg: Any) -> Case:
    """Real rows cast to ``dtype`` (finite), every 11th scaled into rare exponents (stored raw), encoded on the CPU;
    two coded rows get lengths that cut their codewords (the walk runs past the row) and one a length of 0."""
    src = real_rows(name)
    x = (src[OFF: OFF + N_ROWS, :cols] if name == "minilm" else src[:N_ROWS, :cols]).to(dtype).clone()
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    codec = ExponentCodec.fit(x, seg=seg)
    x[::11] = (x[::11].float() * RARE_SCALE[dtype]).to(dtype)
    data, lengths, offsets = codec.encode(x)
    coded = torch.nonzero(lengths < codec.row_bytes).flatten().tolist()
    code0 = -(-(codec.hdr_bits + codec.row_elems * codec.raw_bits) // 8)  # bytes up to the first codeword
    bad = {coded[5]: code0, coded[len(coded) // 2]: code0 + 1, coded[-3]: 0}
    return Case(x, codec, data, lengths, offsets, bad)


# ---- CPU ---------------------------------------------------------------------------------------------------------


def test_group_rows_formula_invariants() -> None:
    """For every row width the warp decoder stages and any segment count: G rows of (stride + d) bytes fit the
    warp's shared memory, G * n_seg <= 32 walks, the stride leaves the 12 bytes a bit window reads past a row,
    and rows the budget cannot pair (or too many segments, or wider than the stage) take the one-row path."""
    for elem in (2, 4):
        for d in range(1, WARP_MAX_ROW // elem + 1):
            row_bytes = d * elem
            for seg in {d, 8, 16, 22, 32, 64, 128}:
                n_seg = -(-d // min(seg, d))
                for cap in (32, POOL_MAX_ROW // row_bytes):
                    g = group_rows(row_bytes, d, n_seg, cap)
                    stride = ((row_bytes + 3) & ~3) + 16
                    assert 1 <= g <= max(1, cap)
                    if g > 1:
                        assert g * (stride + d) <= WARP_SMEM_BYTES and g * n_seg <= 32 and stride >= row_bytes + 12
                    else:
                        assert n_seg > 16 or cap < 2 or 2 * (stride + d) > WARP_SMEM_BYTES or 2 * n_seg > 32
    assert group_rows(128, 64, 1) == 14  # a 64 x bf16 KV row: 14 rows (14 walks) per warp
    assert group_rows(512, 256, 1) == 3  # a DLRM row of 256 x fp16
    assert group_rows(2048, 1024, 1) == 1 and group_rows(4096, 1024, 1) == 1


def test_group_rows_twin_reads_the_kernels_budget() -> None:
    """group_rows mirrors ibp_exp_group_rows: same budget macro, same stride and caps in the CUDA source."""
    src = (Path(__file__).resolve().parents[2] / "ibpcache" / "kernels" / "exponent.cu").read_text()
    assert re.search(r"#define IBP_EXP_WARP_MAX_ROW (\d+)", src).group(1) == str(WARP_MAX_ROW)
    assert "#define IBP_EXP_WARP_SMEM_BYTES (IBP_EXP_WARP_STAGE_BYTES + IBP_EXP_WARP_MAX_ROW / 2)" in src
    assert "#define IBP_EXP_WARP_STAGE_BYTES (IBP_EXP_WARP_MAX_ROW + 16)" in src
    assert WARP_SMEM_BYTES == WARP_MAX_ROW + 16 + WARP_MAX_ROW // 2
    assert "return ((g.row_bytes + 3) & ~3) + 16;" in src
    body = src[src.index("int ibp_exp_group_rows("):]
    body = body[: body.index("\n}")]
    for piece in ("g.row_bytes > IBP_EXP_WARP_MAX_ROW || g.n_seg > 16 || cap < 2",
                  "IBP_EXP_WARP_SMEM_BYTES / (ibp_exp_group_stride(g) + g.d)", "32 / g.n_seg", "min(G, cap)"):
        assert piece in body, piece


@pytest.mark.parametrize("name,dtype,cols,seg", GEOMETRIES, ids=IDS)
def test_geometries_group_and_plant_what_the_gpu_tests_need(real_rows: Any, name: str, dtype: torch.dtype,
                                                             cols: int, seg: Any) -> None:
    """Each GPU geometry decodes G > 1 rows per warp in ROWS and POOL alike, mixes raw and coded rows, and its
    planted lengths are malformed for the CPU twin too (so the GPU must report them, not decode them)."""
    case = make_case(real_rows, name, dtype, cols, seg)
    c = case.codec
    assert c.n_seg == {None: 1, 32: 2, 22: 3, 64: 2, 16: 3}.get(seg, c.n_seg)
    assert group_rows(c.row_bytes, c.row_elems, c.n_seg) > 1
    assert group_rows(c.row_bytes, c.row_elems, c.n_seg, POOL_MAX_ROW // c.row_bytes) > 1
    raw = case.lengths == c.row_bytes
    assert 0 < int(raw.sum()) < N_ROWS, "expected both raw and coded rows"
    assert torch.equal(c.decode(case.data, case.lengths, case.offsets).view(torch.uint8),
                       case.rows.view(torch.uint8))
    for row, n in case.bad_lengths.items():
        if n == 0:
            continue  # a coded length of 0 is refused before any decode (the GPU checks it per row)
        with pytest.raises(FormatError):
            c.decode(case.data, torch.tensor([n], dtype=torch.int32), case.offsets[row: row + 1])


# ---- GPU ---------------------------------------------------------------------------------------------------------


@dataclass
class Engine:
    """One lookup source over a case: slot hits (coded rows in slab 0), coded rows in slab 1 (the slot table's
    staging form), host misses read zero-copy from pinned memory; malformed lengths planted per ``corrupt``."""

    src: Any
    tables: Any
    hit: np.ndarray  # bool [N_ROWS]: served from a slab
    length: np.ndarray  # the stored length every row is read with (after corruption)
    corrupt: np.ndarray  # bool [N_ROWS]: malformed as stored
    keep: list  # tensors the kernels read


def make_engine(case: Case, corrupt_where: str) -> Engine:
    """``corrupt_where``: "host" (the planted rows are host misses), "slab" (they are slot hits), or "none"."""
    from ibpcache.kernels.hashmap import IndexArgs
    from ibpcache.kernels.lookup import SLOT_TABLE_INDEX, RowSource

    dev = torch.device("cuda")
    c = case.codec
    rb = c.row_bytes
    lengths = case.lengths.numpy().astype(np.int64).copy()
    offsets = case.offsets.numpy()
    data = case.data.numpy()
    bad_rows = np.array(sorted(case.bad_lengths), dtype=np.int64)
    corrupt = np.zeros(N_ROWS, dtype=bool)
    if corrupt_where != "none":
        corrupt[bad_rows] = True
    slot_rows = np.arange(0, N_ROWS, 3)
    slab1_rows = np.arange(1, N_ROWS, 7)
    slab1_rows = slab1_rows[slab1_rows % 3 != 0]
    if corrupt_where == "host":
        slot_rows = np.setdiff1d(slot_rows, bad_rows)
        slab1_rows = np.setdiff1d(slab1_rows, bad_rows)
    elif corrupt_where == "slab":
        slot_rows = np.union1d(slot_rows, bad_rows)
        slab1_rows = np.setdiff1d(slab1_rows, bad_rows)
    for row, n in case.bad_lengths.items():
        if corrupt[row]:
            lengths[row] = n
    stride = (rb + 15) // 16 * 16
    slab0 = np.zeros(len(slot_rows) * stride + 16, dtype=np.uint8)
    slab1 = np.zeros(len(slab1_rows) * rb + 16, dtype=np.uint8)
    slot_of = np.full(N_ROWS, -1, dtype=np.int32)
    slot_len = np.zeros(len(slot_rows) + len(slab1_rows), dtype=np.int32)
    for v, row in enumerate(slot_rows):
        stored = int(case.lengths[row])
        slab0[v * stride: v * stride + stored] = data[offsets[row]: offsets[row] + stored]
        slot_of[row] = v
        slot_len[v] = lengths[row]
    for k, row in enumerate(slab1_rows):
        stored = int(case.lengths[row])
        slab1[k * rb: k * rb + stored] = data[offsets[row]: offsets[row] + stored]
        slot_of[row] = -2 - k
        slot_len[len(slot_rows) + k] = lengths[row]
    slab0_d, slab1_d = torch.from_numpy(slab0).to(dev), torch.from_numpy(slab1).to(dev)
    bases = torch.zeros(8, dtype=torch.int64)
    bases[0], bases[1] = slab0_d.data_ptr(), slab1_d.data_ptr()
    host = torch.zeros(data.size + 16, dtype=torch.uint8).pin_memory()
    host[: data.size] = case.data
    keys = torch.from_numpy(slot_len).to(dev)
    values = torch.from_numpy(slot_of).to(dev)
    host_len = torch.from_numpy(lengths.astype(np.int32)).to(dev)
    host_off = case.offsets.to(dev, torch.int64)
    src = RowSource(IndexArgs(SLOT_TABLE_INDEX, keys, values, len(slot_rows), stride), bases.to(dev),
                    host.data_ptr(), host_off, rb, host_len, N_ROWS)
    return Engine(src, c.kernel_tables(dev), slot_of != -1, lengths, corrupt,
                  [slab0_d, slab1_d, host, keys, values, host_len, host_off])


def _ids(n: int, seed: int, bad: bool) -> torch.Tensor:
    """Random rows with repeats, and (``bad``) up to four bad ids (-1, N_ROWS, ...) at random places."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, N_ROWS, (n,), generator=g)
    if bad:
        k = min(n - 1, 4)  # a short batch keeps a good row
        ids[torch.randperm(n, generator=g)[:k]] = torch.tensor([-1, N_ROWS, -7, N_ROWS + 3])[:k]
    return ids


def _staging(kind: str, row_bytes: int) -> Optional[Any]:
    from ibpcache.kernels.lookup import Staging

    if kind == "none":
        return None
    cap_rows = 64 if kind == "small" else N_ROWS  # small: staging fills, later misses are read zero-copy
    return Staging.allocate(N_ROWS, row_bytes, cap_rows * row_bytes, torch.device("cuda"))


def _expected_counters(eng: Engine, rows: np.ndarray, staged_all: bool) -> list[int]:
    """requests, hits, host bytes, slab bytes of the rows a lookup decoded (bad ids excluded). Staged: every
    distinct miss is read (and counted) once by STAGE."""
    hit = eng.hit[rows]
    host_rows = rows[~hit]
    host = int(eng.length[np.unique(host_rows)].sum()) if staged_all else int(eng.length[host_rows].sum())
    return [rows.size, int(hit.sum()), host, int(eng.length[rows[hit]].sum())]


def _kind(err: Any) -> Optional[int]:
    taken = err.take()
    return None if taken is None else taken[0]


@pytest.mark.gpu
@pytest.mark.parametrize("staging", ["none", "full", "small"])
@pytest.mark.parametrize("name,dtype,cols,seg", GEOMETRIES, ids=IDS)
def test_gpu_lookup_rows_groups(real_rows: Any, name: str, dtype: torch.dtype, cols: int, seg: Any,
                                staging: str) -> None:
    """ROWS over batches that are no multiple of G: slab hits, slab-1 rows and host misses (zero-copy, or staged by
    the three-launch path) side by side in every group; bad ids and malformed rows (host misses; slot hits when
    staging, since STAGE turns a malformed host row into zeros) give zero rows and reports, their neighbours stay
    exact; counters and freq as a row-by-row lookup counts them."""
    from ibpcache.kernels.lookup import CORRUPT_ROW, LookupErrors, lookup_rows

    case = make_case(real_rows, name, dtype, cols, seg)
    eng = make_engine(case, "host" if staging == "none" else "slab")
    rb = case.codec.row_bytes
    st = _staging(staging, rb)
    err = LookupErrors(pin=True)
    src_u8 = case.rows.view(torch.uint8).reshape(N_ROWS, rb)
    planted = torch.tensor(sorted(case.bad_lengths))
    for step, (n, bad) in enumerate([(1001, True), (37, False), (3 * 14 * 8 + 5, False), (2, True)]):
        ids = _ids(n, step + cols, bad)
        if step == 1:
            ids[: planted.numel()] = planted  # the malformed rows inside one group, with exact neighbours
        valid = (ids >= 0) & (ids < N_ROWS)
        out = torch.full((n, rb), 0xAB, dtype=torch.uint8, device="cuda")
        counters = torch.zeros(4, dtype=torch.int64, device="cuda")
        freq = torch.zeros(N_ROWS, dtype=torch.int32, device="cuda") if st is None else None
        lookup_rows(ids.cuda(), out, eng.src, eng.tables, counters, err.ptr, freq=freq, staging=st)
        torch.cuda.synchronize()
        rows = ids[valid].numpy()
        want = src_u8[ids.clamp(0, N_ROWS - 1)].clone()
        zero = ~valid.numpy()
        zero[valid.numpy()] = eng.corrupt[rows]
        want[torch.from_numpy(zero)] = 0
        assert torch.equal(out.cpu(), want), "grouped ROWS differ from the source rows"
        kinds = ({CORRUPT_ROW} if eng.corrupt[rows].any() else set()) | ({LookupErrors.BAD_ID} if bad else set())
        got = _kind(err)
        assert (got is None) if not kinds else (got in kinds), (got, kinds)
        if staging != "small":
            assert counters.cpu().tolist() == _expected_counters(eng, rows, staging == "full")
        if freq is not None:
            assert np.array_equal(freq.cpu().numpy(), np.bincount(rows, minlength=N_ROWS))


def _bags(n_bags: int, G: int, seed: int, planted: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Bags of 0, 1, G - 1, G, G + 1, 2G + 3 ... ids (a bag's last group is short), offsets torch-style; the
    planted (malformed) rows sit inside bag 3 between good rows, and bag 5 holds bad ids."""
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 1, G - 1, G + len(planted), G + 1, 2 * G + 3]
    sizes += torch.randint(0, 2 * G + 4, (n_bags - len(sizes),), generator=g).tolist()
    ids = torch.randint(0, N_ROWS, (sum(sizes),), generator=g)
    offsets = torch.tensor([0] + sizes[:-1]).cumsum(0)
    start = int(offsets[3])
    ids[start + 1: start + 1 + len(planted)] = torch.tensor(planted)
    start = int(offsets[5])
    ids[start: start + 3] = torch.tensor([-1, N_ROWS, N_ROWS + 100])
    return ids, offsets


@pytest.mark.gpu
@pytest.mark.parametrize("staging", ["none", "full"])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)])
@pytest.mark.parametrize("name,dtype,cols,seg", GEOMETRIES, ids=IDS)
def test_gpu_lookup_pool_groups(real_rows: Any, name: str, dtype: torch.dtype, cols: int, seg: Any, mode: str,
                                weighted: bool, staging: str) -> None:
    """POOL decodes G rows of a bag at a time and folds them in the bag's order: bit-exact against torch's
    embedding_bag over the same bags without the ids that pool nothing (bad ids, malformed rows), whose reports
    arrive; bag sizes around G (short last groups, empty bags); counters and freq count the pooled rows."""
    from ibpcache.kernels.lookup import CORRUPT_ROW, ElemType, LookupErrors, PoolOp, lookup_pool

    case = make_case(real_rows, name, dtype, cols, seg)
    c = case.codec
    eng = make_engine(case, "host" if staging == "none" else "slab")
    G = group_rows(c.row_bytes, c.row_elems, c.n_seg, POOL_MAX_ROW // c.row_bytes)
    assert G > 1
    ids, offsets = _bags(301, G, cols, sorted(case.bad_lengths))
    n_bags = offsets.numel()
    psw = None  # float32 for the kernel, values of the row dtype (torch takes weights of the table's dtype)
    if weighted:
        psw = (torch.rand(ids.numel(), generator=torch.Generator().manual_seed(2)) * 4 - 2).to(dtype).float()
    st = _staging(staging, c.row_bytes)
    err = LookupErrors(pin=True)
    out = torch.full((n_bags, c.row_bytes), 0xAB, dtype=torch.uint8, device="cuda")
    counters = torch.zeros(4, dtype=torch.int64, device="cuda")
    freq = torch.zeros(N_ROWS, dtype=torch.int32, device="cuda") if st is None else None
    lookup_pool(ids.cuda(), offsets.cuda(), 0, n_bags, False, PoolOp[mode.upper()], ElemType.of(dtype),
                psw.cuda() if psw is not None else None, out, eng.src, eng.tables, counters, err.ptr, freq=freq,
                staging=st)
    torch.cuda.synchronize()
    valid = (ids >= 0) & (ids < N_ROWS)
    keep = valid.clone()
    keep[valid] = torch.from_numpy(~eng.corrupt[ids[valid].numpy()])
    sizes = torch.diff(torch.cat([offsets, torch.tensor([ids.numel()])]))
    bag_of = torch.repeat_interleave(torch.arange(n_bags), sizes)
    kept_sizes = torch.bincount(bag_of[keep], minlength=n_bags)
    kept_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), kept_sizes.cumsum(0)[:-1]])
    want = torch.nn.functional.embedding_bag(ids[keep].cuda(), case.rows.cuda(), kept_offsets.cuda(), mode=mode,
                                             per_sample_weights=psw[keep].to(dtype).cuda() if psw is not None else None)
    assert torch.equal(out.cpu(), want.cpu().view(torch.uint8).reshape(n_bags, -1)), "grouped pooling differs"
    assert _kind(err) in ({CORRUPT_ROW, LookupErrors.BAD_ID} if eng.corrupt.any() else {LookupErrors.BAD_ID})
    rows = ids[keep].numpy()
    assert counters.cpu().tolist() == _expected_counters(eng, rows, staging == "full")
    if freq is not None:
        assert np.array_equal(freq.cpu().numpy(), np.bincount(rows, minlength=N_ROWS))


@pytest.mark.gpu
@pytest.mark.parametrize("staging,ordered", [("none", False), ("none", True), ("full", False)])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)])
@pytest.mark.parametrize("name,dtype,cols,seg", GEOMETRIES, ids=IDS)
def test_gpu_lookup_pool_one_id_bags(real_rows: Any, name: str, dtype: torch.dtype, cols: int, seg: Any, mode: str,
                                     weighted: bool, staging: str, ordered: bool) -> None:
    """Bags of one id (no offsets, bag_size 1: ibp_lookup_pool_single_e*, G bags per warp) write the bytes the bag
    loop writes for the same bags given as offsets, and torch's embedding_bag's; a bad id's or malformed row's bag
    is zeros and reported, its group's neighbours exact; bag_order (bags taken in row order) changes nothing;
    counters and freq count the pooled rows."""
    from ibpcache.kernels.lookup import CORRUPT_ROW, ElemType, LookupErrors, PoolOp

    case = make_case(real_rows, name, dtype, cols, seg)
    c = case.codec
    eng = make_engine(case, "host" if staging == "none" else "slab")
    G = group_rows(c.row_bytes, c.row_elems, c.n_seg, POOL_MAX_ROW // c.row_bytes)
    assert G > 1
    n = 7 * 32 * G + 5  # no multiple of G: the last group is short
    ids = _ids(n, cols + 11, bad=True)
    ids[40: 40 + len(case.bad_lengths)] = torch.tensor(sorted(case.bad_lengths))  # inside one group
    psw = None
    if weighted:
        psw = (torch.rand(n, generator=torch.Generator().manual_seed(3)) * 4 - 2).to(dtype).float().cuda()
    order = torch.argsort(ids.clamp(0, N_ROWS)).cuda() if ordered else None
    op, elem = PoolOp[mode.upper()], ElemType.of(dtype)
    runs = pool_one_id_bags_both_ways(ids, N_ROWS, c.row_bytes, op, elem, psw, eng.src, eng.tables,
                                      lambda: _staging(staging, c.row_bytes), order)
    outs = [run[0] for run in runs]  # the one-id kernel, then the bag loop
    reports = [run[3] for run in runs]
    valid = (ids >= 0) & (ids < N_ROWS)
    keep = valid.clone()
    keep[valid] = torch.from_numpy(~eng.corrupt[ids[valid].numpy()])
    rows = ids[keep].numpy()
    for _, counters, freq, _ in runs:
        assert counters == _expected_counters(eng, rows, staging == "full")
        if freq is not None:
            assert np.array_equal(freq, np.bincount(rows, minlength=N_ROWS))
    assert torch.equal(outs[0], outs[1]), "one-id bags differ from the bag loop"
    kept_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), keep.to(torch.int64).cumsum(0)[:-1]])
    want = torch.nn.functional.embedding_bag(ids[keep].cuda(), case.rows.cuda(), kept_offsets.cuda(), mode=mode,
                                             per_sample_weights=psw[keep.cuda()].to(dtype) if psw is not None else None)
    assert torch.equal(outs[0], want.cpu().view(torch.uint8).reshape(n, -1)), "one-id bags differ from torch"
    expect = {LookupErrors.BAD_ID} | ({CORRUPT_ROW} if eng.corrupt.any() else set())
    assert reports[0] in expect and reports[1] in expect


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["device", "pinned"])
@pytest.mark.parametrize("name,dtype,cols,seg", GEOMETRIES, ids=IDS)
def test_gpu_exp_gather_and_descriptors_groups(real_rows: Any, name: str, dtype: torch.dtype, cols: int, seg: Any,
                                               where: str) -> None:
    """exponent.cu's gather (ids, out_rows) and descriptor kernels over the same rows (a group of G per warp where
    the rows are segmented or wider than the lane-per-row stage): exact rows, a malformed row and a bad id
    reported by index with every other row exact."""
    from ibpcache.kernels.exponent import exp_decode_desc, exp_gather

    case = make_case(real_rows, name, dtype, cols, seg)
    c = case.codec
    rb = c.row_bytes
    dev = torch.device("cuda")
    tab = c.kernel_tables(dev)
    buf = torch.zeros(case.data.numel() + 16, dtype=torch.uint8)
    buf[: case.data.numel()] = case.data
    buf = buf.to(dev) if where == "device" else buf.pin_memory()
    src_u8 = case.rows.view(torch.uint8).reshape(N_ROWS, rb)
    bad_row, bad_len = next(iter(case.bad_lengths.items()))
    lengths = case.lengths.clone()
    lengths[bad_row] = bad_len
    ids = torch.randint(0, N_ROWS, (1001,), generator=torch.Generator().manual_seed(cols))
    ids = ids[ids != bad_row]
    ids[500] = bad_row
    ids[17] = N_ROWS  # a bad id
    m = ids.numel()
    out_rows = torch.randperm(m, generator=torch.Generator().manual_seed(1))
    out = torch.full((m, rb), 0xAB, dtype=torch.uint8, device=dev)
    err = torch.zeros(2, dtype=torch.int64, device=dev)
    exp_gather(buf.data_ptr(), case.offsets.to(dev, torch.int64), lengths.to(dev, torch.int32), ids.to(dev), N_ROWS,
               tab, out, err, out_rows=out_rows.to(dev))
    good = torch.ones(m, dtype=torch.bool)
    good[[17, 500]] = False
    assert err.cpu().tolist() == [501, 18]
    assert torch.equal(out.cpu()[out_rows[good]], src_u8[ids[good]])
    # descriptors: absolute addresses, coded flags, the malformed row among them
    pick = ids.clone()
    pick[17] = 3
    ptrs = buf.data_ptr() + case.offsets[pick]
    lens = lengths[pick].to(torch.int32)
    coded = (case.lengths[pick] < rb).to(torch.uint8)
    out2 = torch.full((m, rb), 0xAB, dtype=torch.uint8, device=dev)
    err2 = torch.zeros(2, dtype=torch.int64, device=dev)
    exp_decode_desc(out2, ptrs.to(dev), lens.to(dev), coded.to(dev), out_rows.to(dev), tab, err2)
    good[17] = True
    assert int(err2[0]) == 501
    assert torch.equal(out2.cpu()[out_rows[good]], src_u8[pick[good]])


# lookup.cu's compile-time variants of the exponent lookup kernels (exp_lookup_profile.py --variants times them): more
# staged words in flight per lane (IBP_EXP_LOOKUP_UNROLL, 1 included: one word per pass), successors by shuffle
# (IBP_EXP_LOOKUP_SHFL: lane 31 and row ends load theirs), registers capped for more resident warps
# (IBP_EXP_MIN_WARPS), and combinations
VARIANTS = [("-DIBP_EXP_LOOKUP_UNROLL=1",), ("-DIBP_EXP_LOOKUP_UNROLL=8",), ("-DIBP_EXP_MIN_WARPS=24",),
            ("-DIBP_EXP_LOOKUP_UNROLL=8", "-DIBP_EXP_MIN_WARPS=24"),
            ("-DIBP_EXP_LOOKUP_UNROLL=8", "-DIBP_EXP_MIN_WARPS=32"),
            ("-DIBP_EXP_LOOKUP_UNROLL=1", "-DIBP_EXP_LOOKUP_SHFL=1"),
            ("-DIBP_EXP_LOOKUP_UNROLL=8", "-DIBP_EXP_LOOKUP_SHFL=1", "-DIBP_EXP_MIN_WARPS=24")]
VARIANT_GEOMETRIES = [GEOMETRIES[1], GEOMETRIES[2], GEOMETRIES[5], GEOMETRIES[6], GEOMETRIES[7]]


@pytest.mark.gpu
@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: "+".join(x.split("_")[-1] for x in o))
@pytest.mark.parametrize("name,dtype,cols,seg", VARIANT_GEOMETRIES,
                         ids=[IDS[GEOMETRIES.index(g)] for g in VARIANT_GEOMETRIES])
def test_gpu_lookup_variants_match_the_defaults(real_rows: Any, name: str, dtype: torch.dtype, cols: int, seg: Any,
                                                options: tuple[str, ...]) -> None:
    """A variant's ROWS, one-id POOL and bag-loop POOL write the defaults' bytes and counters, and report bad ids /
    malformed rows as they do, over host misses (malformed ones among them) and slab hits; the ROWS output is also
    the source rows (so two equally wrong builds cannot agree)."""
    from ibpcache.kernels._build import extra_kernel_options
    from ibpcache.kernels.lookup import ElemType, LookupErrors, PoolOp, lookup_pool, lookup_rows

    case = make_case(real_rows, name, dtype, cols, seg)
    eng = make_engine(case, "host")
    rb = case.codec.row_bytes
    n = 1001
    ids = _ids(n, 11, True)
    planted = torch.tensor(sorted(case.bad_lengths))
    ids[5: 5 + planted.numel()] = planted
    ids_d = ids.cuda()

    def run() -> list[tuple[torch.Tensor, list[int], Optional[int]]]:
        results = []
        for kernel in ("rows", "pool_single", "pool_bags"):
            err = LookupErrors(pin=True)
            out = torch.full((n, rb), 0xAB, dtype=torch.uint8, device="cuda")
            counters = torch.zeros(4, dtype=torch.int64, device="cuda")
            if kernel == "rows":
                lookup_rows(ids_d, out, eng.src, eng.tables, counters, err.ptr)
            else:
                offsets = None if kernel == "pool_single" else torch.arange(n, device="cuda")
                lookup_pool(ids_d, offsets, 1 if offsets is None else 0, n, False, PoolOp.SUM, ElemType.of(dtype),
                            None, out, eng.src, eng.tables, counters, err.ptr)
            torch.cuda.synchronize()
            results.append((out.cpu(), counters.cpu().tolist(), _kind(err)))
        return results

    base = run()
    with extra_kernel_options(*options):
        variant = run()
    valid = (ids >= 0) & (ids < N_ROWS)
    want = case.rows.view(torch.uint8).reshape(N_ROWS, rb)[ids.clamp(0, N_ROWS - 1)].clone()
    zero = ~valid.numpy()
    zero[valid.numpy()] = eng.corrupt[ids[valid].numpy()]
    want[torch.from_numpy(zero)] = 0
    assert torch.equal(variant[0][0], want), "the variant's ROWS differ from the source rows"
    reports = {LookupErrors.BAD_ID, LookupErrors.CORRUPT_ROW}  # whichever report a launch wrote last
    for kernel, (out0, c0, k0), (out1, c1, k1) in zip(("rows", "pool_single", "pool_bags"), base, variant):
        assert torch.equal(out1, out0), f"{kernel}: the variant's bytes differ from the defaults'"
        assert c1 == c0, kernel
        assert k0 in reports and k1 in reports, (kernel, k0, k1)
