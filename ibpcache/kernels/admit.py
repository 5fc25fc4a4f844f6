"""Launchers of ``admit.cu``: a device cache's per-step admission with no host sync (the slot policy's device contract).

The embedding bags' fused inference lookup (``cache/row_cache.py``) admits rows every step on the device: the
batch's requests are counted into a frequency sketch, the distinct missed rows bid for sampled victim slots
(``cache/policy.py`` ``SlotPolicy`` states the rule), winners are copied as stored into their slots, the other misses
into a per-step staging buffer (each read from host memory once), and the lookup then finds every one of them in
device memory. Five small launches, fixed shapes, device-side counts: CUDA-graph capturable.

Hash functions and constants are defined here once, as torch code that runs on any device (the policy's sketch on
the CPU and GPU, the CPU twin in ``admit_cpu.py``), and mirrored by ``admit.cu`` ("keep in sync"; a GPU test
compares the two bit for bit, a CPU test checks the constants in the source).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ._build import device_index, launch

__all__ = [
    "SKETCH_DEPTH", "SKETCH_MUL", "SAMPLE_MUL", "MIX_MUL", "FREE_KEY", "PROTECTED_KEY", "FLAG_OK", "FLAG_HIT",
    "FLAG_MISS", "FLAG_CAND", "FLAG_FREE", "ADMIT_NONE", "ADMIT_POLICY", "ADMIT_FORCE", "STAT_REQUESTS", "STAT_HITS", "STAT_ADMITTED", "STAT_STAGED", "STAT_HOST_BYTES",
    "N_STATS", "WS_LIST", "WS_STAGED", "N_WS", "sketch_index", "sample_slots", "AdmitArgs", "count", "scan", "rank",
    "apply", "advance_fill", "copy", "unstage", "sketch_add", "sketch_estimate", "touch",
]

_SRC = "admit.cu"
_BLOCK = 256  # threads per block of the thread-per-element kernels
_WARPS = 8  # warps per block of the copy kernel (IBP_ADM_COPY_WARPS)

SKETCH_DEPTH = 4
"""Rows of the count-min sketch (IBP_ADM_DEPTH)."""

_U64 = 1 << 64
SKETCH_MUL = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)
"""Multipliers of the sketch hash of row x in sketch row d (IBP_ADM_MUL0..3): h = x * M[d]; h ^= h >> 31 (logical);
h *= M[(d + 1) % 4]; column = (h >> 24) & (width - 1)."""
SAMPLE_MUL = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9)
"""Multipliers of the victim-sample hash of (row x, step stamp s, sample t) (IBP_ADM_SMUL0..2)."""
MIX_MUL = 0xD6E8FEB86659FD93
"""The finalizer's multiplier (IBP_ADM_MIX)."""

FREE_KEY = -(1 << 62)
"""Victim key of a free slot: below every occupied slot's."""
PROTECTED_KEY = 1 << 62
"""Victim key of a slot the current step (or a pending prefetched one) uses: never a victim."""

# per-position flags written by the scan (IBP_ADM_FLAG_*): a row (first of its run), resident, missed, bidding for a
# victim, taking a never-used slot (while the cache still has some, missed rows take them in sorted order, no bids)
FLAG_OK, FLAG_HIT, FLAG_MISS, FLAG_CAND, FLAG_FREE = 1, 2, 4, 8, 16
# admission modes of the scan (IBP_ADM_POLICY / IBP_ADM_FORCE): a lookup admits a missed row where the policy says so
# (TinyLFU: more frequent than its victim); a prefetch admits every row it is asked for that fits a slot and finds an
# unprotected victim, as FBGEMM's TBE prefetch inserts every prefetched row
ADMIT_NONE, ADMIT_POLICY, ADMIT_FORCE = 0, 1, 2
# device statistics (int64, IBP_ADM_STAT_*): lookups counted, of them resident at the step's start, rows admitted,
# rows staged, host bytes the copy read
STAT_REQUESTS, STAT_HITS, STAT_ADMITTED, STAT_STAGED, STAT_HOST_BYTES = 0, 1, 2, 3, 4
N_STATS = 8
# workspace counters (int64, IBP_ADM_WS_*): entries of the copy list, rows claimed in the staging buffer
WS_LIST, WS_STAGED = 0, 1
N_WS = 2


