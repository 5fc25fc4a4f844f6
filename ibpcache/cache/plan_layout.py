"""Host-layout planner: store a table's host rows IBP-coded, exponent-coded or raw, whichever this machine reads
fastest.

Compression pays on the miss path only when the bytes it saves on PCIe are worth more than the warp decode it
adds. That trade depends on the table (how well each codec compresses it), the row size and the machine (zero-copy
read rate vs decode rate), so it is measured, not guessed: at start-up :func:`calibrate_layout` builds a small
pinned sample of the table under each candidate codec (IBP, exponent coding where the dtype allows it, raw rows)
and times the store's own zero-copy lookup kernel (every id a miss) over each, alternating the candidates round by
round, a few tens of milliseconds in all. :func:`decide_codec` then keeps compression only where it was
measurably faster than raw (:data:`MARGIN`), and picks among the compressed candidates by speed with the same
margin as hysteresis (a faster codec must win by the margin, else the smaller one stays), so the default
configuration is never slower than the raw one on misses.

GPU caches in front of the store (FeatureCache's slab, the embedding bags' fused inference slots) keep rows as they
are stored, so a codec also changes what a cache hit costs: a hit decodes from device memory, where raw rows read
at HBM speed and dense float rows coded by IBP or exponent coding decode several times slower. Each candidate is
therefore also timed with the sample in device memory, and a codec that wins on misses is kept only if it also wins,
by the same margin, at a hit share of :data:`HIT_SHARE` (a well-sized cache's regime): compression must pay whatever
the hit rate. A cache that can decode rows when it admits them (the embedding bags' inference slots: ``slots``)
instead holds them decoded where compressed hits would cost more than raw ones (:func:`slot_form`): its hits then
cost what raw rows' do, and compression is judged by the misses it speeds up.

Calibration happens once per table, at construction, before any lookup; its host syncs are there, never in a
lookup step. Without CUDA there is no zero-copy path to time: the smallest stored size wins (host memory is then
the only thing compression changes).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

import torch

from ..codec import Codec
from ..errors import InternalError, InvalidArgumentError
from ._plan_timing import MARGIN, wall_medians

__all__ = ["LayoutChoice", "decide_layout", "decide_codec", "prefer_host_gather", "calibrate_layout", "pick_codec",
           "best_compressed", "candidate_names", "codec_named", "named_fit",
           "slot_form", "slot_option", "SLOT_FORMS", "STORED_SLOTS_MIN_RATIO",
           "CALIBRATION_BYTES", "MIN_RATIO", "MARGIN", "ROUNDS", "REPS", "HIT_SHARE"]

CALIBRATION_BYTES = 32 << 20
"""Raw bytes of the pinned sample each layout is timed on (a sample this size streams from host memory, like
the table does, rather than hitting the GPU's L2)."""

MIN_RATIO = 1.02
"""Below this host compression ratio a codec is not timed: there are no bytes to save, only decode to add."""

HIT_SHARE = 0.9
"""The hit share at which a layout held in compressed slots must still beat raw rows (by the margin) per looked-up
row (a layout held decoded is judged on its misses: its hits are raw rows)."""

SLOT_FORMS = ("stored", "decoded", "auto")
"""How a GPU cache in front of the store holds rows: as stored (compressed slots sized to the stored lengths: more
rows per byte, each hit decoded), decoded at admission (raw slots: hits at copy speed, misses still read compressed),
or ``"auto"`` (:func:`slot_form` per codec, from the timings)."""

STORED_SLOTS_MIN_RATIO = 2.0
"""From this compression ratio on, ``"auto"`` keeps compressed slots even where their hits decode slower than raw
hits read: they hold at least twice the rows. Why 2: the dense-float codecs store 1.2-1.5x, so their slots would
gain at most half again the rows while each hit cost 5-8x a raw one (H200, 2026-11-26); sparse rows (IBP, 7-25x)
gain more hits from the extra rows than their decode costs."""

ROUNDS = 3
REPS = 7
"""Each candidate is timed in ``ROUNDS`` rounds of ``REPS`` lookups, the candidates alternating round by round (so
clock or PCIe drift hits them alike): 21 samples per candidate, whose median decides."""


@dataclass(frozen=True)
class LayoutChoice:
    """What the planner chose for one table and why (``stats()['host_layout']``).

    ``method`` names the chosen candidate (:func:`candidate_names`: its codec method, ``"raw"`` when the rows are
    stored raw, e.g. ``"exponent_seg32"`` for a second exponent codec); ``timings_ms`` the median lookup time of
    every candidate timed, ``ratios`` every candidate's compression ratio on the sample (metadata
    excluded), ``samples`` how many timings each median is of, ``hit_timings_ms`` the same lookups with the rows in
    device memory. ``compressed_ms`` / ``ratio`` describe the chosen (or, for a raw choice, the best) compressed
    candidate, ``raw_ms`` the raw rows; ``slots`` says whether a cache in front of the store holds the rows as stored
    or decoded (:func:`slot_form`), ``slots_reason`` why."""

    compress: bool
    reason: str
    ratio: float
    compressed_ms: Optional[float] = None
    raw_ms: Optional[float] = None
    batch: int = 0
    host_gather_ms: Optional[float] = None  # raw rows gathered by the CPU + one copy (wall clock, ids on the CPU)
    compressed_wall_ms: Optional[float] = None  # compressed zero-copy, wall clock with the ids' copy
    method: str = ""
    timings_ms: dict = field(default_factory=dict)
    ratios: dict = field(default_factory=dict)
    samples: int = 0
    hit_timings_ms: dict = field(default_factory=dict)  # the same lookups from device memory (a cache hit)
    slots: str = "stored"  # how a cache in front of the store holds the chosen rows (SLOT_FORMS, never "auto")
    slots_reason: str = ""

    def __post_init__(self) -> None:
        if not self.method:  # the two-way form (compressed vs raw) names no codec: IBP, as it always was
            object.__setattr__(self, "method", "ibp" if self.compress else "raw")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def prefer_host_gather(choice: LayoutChoice, host_gather_ms: Optional[float], compressed_wall_ms: Optional[float],
                       margin: float = MARGIN) -> LayoutChoice:
    """For caches fed ids on the CPU: keep raw rows when the CPU's own gather + one copy beat compressed zero-copy
    reads (small rows from a large table: random reads are bound by address translation, not by bytes), so the
    transfer planner can pick that path. A raw choice stands as it is."""
    if not choice.compress or host_gather_ms is None or compressed_wall_ms is None:
        return replace(choice, host_gather_ms=host_gather_ms, compressed_wall_ms=compressed_wall_ms)
    if host_gather_ms <= compressed_wall_ms * (1.0 - margin):
        return replace(choice, compress=False, method="raw", host_gather_ms=host_gather_ms,
                       compressed_wall_ms=compressed_wall_ms, slots="stored",
                       slots_reason=slot_form("stored", "raw", 1.0, {})[1],
                       reason=f"raw rows by CPU gather {compressed_wall_ms / host_gather_ms:.2f}x faster than "
                              f"compressed zero-copy ({choice.reason})")
    return replace(choice, host_gather_ms=host_gather_ms, compressed_wall_ms=compressed_wall_ms)


def decide_layout(ratio: float, compressed_ms: Optional[float], raw_ms: Optional[float], batch: int = 0,
                  margin: float = MARGIN, min_ratio: float = MIN_RATIO) -> LayoutChoice:
    """The two-way rule (one codec against raw rows), apart from the measuring: :func:`decide_codec` with one
    compressed candidate (unit-tested with injected timings).

    No timings (no CUDA): compressed when the table compresses at all (saves host memory, costs no transfer).
    Otherwise compressed only if ``compressed_ms <= raw_ms * (1 - margin)``."""
    timed = compressed_ms is not None and raw_ms is not None
    timings = {"ibp": compressed_ms, "raw": raw_ms} if timed else {}
    return decide_codec({"ibp": ratio}, timings, allow_raw=True, batch=batch, margin=margin, min_ratio=min_ratio)


def slot_option(compress_cache: "bool | str") -> str:
    """The slot form a cache's ``compress_cache`` argument asks for: True "stored" (compressed slots), False
    "decoded" (raw slots, rows decoded at admission), ``"auto"`` the planner's call."""
    if compress_cache is True or compress_cache is False:
        return "stored" if compress_cache else "decoded"
    if compress_cache == "auto":
        return "auto"
    raise InvalidArgumentError(f"compress_cache must be True, False or 'auto', got {compress_cache!r}")


def slot_form(slots: str, method: str, ratio: float, hits: dict[str, float],
              margin: float = MARGIN) -> tuple[str, str]:
    """How a cache holds rows of candidate ``method`` (compression ``ratio``), and why: ``slots`` as asked
    (``"stored"`` / ``"decoded"``), or for ``"auto"``: as stored where their hits (``hits``: device-memory lookup
    times, key ``"raw"`` for raw rows) cost at most ``margin`` more than raw hits, or the ratio reaches
    :data:`STORED_SLOTS_MIN_RATIO`; decoded otherwise. Raw rows are the same either way: ``"stored"``."""
    if slots not in SLOT_FORMS:
        raise InvalidArgumentError(f"slots must be one of {SLOT_FORMS}, got {slots!r}")
    if method == "raw":
        return "stored", "raw rows: stored and decoded are the same"
    if slots != "auto":
        return slots, f"{slots} slots asked for"
    if method not in hits or "raw" not in hits:
        return "stored", "no hit timings (CPU): compressed slots keep the most rows"
    cost = hits[method] / hits["raw"]
    if cost <= 1.0 / (1.0 - margin):
        return "stored", f"compressed hits {cost:.2f}x raw hits: the {ratio:.2f}x rows come free"
    if ratio >= STORED_SLOTS_MIN_RATIO:
        return "stored", f"{ratio:.2f}x the rows per slot byte outweigh hits at {cost:.2f}x raw"
    return "decoded", f"compressed hits {cost:.2f}x raw hits for {ratio:.2f}x the rows: decoded at admission"


def decide_codec(ratios: dict[str, float], timings_ms: dict[str, float], *, allow_raw: bool = True,
                 batch: int = 0, samples: int = 0, margin: float = MARGIN,
                 min_ratio: float = MIN_RATIO, hit_timings_ms: Optional[dict[str, float]] = None,
                 hit_share: float = HIT_SHARE, slots: str = "stored") -> LayoutChoice:
    """The rule, apart from the measuring: which codec (``ratios``' keys, compressed methods in order of
    preference) stores a table, given each one's compression ratio and, on CUDA, the median lookup time of each and
    of raw rows (``timings_ms``, key ``"raw"``; empty without CUDA).

    * A codec whose ratio is below ``min_ratio`` is out (nothing to save). None left: raw (``allow_raw=False``, the
      caller insists on compression: the best ratio stays).
    * No timings: the smallest stored size (the largest ratio).
    * Timings: a codec must beat raw by ``margin`` (``allow_raw``), then the fastest of those wins, unless it is not
      ``margin`` faster than the one that stores the fewest bytes: equal speed keeps the smaller store
      (hysteresis, so timing noise never flips a choice for nothing).
    * ``hit_timings_ms`` (the same lookups from device memory): a codec held in compressed slots, beating raw on
      misses, must also beat raw rows by ``margin`` at a hit share of ``hit_share`` (misses and hits weighted), or
      raw rows stay: a choice near the line would flip between two builds of one table on timing noise (seen: fp16
      2 KB rows, IBP 1.05x on misses, two identical modules 21-28% apart).
    * ``slots``: how the cache holds a compressed candidate's rows (:func:`slot_form`). A candidate held decoded
      reads its hits as raw rows do, so it differs from raw rows only on misses and is judged there (already
      ``margin`` faster): weighing it at ``hit_share`` would only dilute a real gain below the margin, because the
      hit timings (one calibration batch from device memory) are latency-bound, far slower per row than the hits of
      a large step. Seen on an H200 (2 KB fp16 rows, exponent misses 1.06-1.09x raw): the blend put two identical
      modules either side of the margin (0.974x / 0.970x), and stepping in turn the compressed one ran 4-13% faster.
      With ``"auto"``, a candidate whose compressed slots pass :func:`slot_form` but do not pay at the hit share is
      held decoded instead."""
    ratio_of = dict(ratios)
    best_ratio = max(ratio_of.values(), default=1.0)
    hits = dict(hit_timings_ms or {})

    def form(m: str) -> tuple[str, str]:
        held, why = slot_form(slots, m, ratio_of.get(m, 1.0), hits, margin)
        if slots == "auto" and held == "stored" and m != "raw" and _timed(m):
            # compressed slots whose hits leave the codec no gain at the hit share: decoded ones keep the misses' gain
            if blend(timings_ms[m], hits[m]) > blend(timings_ms["raw"], hits["raw"]) * (1.0 - margin):
                return "decoded", (f"compressed hits {hits[m] / hits['raw']:.2f}x raw hits cost the misses' gain at "
                                   f"{hit_share:.0%} hits: decoded at admission")
        return held, why

    def _timed(m: str) -> bool:
        return all(k in timings_ms and k in hits for k in (m, "raw"))

    def blend(miss: float, hit: float) -> float:
        return (1.0 - hit_share) * miss + hit_share * hit

    def made(method: str, compress: bool, reason: str) -> LayoutChoice:
        r = ratio_of.get(method, best_ratio) if compress else best_ratio
        comp = [m for m in ratio_of if m in timings_ms]
        c_ms = timings_ms.get(method) if compress else min((timings_ms[m] for m in comp), default=None)
        held, why = form(method if compress else "raw")
        return LayoutChoice(compress, reason, r, c_ms, timings_ms.get("raw"), batch, method=method,
                            timings_ms=dict(timings_ms), ratios=dict(ratio_of), samples=samples,
                            hit_timings_ms=dict(hits), slots=held, slots_reason=why)

    def blended(m: str) -> float:
        return blend(timings_ms[m], hits["raw"] if form(m)[0] == "decoded" else hits[m])

    eligible = [m for m, r in ratio_of.items() if r >= min_ratio]
    if not eligible:
        if allow_raw or not ratio_of:
            return made("raw", False, f"host ratio {best_ratio:.3f} < {min_ratio}: nothing to save")
        top = max(ratio_of, key=ratio_of.get)
        return made(top, True, f"compression asked for; host ratio {best_ratio:.3f} < {min_ratio}")
    smallest = max(eligible, key=lambda m: ratio_of[m])
    if not timings_ms or any(m not in timings_ms for m in eligible) or (allow_raw and "raw" not in timings_ms):
        why = "no zero-copy path to time (CPU): " + ("compressed for host memory" if len(ratio_of) == 1
                                                     else f"{smallest}, the smallest stored size")
        return made(smallest, True, why)
    winners = eligible
    if allow_raw:
        raw = timings_ms["raw"]
        winners = [m for m in eligible if timings_ms[m] <= raw * (1.0 - margin)]
        if not winners:
            fastest = min(eligible, key=lambda m: timings_ms[m])
            noun = "compressed" if len(ratio_of) == 1 else fastest
            return made("raw", False, f"{noun} misses only {raw / timings_ms[fastest]:.2f}x of raw "
                                      f"(< {1 / (1 - margin):.2f}x)")
        if all(m in hits for m in [*winners, "raw"]):
            paying = [m for m in winners
                      if form(m)[0] == "decoded" or blended(m) <= blended("raw") * (1.0 - margin)]
            if not paying:
                best = min(winners, key=blended)
                return made("raw", False, f"{best} misses {raw / timings_ms[best]:.2f}x faster than raw, but with "
                                          f"{hit_share:.0%} cache hits it costs {blended(best) / blended('raw'):.2f}x "
                                          f"raw (hits decoded from device memory)")
            winners = paying
    fastest = min(winners, key=lambda m: timings_ms[m])
    small = max(winners, key=lambda m: ratio_of[m])
    chosen = fastest if timings_ms[fastest] <= timings_ms[small] * (1.0 - margin) else small
    if allow_raw:
        noun = "compressed" if len(ratio_of) == 1 else chosen
        reason = f"{noun} misses {timings_ms['raw'] / timings_ms[chosen]:.2f}x faster than raw"
    else:
        reason = f"{chosen} misses fastest of the compressed candidates"
    if chosen != fastest:
        reason += f" ({fastest} only {timings_ms[chosen] / timings_ms[fastest]:.2f}x of it: the smaller store stays)"
    return made(chosen, True, reason)


def candidate_names(candidates: Sequence[Codec]) -> list[str]:
    """The planner's name of each candidate: its codec method (``"ibp"``, ``"exponent"``, ``"raw"``), and for a
    further codec of a method already named, the method and its segment length (``"exponent_seg32"``): the keys of
    a :class:`LayoutChoice`'s timings and ratios, and what ``method`` says was chosen."""
    names: list[str] = []
    for codec in candidates:
        name = codec.method
        if name in names:
            seg = getattr(codec, "seg", None)
            name = f"{codec.method}_seg{seg}" if seg is not None else f"{codec.method}_{len(names)}"
        if name in names:
            raise InvalidArgumentError(f"calibrate_layout: two candidates named {name!r}")
        names.append(name)
    return names


def named_fit(name: str) -> tuple[str, Optional[int]]:
    """The codec method and segment length a :func:`candidate_names` name stands for (``"exponent_seg32"`` ->
    ``("exponent", 32)``; ``"ibp"`` -> ``("ibp", None)``): what refits the chosen candidate."""
    method, _, seg = name.partition("_seg")
    return method, int(seg) if seg else None


def pick_codec(candidates: Sequence[Codec], choice: LayoutChoice) -> Codec:
    """The candidate codec ``choice`` names (the raw codec for a raw choice)."""
    return codec_named(candidates, choice.method)


def codec_named(candidates: Sequence[Codec], name: str) -> Codec:
    """The candidate of :func:`candidate_names` name ``name``."""
    for codec, cname in zip(candidates, candidate_names(candidates)):
        if cname == name:
            return codec
    raise InternalError(f"no candidate codec named {name!r}")


def best_compressed(choice: LayoutChoice) -> str:
    """The compressed method ``choice`` would take if compression were required: the fastest timed one (CUDA),
    else the largest ratio. What codes a GPU slab in front of host rows the planner kept raw."""
    timed = {m: t for m, t in choice.timings_ms.items() if m != "raw" and m in choice.ratios}
    if timed:
        return min(timed, key=timed.get)
    if not choice.ratios:
        raise InternalError("the choice weighed no compressed codec")
    return max(choice.ratios, key=choice.ratios.get)


def _sample_rows(table: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """An evenly strided sample of up to CALIBRATION_BYTES of the table's rows (CPU, contiguous)."""
    n = int(table.shape[0])
    m = max(1, min(n, CALIBRATION_BYTES // max(row_bytes, 1)))
    idx = (torch.arange(m, dtype=torch.int64) * (n - 1)) // max(m - 1, 1)  # integer math: exact past 2**24 rows
    return table.index_select(0, idx.to(table.device)).cpu().contiguous()


def _lookup_once(ids: torch.Tensor, out: torch.Tensor, src: Any, tables: Any, dtype: torch.dtype, err: Any) -> None:
    """One zero-copy lookup of ``ids`` (all misses) through the kernel the embedding bags run: the pooling kernel
    with one id per bag where it takes the dtype, else the rows kernel."""
    from ..kernels.lookup import ElemType, PoolOp, lookup_pool, lookup_rows, pool_supported

    if pool_supported(dtype, tables.row_bytes):
        lookup_pool(ids, None, 1, ids.numel(), False, PoolOp.SUM, ElemType.of(dtype), None, out, src, tables,
                    None, err.ptr)
    else:
        lookup_rows(ids, out, src, tables, None, err.ptr)


def _time_lookup(ids: torch.Tensor, out: torch.Tensor, src: Any, tables: Any, dtype: torch.dtype, err: Any,
                 reps: int) -> list[float]:
    """CUDA-event times (ms) of ``reps`` zero-copy lookups (:func:`_lookup_once`)."""
    _lookup_once(ids, out, src, tables, dtype, err)  # compile + warm
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _lookup_once(ids, out, src, tables, dtype, err)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in times]


def _candidates(codec: "Codec | Sequence[Codec]", allow_raw: bool) -> list[Codec]:
    """The codecs to weigh: a single codec against raw rows (the two-way form), or the given ones; the raw codec is
    added when raw rows are allowed and missing, and dropped when they are not."""
    codecs = [codec] if isinstance(codec, Codec) else list(codec)
    if not codecs:
        raise InvalidArgumentError("calibrate_layout: no candidate codec")
    first = codecs[0]
    if any((c.dtype, tuple(c.row_shape)) != (first.dtype, tuple(first.row_shape)) for c in codecs):
        raise InvalidArgumentError("calibrate_layout: candidate codecs are for different rows")
    codecs = [c for c in codecs if c.method != "raw"]
    if allow_raw or not codecs:
        codecs.append(Codec.raw(first.dtype, tuple(first.row_shape)))
    return codecs


def calibrate_layout(table: torch.Tensor, codec: "Codec | Sequence[Codec]", device: torch.device,
                     batch: int = 8192, reps: int = REPS, host_paths: bool = False, allow_raw: bool = True,
                     rounds: int = ROUNDS, slots: str = "stored") -> LayoutChoice:
    """Time each candidate codec's zero-copy misses and device-memory hits, and raw rows', on a pinned sample of
    ``table`` (``[N, ...]``, any device) on ``device``; :func:`decide_codec` decides (:func:`pick_codec` then names the codec).

    ``codec``: one codec (weighed against raw rows, as the embedding bags' and FeatureCache's two-way choice is) or
    several (e.g. IBP and exponent fitted on the same rows). ``allow_raw=False``: compression was asked for, raw rows
    are not a candidate. Ratios are the sample's. Candidates are timed in alternation, ``rounds`` rounds of ``reps``
    lookups each; medians decide. ``host_paths`` (caches fed ids on the CPU): also time, wall clock from ids on the
    CPU, raw rows gathered by the CPU + one copy against the chosen codec's zero-copy reads
    (:func:`prefer_host_gather`). ``slots``: how a cache in front of the store may hold rows (:data:`SLOT_FORMS`;
    :func:`decide_codec`)."""
    from ..kernels.hashmap import IndexArgs, IndexMode
    from ..kernels.lookup import LookupErrors, RowSource

    codecs = _candidates(codec, allow_raw)
    named = dict(zip(candidate_names(codecs), codecs))
    row_bytes = codecs[0].row_bytes
    sample = _sample_rows(table, row_bytes)
    m = int(sample.shape[0])
    cuda = device.type == "cuda"
    stores: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for name, c in named.items():
        if name == "raw":
            continue
        packed = c.compress(sample, layout="inplace", pin=cuda, device=device)
        ratios[name] = (m * row_bytes) / max(int(packed.lengths.sum(dtype=torch.int64)), 1)
        stores[name] = packed
    raw_ok = "raw" in named
    timed = {name: c for name, c in named.items() if name == "raw" or ratios[name] >= MIN_RATIO}
    if not cuda or not any(name != "raw" for name in timed):
        return decide_codec(ratios, {}, allow_raw=raw_ok, batch=batch, slots=slots)
    raw = torch.empty(m * row_bytes + 16, dtype=torch.uint8, pin_memory=True)[: m * row_bytes]
    raw.copy_(sample.view(torch.uint8).reshape(-1))
    empty = torch.empty(0, dtype=torch.int64, device=device)
    index = IndexArgs(IndexMode.NONE, empty, empty, 0, 0)
    bases = torch.zeros(8, dtype=torch.int64, device=device)
    sources, hit_sources, keep = {}, {}, []
    for name in timed:
        host = raw if name == "raw" else stores[name].data
        lengths = None if name == "raw" else stores[name].lengths.to(torch.int32).to(device)
        resident = host.to(device)  # the same stored bytes as a GPU cache holds them
        keep.append(resident)
        sources[name] = RowSource(index, bases, host.data_ptr(), None, row_bytes, lengths, m)
        hit_sources[name] = RowSource(index, bases, resident.data_ptr(), None, row_bytes, lengths, m)
    ids = torch.randint(0, m, (batch,), generator=torch.Generator().manual_seed(0)).to(device)
    out = torch.empty(batch * row_bytes, dtype=torch.uint8, device=device)
    err = LookupErrors(pin=True)
    times: dict[str, list[float]] = {name: [] for name in timed}
    hit_times: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(rounds):  # alternate the candidates, round by round
        for name, c in timed.items():
            tables = c.kernel_tables(device)
            times[name] += _time_lookup(ids, out, sources[name], tables, sample.dtype, err, reps)
            hit_times[name] += _time_lookup(ids, out, hit_sources[name], tables, sample.dtype, err, reps)
    medians = {k: statistics.median(v) for k, v in times.items()}
    hit_medians = {k: statistics.median(v) for k, v in hit_times.items()}
    choice = decide_codec(ratios, medians, allow_raw=raw_ok, batch=batch, samples=rounds * reps,
                          hit_timings_ms=hit_medians, slots=slots)
    if not host_paths or not raw_ok:
        return choice
    # the compressed candidate the CPU's raw gather competes with: the chosen one, or the fastest if raw won
    method = choice.method if choice.compress else min((k for k in medians if k != "raw"), key=medians.get)
    chosen = timed[method]
    return prefer_host_gather(choice, *_time_host_gather(ids.cpu(), raw.view(m, row_bytes), out,
                                                         sources[method], chosen.kernel_tables(device),
                                                         sample.dtype, err, reps))


def _time_host_gather(ids: torch.Tensor, raw: torch.Tensor, out: torch.Tensor, src_c: Any, tables: Any,
                      dtype: torch.dtype, err: Any, reps: int) -> tuple[float, float]:
    """Wall-clock medians (ms) from ids on the CPU to rows on the GPU: raw rows by ``index_select`` into pinned
    staging + one copy, and compressed rows by the zero-copy kernel after the ids' copy."""
    staging = torch.empty((ids.numel(), raw.shape[1]), dtype=torch.uint8, pin_memory=True)
    dev = out.device

    def host() -> None:
        torch.index_select(raw, 0, ids, out=staging)
        out.view(ids.numel(), -1).copy_(staging, non_blocking=True)

    t = wall_medians({"host": host, "zero_copy": lambda: _lookup_once(ids.to(dev, non_blocking=True), out, src_c,
                                                                       tables, dtype, err)}, dev, reps)
    return t["host"], t["zero_copy"]