def _signed(v: int) -> int:
    return v - _U64 if v >= 1 << 63 else v


_LOW33 = (1 << 33) - 1
_LOW32 = (1 << 32) - 1
_POS63 = (1 << 63) - 1


_MUL_TABLES: dict[torch.device, torch.Tensor] = {}


def _mul_table(device: torch.device) -> torch.Tensor:
    """The sketch's multipliers on ``device``, copied there once: a copy from a Python list is a synchronizing
    host-to-device transfer, which a training step that must not wait for the GPU cannot afford every step."""
    table = _MUL_TABLES.get(device)
    if table is None:
        table = _MUL_TABLES[device] = torch.tensor([_signed(m) for m in SKETCH_MUL], dtype=torch.int64,
                                                   device=device)
    return table


def sketch_index(ids: torch.Tensor, width: int) -> torch.Tensor:
    """Flat counter index of every id in every sketch row: int64 ``[n, SKETCH_DEPTH]`` (row d at ``d * width``).

    Unsigned 64-bit arithmetic done in int64 (multiplications wrap alike; the one right shift that feeds a
    product is made logical by masking), so it equals admit.cu's ``ibp_adm_sketch_slot`` bit for bit."""
    mul = _mul_table(ids.device)
    h = ids.reshape(-1, 1) * mul
    h = h ^ ((h >> 31) & _LOW33)
    h = h * mul.roll(-1)
    rows = torch.arange(SKETCH_DEPTH, dtype=torch.int64, device=ids.device) * width
    return ((h >> 24) & (width - 1)) + rows


def _mix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ ((h >> 32) & _LOW32)
    h = h * _signed(MIX_MUL)
    return h ^ ((h >> 32) & _LOW32)


def sample_slots(ids: torch.Tensor, stamp: torch.Tensor, samples: int, lo: int, hi: int,
                 round: int = 0) -> torch.Tensor:
    """The ``samples`` victim slots in ``[lo, hi)`` an id looks at in the step stamped ``stamp`` (a 0-d int64
    tensor): int64 ``[n, samples]``, as admit.cu's ``ibp_adm_sample_slot``. The stamp reshuffles them every step;
    a later ``round`` of one pass looks at other slots."""
    first = round * samples + 1
    t = torch.arange(first, first + samples, dtype=torch.int64, device=ids.device) * _signed(SAMPLE_MUL[2])
    h = (ids.reshape(-1, 1) * _signed(SAMPLE_MUL[0])) ^ (stamp * _signed(SAMPLE_MUL[1])) ^ t
    return lo + (_mix(h) & _POS63) % max(hi - lo, 1)


@dataclass(frozen=True)
class AdmitArgs:
    """Everything the admission kernels read and write, as tensors on one CUDA device (see admit.cu).

    Policy state (``ids``/``freq``/``last``: int64 [n_slots + 1], the last element a scratch target; ``fill``: int64
    [1], slots at and after it never used since the cache was emptied), the cache's row
    -> slot table (``slot_of``: int32 [n_rows + 1]; -1 absent, >= 0 a slot, <= -2 staging row ``-2 - v``), the
    stored length of every slot and staging row (``slot_len``: int32 [n_slots + stage_cap + 1]), the host store
    (``host_len`` int32 [n_rows] or None when every row is ``row_bytes``; ``host_offsets`` int64 [n_rows] or None
    for row i at ``i * row_bytes``), the sketch, the per-step buffers and the two device scalars ``stamp`` (this
    pass's step) and ``protect`` (slots last used at or after it are never victims)."""

    slot_of: torch.Tensor
    ids: torch.Tensor
    freq: torch.Tensor
    last: torch.Tensor
    fill: torch.Tensor
    n_slots: int
    n_pinned: int
    lru: bool
    samples: int
    sketch: torch.Tensor
    width: int
    prio: Optional[torch.Tensor]
    slot_len: torch.Tensor
    slot_stride: int
    slot_bytes: int
    slab_base: int
    stage_base: int
    stage_cap: int
    stage_gid: torch.Tensor
    host_base: int
    host_offsets: Optional[torch.Tensor]
    host_len: Optional[torch.Tensor]
    row_bytes: int
    n_rows: int
    stamp: torch.Tensor
    protect: torch.Tensor
    stats: torch.Tensor
    ws: torch.Tensor
    bid: torch.Tensor
    victim: torch.Tensor
    key: torch.Tensor
    flags: torch.Tensor
    rank: torch.Tensor
    list_gid: torch.Tensor
    list_dst: torch.Tensor
    list_len: torch.Tensor


def _ptr(t: Optional[torch.Tensor]) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _grid(n: int) -> int:
    return max(1, -(-n // _BLOCK))


def count(keys: torch.Tensor, a: AdmitArgs, count_sketch: bool, count_stats: bool) -> None:
    """Pass 1 (thread per key; ``keys`` SORTED, as :func:`scan` takes them: a run of equal keys is counted into the
    sketch at once): count valid keys into the sketch, stamp the slots of resident rows with this pass's step, add
    requests and hits to the statistics. Keys ``>= n_rows`` are not rows (bad ids, padding)."""
    n = keys.numel()
    launch(_SRC, "ibp_adm_count", device_index(keys), _grid(n), _BLOCK,
           (_ptr(keys), np.int64(n), np.int64(a.n_rows), _ptr(a.slot_of), _ptr(a.sketch), np.uint64(a.width - 1),
            np.int32(int(count_sketch)), _ptr(a.last), _ptr(a.stamp), _ptr(a.stats), np.int32(int(count_stats))))


def scan(sorted_keys: torch.Tensor, a: AdmitArgs, admit: int, round: int = 0) -> None:
    """Pass 2 (thread per sorted position): the first of every distinct row decides -- a resident row refreshes its
    slot's frequency; a missed one takes a never-used slot while there are some (flagged; ranked by :func:`rank`),
    else samples victims and, where ``admit`` (``ADMIT_*``) lets it, bids for the best (atomicMax). A pass may run
    several ``round``s: a row that lost its victim to another row's bid samples other victims in the next."""
    n = sorted_keys.numel()
    launch(_SRC, "ibp_adm_scan", device_index(sorted_keys), _grid(n), _BLOCK,
           (_ptr(sorted_keys), np.int64(n), np.int64(a.n_rows), _ptr(a.slot_of), _ptr(a.sketch),
            np.uint64(a.width - 1), _ptr(a.prio), _ptr(a.ids), _ptr(a.freq), _ptr(a.last), np.int64(a.n_slots),
            np.int64(a.n_pinned), np.int32(int(a.lru)), np.int32(a.samples), _ptr(a.fill), _ptr(a.stamp),
            _ptr(a.protect),
            _ptr(a.host_len), np.int32(a.row_bytes), np.int32(a.slot_bytes), np.int32(int(admit)), np.int32(round),
            _ptr(a.bid),
            _ptr(a.victim), _ptr(a.key), _ptr(a.flags)))


def rank(n: int, a: AdmitArgs) -> None:
    """Between scan and apply (torch, fixed shape): ``rank[p]`` = how many positions before p take a never-used slot
    (an exclusive prefix count), so they take consecutive slots from ``fill`` on, in sorted order."""
    if n == 0:
        return
    taking = (a.flags[:n] & FLAG_FREE) != 0
    torch.cumsum(taking, 0, out=a.rank[:n])
    a.rank[:n] -= taking.to(torch.int64)


def advance_fill(n: int, a: AdmitArgs) -> None:
    """After apply: the never-used slots taken this pass are used (torch, fixed shape)."""
    if n == 0:
        return
    taken = a.rank[n - 1] + ((a.flags[n - 1] & FLAG_FREE) != 0).to(torch.int64)
    torch.clamp(a.fill + taken, max=a.n_slots, out=a.fill)


def apply(sorted_keys: torch.Tensor, a: AdmitArgs, stage: bool) -> None:
    """Pass 3 (thread per sorted position): bid winners take their victim slot (policy state and slot table
    updated, the evicted row's entry cleared), other misses claim a staging row (``stage``); both join the copy
    list (device counters in ``ws``)."""
    n = sorted_keys.numel()
    launch(_SRC, "ibp_adm_apply", device_index(sorted_keys), _grid(n), _BLOCK,
           (_ptr(sorted_keys), np.int64(n), _ptr(a.flags), _ptr(a.victim), _ptr(a.key), _ptr(a.bid), _ptr(a.rank),
            _ptr(a.fill), _ptr(a.ids),
            _ptr(a.freq), _ptr(a.last), _ptr(a.stamp), _ptr(a.slot_of), _ptr(a.slot_len), np.int64(a.n_slots),
            np.int64(a.slot_stride), np.int64(a.slab_base), _ptr(a.host_len), np.int32(a.row_bytes),
            np.int64(a.stage_cap if stage else 0), np.int64(a.stage_base), _ptr(a.stage_gid), _ptr(a.ws),
            _ptr(a.list_gid), _ptr(a.list_dst), _ptr(a.list_len), _ptr(a.stats)))


def copy(a: AdmitArgs, max_entries: int) -> None:
    """Pass 4 (warp per copy-list entry, the count read on the device): a row's stored bytes from host memory to its
    slot or staging row, as stored (the lookup decodes them)."""
    if max_entries == 0:
        return
    dev = device_index(a.list_gid)
    from .bitpack import sm_count

    grid = max(1, min(-(-max_entries // _WARPS), sm_count(dev) * 16))
    launch(_SRC, "ibp_adm_copy", dev, grid, 32 * _WARPS,
           (_ptr(a.list_gid), _ptr(a.list_dst), _ptr(a.list_len), _ptr(a.ws), np.int64(max_entries),
            np.int64(a.host_base), _ptr(a.host_offsets), np.int64(a.row_bytes), _ptr(a.stats)))


def unstage(a: AdmitArgs) -> None:
    """After the lookup: the step's staged rows leave the slot table (thread per staging row)."""
    if a.stage_cap == 0:
        return
    launch(_SRC, "ibp_adm_unstage", device_index(a.stage_gid), _grid(a.stage_cap), _BLOCK,
           (_ptr(a.stage_gid), _ptr(a.ws), np.int64(a.stage_cap), _ptr(a.slot_of)))


# -- the row cache's sketch (training and Colossal-AI paths) ----------------------------------------------------------


def _flat_i64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D int64 tensor (no copy when it already is one)."""
    return t.reshape(-1).to(torch.int64).contiguous()


def sketch_add(ids: torch.Tensor, weights: Optional[torch.Tensor], sketch: torch.Tensor, width: int) -> None:
    """Count CUDA ``ids`` (``weights``: requests each stands for; None: one) into ``sketch`` (int32, ``SKETCH_DEPTH``
    rows of ``width``), as ``sketch.index_add_(0, sketch_index(ids, width), weights)`` does, in one launch."""
    flat = _flat_i64(ids)
    w = None if weights is None else _flat_i64(weights)
    n = flat.numel()
    if n:
        launch(_SRC, "ibp_adm_sketch_add", device_index(flat), _grid(n), _BLOCK,
               (_ptr(flat), _ptr(w), np.int64(n), _ptr(sketch), np.uint64(width - 1)))


def sketch_estimate(ids: torch.Tensor, sketch: torch.Tensor, width: int) -> torch.Tensor:
    """int64 estimate of every CUDA id (the minimum of its counters), shaped like ``ids``, in one launch."""
    flat = _flat_i64(ids)
    out = torch.empty(flat.numel(), dtype=torch.int64, device=flat.device)
    if flat.numel():
        launch(_SRC, "ibp_adm_sketch_estimate", device_index(flat), _grid(flat.numel()), _BLOCK,
               (_ptr(flat), np.int64(flat.numel()), _ptr(sketch), np.uint64(width - 1), _ptr(out)))
    return out.view(ids.shape)


def touch(slots: torch.Tensor, slot_ids: torch.Tensor, freq: torch.Tensor, last: torch.Tensor, clock: int,
          sketch: torch.Tensor, width: int) -> None:
    """CUDA ``slots`` were used at ``clock``: ``last[slots] = clock`` and ``freq[slots]`` = the sketch's estimate of
    ``slot_ids[slots]``, in one launch (entries outside the arrays are skipped)."""
    flat = _flat_i64(slots)
    n = flat.numel()
    if n:
        launch(_SRC, "ibp_adm_touch", device_index(flat), _grid(n), _BLOCK,
               (_ptr(flat), np.int64(n), np.int64(slot_ids.numel()), _ptr(slot_ids), _ptr(freq), _ptr(last),
                np.int64(clock), _ptr(sketch), np.uint64(width - 1)))
