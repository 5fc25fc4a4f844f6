"""The GPUs of one node as one cache: the hottest rows replicated on every GPU, the warm tail partitioned.

One process per GPU (``torchrun``), one shared compressed host store (``CompressedRows.attach``). Placement
(:func:`plan_placement`): rows sorted by hotness; a head of ``n_replicated`` rows sits in every GPU's slab, the tail
after it is dealt round-robin (rank ``k % W`` owns the k-th tail row) and each rank fills the rest of its budget with
its share, so the node holds the head plus about ``W`` budgets' worth of tail.

Serving (the peer path, CUDA): each rank's :class:`~ibpcache.cache.feature_cache.FeatureCache` owns one static slab
with slab id = its rank. The slabs are shared once through CUDA IPC (:mod:`ibpcache.kernels.ipc`: handles exchanged
with ``all_gather_object``, each opened for the reader's own GPU with lazy peer access), and every rank indexes its
peers' rows at (peer slab id, peer offset, flags)
(:meth:`FeatureCache.add_peer_rows`). So ``fetch`` is the engine's ONE lookup launch: local hits from HBM, peer
hits read over NVLink straight from the owner's slab (compressed rows decoded in the kernel, nothing on a wire),
misses zero-copy from the host store. No collective, no host sync (``validate="lazy"``): ``fetch`` is a local call.

Without peer access (CPU tensors, one rank, GPUs a process cannot see or reach, more than 8 ranks, an IPC
failure on any rank) every rank keeps an independent cache of the hottest rows that fit, and ``stats()`` says so
(``peer_access: False``, ``fallback: "independent"``, ``fallback_reason``). Fetches stay exact and local.

How much to replicate comes from per-row costs of the three sources (:func:`plan_placement`). On CUDA they are
measured at construction (``costs="measure"``, the default): every rank times fetches of rows that are local hits,
peer hits and host misses (drawn by hotness, as requests are), all ranks at once, and the ranks plan with the mean.
A peer read that is not :data:`PEER_MARGIN` cheaper than a host read gives the independent layout (no peer rows).
The placed layout is then timed against the independent one on a hotness-weighted batch; unless it is faster on the
node, every rank goes back to the independent layout. So a node cache built with measured costs fetches such a
batch no slower than independent caches would (``stats()["setup_check"]`` holds both times). Elsewhere (the CPU,
given costs) :data:`DEFAULT_COSTS` or the given costs are used as they are.

Collectives: construction and :meth:`PartitionedFeatureCache.refresh` only (every rank of the group calls them).
A refresh reallocates each rank's slab, so no rank may still read a peer slab when its owner rewrites it: ranks
finish their queued work and meet at a barrier first; no fetch may run on any rank during a refresh.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._validation import check_ids
from ..codec import Codec
from ..compressed import CompressedRows
from ..errors import IbpcacheError, InvalidArgumentError
from .entry import MAX_SLABS
from .feature_cache import FeatureCache
from .slab import usable_bytes

__all__ = ["PartitionedFeatureCache", "Placement", "plan_placement", "DEFAULT_COSTS", "PEER_MARGIN", "LOCAL", "PEER",
           "HOST"]

DEFAULT_COSTS = (1.0, 4.0, 16.0)
"""Relative time to serve one row from this GPU's slab, a peer's slab (NVLink) and the host store (PCIe): about the
ratio of HBM, NVLink and PCIe bandwidths of an H100 node. A guess: used on the CPU and wherever costs are not
measured (``PartitionedFeatureCache(costs=...)``)."""

PEER_MARGIN = 0.1
"""How much cheaper than a host read a peer read must be before ``"auto"`` placement deals out a tail. Per-row
costs come from batches of one kind of row, and a real batch overlaps its reads in other ways, so a peer read that
merely ties a host read is not trusted to win: the node keeps the independent layout instead."""

PROBE_BYTES = 256 << 20
"""Output bytes of one timed probe fetch: enough rows for several waves of warps on an H100/H200 (a latency-bound
fetch of one wave or less would overstate the per-row cost), small enough to cost milliseconds at set-up."""

PROBE_WARMUP, PROBE_REPEATS = 2, 5
"""Untimed and timed fetches of a set-up probe (the cost is the median of the timed ones), each of its own draw."""

LOCAL, PEER, HOST = 0, 1, 2
"""Where a rank reads a row (``PartitionedFeatureCache.holder``)."""


@dataclass(frozen=True)
class Placement:
    """Rows by hotness (``order``, hottest first, int64): ``order[:n_replicated]`` on every rank, the tail after
    it dealt round-robin; ``rule`` says how ``n_replicated`` was chosen. ``partitioned`` False: the costs say peer
    reads do not pay, so every rank keeps an independent cache of the hottest rows (no tail is dealt).
    ``head_bytes`` / ``budget_bytes``: the head's stored bytes and one GPU's usable budget."""

    order: torch.Tensor
    n_replicated: int
    world_size: int
    rule: str
    partitioned: bool = True
    head_bytes: int = 0
    budget_bytes: int = 0

    @property
    def replicated(self) -> torch.Tensor:
        return self.order[: self.n_replicated]

    @property
    def replicate(self) -> float:
        """The fraction of one GPU's budget the head takes (1.0: every GPU caches the same rows)."""
        if not self.partitioned:
            return 1.0
        return self.head_bytes / self.budget_bytes if self.budget_bytes else 1.0

    def priority(self, rank: int) -> torch.Tensor:
        """float64 [N] static-policy hotness for ``rank``: the head, then this rank's tail rows in hotness order
        (the slab takes them in that order until its budget is full); ``-inf`` for every other row."""
        n = self.order.numel()
        pos = torch.arange(n, dtype=torch.int64)
        mine = (pos < self.n_replicated) | ((pos - self.n_replicated) % self.world_size == rank)
        prio = torch.full((n,), float("-inf"), dtype=torch.float64)
        prio[self.order[mine]] = -pos[mine].to(torch.float64)
        return prio


def check_costs(costs: object) -> "tuple[float, float, float]":
    """Three finite positive per-row costs (local, peer, host) as floats; anything else raises."""
    try:
        vals = tuple(float(c) for c in costs)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"costs must be three numbers (local, peer, host), got {costs!r}") from None
    if len(vals) != 3 or not all(math.isfinite(c) and c > 0 for c in vals):
        raise InvalidArgumentError(f"costs must be three finite positive numbers (local, peer, host), got {costs!r}")
    return vals  # type: ignore[return-value]


def plan_placement(hotness: torch.Tensor, lengths: torch.Tensor, budget_bytes: int, world_size: int,
                   replicate: "str | float" = "auto", costs: "tuple[float, float, float]" = DEFAULT_COSTS,
                   peer_margin: float = PEER_MARGIN) -> Placement:
    """How many of the hottest rows every GPU replicates; the rest of each budget holds a share of the tail.

    ``lengths``: stored bytes of every row in the slab format; ``budget_bytes``: one GPU's slab budget.
    ``replicate``: a float in [0, 1] gives that fraction of the budget to the head (0: a pure partition, 1: every
    GPU caches the same rows); ``"auto"`` picks the head size that minimises the expected time per request
    ``sum(hotness * cost)``, a row costing ``costs[0]`` from this GPU's slab, ``costs[1]`` from a peer's and
    ``costs[2]`` from the host: a tail row cached on the node is local on one rank in ``W`` and a peer hit on the
    others, so growing the head trades peer hits on hot rows for host misses on the rows it pushes off the node.
    Every candidate head size is evaluated at once with prefix sums (construction time only).

    With ``"auto"``, a peer read that is not ``peer_margin`` cheaper than a host read gives the independent layout
    (``partitioned=False``: each GPU its own hottest rows). That is also where the cost model itself lands when a
    peer read costs what a host read does: moving a head row to the tail then turns it into a peer read for
    ``W - 1`` ranks to save at most ``W - 1`` colder host reads, which never pays; the margin keeps a peer read
    that only measured a little cheaper from being trusted.
    """
    hot = torch.as_tensor(hotness).reshape(-1).to(torch.float64).cpu()
    lens = torch.as_tensor(lengths).reshape(-1).to(torch.int64).cpu()
    if hot.numel() != lens.numel():
        raise InvalidArgumentError(f"hotness must have one score per row ({lens.numel()}), got {hot.numel()}")
    if world_size < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
    c_local, c_peer, c_host = check_costs(costs)
    if isinstance(peer_margin, bool) or not 0.0 <= float(peer_margin) < 1.0:
        raise InvalidArgumentError(f"peer_margin must be in [0, 1), got {peer_margin!r}")
    order = torch.argsort(hot, descending=True, stable=True)
    budget = usable_bytes(int(budget_bytes))
    csum = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens[order], 0)])  # bytes of the k hottest
    max_head = int(torch.searchsorted(csum, torch.tensor([budget]), right=True)) - 1  # head rows that fit

    def placement(n_head: int, rule: str, partitioned: bool = True) -> Placement:
        return Placement(order, n_head, world_size, rule, partitioned, int(csum[n_head]), budget)

    if isinstance(replicate, str):
        if replicate != "auto":
            raise InvalidArgumentError(f"replicate must be 'auto' or a fraction in [0, 1], got {replicate!r}")
        if world_size == 1:
            return placement(max_head, "one rank: every cached row is local")
        costs_txt = f"costs={(c_local, c_peer, c_host)}"
        if c_peer > (1.0 - float(peer_margin)) * c_host:
            return placement(max_head, f"independent: a peer read is not {float(peer_margin):.0%} cheaper than a "
                                       f"host read ({costs_txt})", partitioned=False)
        weight = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(hot[order].clamp_min(0), 0)])
        heads = torch.arange(max_head + 1)
        tail_end = torch.searchsorted(csum, csum[heads] + world_size * (budget - csum[heads]), right=True) - 1
        tail_end = tail_end.clamp(max=order.numel())
        tail_cost = (c_local + (world_size - 1) * c_peer) / world_size
        expected = (weight[heads] * c_local + (weight[tail_end] - weight[heads]) * tail_cost
                    + (weight[-1] - weight[tail_end]) * c_host)
        n_head = int(torch.argmin(expected))  # the smallest head among equals: the most node capacity
        return placement(n_head, f"auto: least expected cost, {costs_txt}")
    frac = float(replicate)
    if isinstance(replicate, bool) or not 0.0 <= frac <= 1.0:
        raise InvalidArgumentError(f"replicate must be 'auto' or a fraction in [0, 1], got {replicate!r}")
    n_head = int(torch.searchsorted(csum, torch.tensor([int(frac * budget)]), right=True)) - 1
    return placement(n_head, f"replicate={frac} of the budget")


class PartitionedFeatureCache:
    """This rank's part of a node-wide cache over ``rows``; ``fetch`` returns any rows, bit-exact, locally.

    ``rows``: a tensor, or (usually) a CompressedRows every rank attached from one shared store. ``hotness``: a
    score per row, the same on every rank. ``budget_bytes``: each rank's slab, as FeatureCache takes it. ``device``:
    this rank's GPU (or the CPU: independent caches). ``group``: the ranks of this node (default: the world).
    ``replicate``: see :func:`plan_placement`. ``costs``: per-row costs (local, peer, host) for ``"auto"``
    placement, or ``"measure"`` (default): timed on CUDA at construction with peer access, then kept for every
    refresh (:data:`DEFAULT_COSTS` where nothing can be timed: the CPU, one rank, no peers); with ``"measure"`` the
    placed layout must also fetch a hotness-weighted batch faster than the independent one or the node keeps the
    independent one (module docstring). ``track_sources``: count local hits, peer hits and host
    misses per fetch (a few small device reductions; no sync); off, ``stats()`` reports only the node hit rate.
    ``cache_kwargs`` go to each rank's FeatureCache (a planned codec is chosen by rank 0 and shared, so every rank
    stores the table the same way, as peers' entries require).
    """

    def __init__(self, rows: Any, hotness: torch.Tensor, budget_bytes: "int | float", device: "str | torch.device",
                 group: "dist.ProcessGroup | None" = None, *, replicate: "str | float" = "auto",
                 costs: "tuple[float, float, float] | str" = "measure", track_sources: bool = True,
                 **cache_kwargs: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if isinstance(costs, str):
            if costs != "measure":
                raise InvalidArgumentError(f"costs must be 'measure' or three numbers (local, peer, host), "
                                           f"got {costs!r}")
            self._measure, self.costs = True, DEFAULT_COSTS
            self.costs_rule = "default: not measured"
        else:
            self._measure, self.costs = False, check_costs(costs)
            self.costs_rule = "given"
        self.replicate, self.track_sources = replicate, bool(track_sources)
        self.source_costs_us_per_row: "dict[str, Any] | None" = None  # what the probe timed (None: not timed)
        self.setup_check: "dict[str, Any] | None" = None  # placed vs independent layout on one weighted batch
        hot = torch.as_tensor(hotness).reshape(-1).to(torch.float64).cpu()
        if torch.device(device).type == "cuda":  # no host sync per fetch: the lookup kernel checks ids
            cache_kwargs.setdefault("validate", "lazy")
        cache_kwargs.setdefault("slab_id", self.rank if self.world_size <= MAX_SLABS else 0)
        # first built as an independent cache (the hottest rows that fit): what the fallback keeps
        self.cache = self._build_cache(rows, budget_bytes, hot, device, cache_kwargs)
        self.device = self.cache.device
        self.n_rows, self.row_bytes = self.cache.n_rows, self.cache.row_bytes
        self._gpu = (self.device.index if self.device.index is not None else torch.cuda.current_device()
                     ) if self.device.type == "cuda" else -1
        self._local_hits = torch.zeros(2, dtype=torch.int64, device=self.device)  # local hits, peer hits
        self._source_codes = torch.tensor([LOCAL, PEER], dtype=torch.uint8, device=self.device)
        self._peer_maps: dict[int, Any] = {}  # rank -> its slab mapped for this GPU (kernels.ipc.PeerMapping)
        self._peer_ids = torch.empty(0, dtype=torch.int64)
        self.requests = 0
        self._place(hot, built_with_hot=True)

    # ------------------------------------------------------------------------------------------------
    # construction and refresh (collectives)
    # ------------------------------------------------------------------------------------------------

    def _build_cache(self, rows: Any, budget_bytes: "int | float", hotness: torch.Tensor,
                     device: "str | torch.device", kwargs: dict[str, Any]) -> FeatureCache:
        """This rank's FeatureCache; a planned codec choice is made by the group's rank 0 and shared (one
        broadcast), so every rank stores the table the same way."""
        def build(**kw: Any) -> FeatureCache:
            return FeatureCache(rows, budget_bytes=budget_bytes, policy="static", hotness=hotness, device=device, **kw)

        planned = not isinstance(rows, CompressedRows) and "auto" in (kwargs.get("codec"), kwargs.get("compress_host"))
        if not planned:
            return build(**kwargs)
        cache = build(**kwargs) if self.rank == 0 else None
        msg: list[Any] = [None]
        if cache is not None:
            codec = cache.codec
            msg[0] = (None if codec is None else (codec.header(), [np.ascontiguousarray(a) for a in codec.sections()]),
                      bool(cache.compress_host), dict(cache.host_layout))
        dist.broadcast_object_list(msg, group=self.group, group_src=0)
        desc, compress_host, layout = msg[0]
        if cache is None:
            codec = None if desc is None else Codec.from_header(desc[0], *desc[1])
            cache = build(**{**kwargs, "codec": codec, "compress_host": compress_host})
            cache.host_layout = {**layout, "chosen_by": "rank 0 of the group"}
        return cache

    def _gather(self, obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def _place(self, hot: torch.Tensor, built_with_hot: bool) -> None:
        """Plan the placement; where every rank can reach its peers' slabs, restock to it and map the peers, else
        keep (or restock to) an independent cache of the hottest rows. With ``costs="measure"`` on CUDA, the first
        placement with peer access times the three sources, plans again with the measured costs and keeps the
        result only if it beats the independent layout (module docstring). Collective."""
        timing = self._timing
        baseline = None
        if timing and built_with_hot:  # the independent layout is in place now: time it first
            batches = self._probe_batches(hot, torch.arange(self.n_rows))
            baseline = (batches, self._time_fetch(batches))
        self._apply(self._plan(hot), hot, built_with_hot)
        if timing and self.source_costs_us_per_row is None and self.peer_access:
            measured = self._measure_costs(hot)
            if measured is not None:
                self.costs, self.costs_rule = measured, "measured"
                again = self._plan(hot)
                if (again.n_replicated, again.partitioned) != (self.placement.n_replicated, self.placement.partitioned):
                    self._quiesce()
                    self._apply(again, hot, built_with_hot=False)
                else:
                    self.placement = again  # same rows; the rule names the measured costs
        if baseline is not None and self.peer_access:
            self._check_against_independent(hot, *baseline)
        self.cache.reset_stats()  # the build's own check reads are not requests

    @property
    def _timing(self) -> bool:
        """Costs and the set-up check are timed here: measured costs asked for, CUDA, peers, ``"auto"`` placement."""
        return self._measure and self.device.type == "cuda" and self.world_size > 1 and self.replicate == "auto"

    def _plan(self, hot: torch.Tensor) -> Placement:
        return plan_placement(hot, self.cache.cache_lengths, self.cache.budget_bytes, self.world_size,
                              self.replicate, self.costs)

    def _apply(self, placement: Placement, hot: torch.Tensor, built_with_hot: bool) -> None:
        """Restock this rank's slab to ``placement`` and map the peers' (or keep an independent cache where a rank
        cannot, or where the placement deals no tail). Collective. No rank may be reading a peer slab."""
        self.placement = placement
        self._peer_ids = torch.empty(0, dtype=torch.int64)
        if not placement.partitioned:  # decided from costs every rank shares: no collective needed to agree
            self.fallback_reason = f"{self.costs_rule} costs: {placement.rule}"
            if not built_with_hot:
                self.cache.restock(hot)
                self._unmap_peers()
            self._where = self._where_table()
            return
        reasons = [r for r in self._gather(self._peer_blocker()) if r is not None]
        self.fallback_reason = reasons[0] if reasons else None
        if self.fallback_reason is None:
            self.cache.restock(placement.priority(self.rank))
            self._unmap_peers()  # restock dropped the old peer rows
            self.fallback_reason = self._map_peers()
            if self.fallback_reason is not None:  # some rank could not map its peers: every rank falls back
                self.cache.restock(hot)
        elif not built_with_hot:
            self.cache.restock(hot)
            self._unmap_peers()
        self._where = self._where_table()

    def _quiesce(self) -> None:
        """Every rank's queued fetches done, then a barrier: past it no rank reads a peer slab. Collective."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def _to_independent(self, hot: torch.Tensor, reason: "str | None") -> None:
        """Every rank back to an independent cache of the hottest rows, peers unmapped. Collective."""
        self._quiesce()
        self.cache.restock(hot)
        self._unmap_peers()
        self._peer_ids = torch.empty(0, dtype=torch.int64)
        self.fallback_reason = reason
        self._where = self._where_table()
        dist.barrier(group=self.group)  # every rank has unmapped its peers before any maps a new slab

    # ------------------------------------------------------------------------------------------------
    # set-up timing (CUDA; syncs, construction only)
    # ------------------------------------------------------------------------------------------------

    def _probe_rows(self) -> int:
        return int(min(max(PROBE_BYTES // max(self.row_bytes, 1), 16384), 131072))

    def _probe_batches(self, hot: torch.Tensor, pool: torch.Tensor) -> list[torch.Tensor]:
        """``PROBE_WARMUP + PROBE_REPEATS`` batches of :meth:`_probe_rows` ids from ``pool``, each drawn anew with
        probability ~ hotness (uniform where ``pool`` holds no positive hotness), seeded per rank and draw, on the
        device: what requests for those rows look like. A new draw per timed fetch, as a trace's batches differ: a
        batch fetched again would be timed from what L2 kept of it (a probe of compressed rows can fit there)."""
        gen = torch.Generator().manual_seed(9176 + self.rank)
        return [_weighted_sample(pool, hot, self._probe_rows(), gen).to(self.device)
                for _ in range(PROBE_WARMUP + PROBE_REPEATS)]

    def _time_fetch(self, batches: list[torch.Tensor]) -> float:
        """Median microseconds of a fetch of one of ``batches`` (the first ``PROBE_WARMUP`` untimed) on this rank
        while every rank fetches its own (the ranks start together, as they fetch in training). CUDA events,
        construction only (syncs). Collective."""
        out = torch.empty((batches[0].numel(), *self.cache.row_shape), dtype=self.cache.dtype, device=self.device)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in batches]
        for ids, (start, end) in zip(batches, marks):
            start.record()
            self.cache.fetch(ids, out[:ids.numel()])
            end.record()
        marks[-1][1].synchronize()
        self.cache.check_errors()
        return 1e3 * float(np.median([a.elapsed_time(b) for a, b in marks[PROBE_WARMUP:]]))

    def _measure_costs(self, hot: torch.Tensor) -> "tuple[float, float, float] | None":
        """Per-row microseconds of a local hit, a peer hit and a host miss, the mean over ranks (so every rank
        plans the same placement): each rank times :meth:`_probe_rows` rows of each kind drawn by hotness from the
        rows it reads that way. None (default costs kept) where some rank has no local or no peer rows. A node
        that caches every row has no misses to time: a host read is then taken as ``DEFAULT_COSTS``' ratio to a
        local one. Collective."""
        where = self._where.cpu()
        pools = [torch.nonzero(where == kind).reshape(-1) for kind in (LOCAL, PEER, HOST)]
        have = [all(flags) for flags in zip(*self._gather([p.numel() > 0 for p in pools]))]
        if not (have[LOCAL] and have[PEER]):
            self.costs_rule = "default (no local or no peer rows to time)"
            return None
        mine = [self._time_fetch(self._probe_batches(hot, pool)) / self._probe_rows() if ok else None
                for pool, ok in zip(pools, have)]
        everyone = self._gather(mine)
        us = [float(np.mean([r[k] for r in everyone])) if have[k] else None for k in range(3)]
        note = "timed"
        if us[HOST] is None:
            us[HOST] = us[LOCAL] * DEFAULT_COSTS[HOST] / DEFAULT_COSTS[LOCAL]
            note = "host: no misses to time, DEFAULT_COSTS' ratio to a local read"
        costs = tuple(max(float(c), 1e-9) for c in us)
        self.source_costs_us_per_row = {"local": costs[LOCAL], "peer": costs[PEER], "host": costs[HOST],
                                        "rows_per_probe": self._probe_rows(), "per_rank": everyone, "note": note}
        return costs  # type: ignore[return-value]

    def _check_against_independent(self, hot: torch.Tensor, batches: list[torch.Tensor],
                                   independent_us: float) -> None:
        """Time ``batches`` (hotness-weighted draws) on the placed layout; unless the node fetches them faster than
        it did on the independent layout (times summed over ranks), every rank goes back to that layout.
        Collective."""
        placed_us = self._time_fetch(batches)
        times = self._gather((independent_us, placed_us))
        indep, placed = sum(t[0] for t in times), sum(t[1] for t in times)
        kept = "placed" if placed < indep else "independent"
        self.setup_check = {"batch_rows": int(batches[0].numel()), "independent_us": [t[0] for t in times],
                            "placed_us": [t[1] for t in times], "speedup": indep / placed if placed else None,
                            "kept": kept}
        if kept == "independent":
            self._to_independent(hot, f"set-up check: the placed layout fetched a hotness-weighted batch in "
                                      f"{placed:.0f} us (sum over ranks) vs {indep:.0f} us independent")

    def _peer_blocker(self) -> "str | None":
        """Why this rank cannot read its peers' slabs directly (None: it can try)."""
        if self.world_size == 1:
            return "one rank: no peers"
        if self.device.type != "cuda":
            return "CPU tensors: no peer access"
        if self.world_size > MAX_SLABS:
            return f"{self.world_size} ranks: the cache entry names at most {MAX_SLABS} slabs"
        me = (socket.gethostname(), self._gpu, _uuid(self._gpu))
        peers = self._gather(me)
        if len({host for host, _, _ in peers}) > 1:
            return "ranks on several hosts"
        for host, index, uuid in peers:
            if index >= torch.cuda.device_count() or _uuid(index) != uuid:
                return f"peer GPU {index} is not visible to this process the same way (CUDA_VISIBLE_DEVICES)"
            if index != self._gpu and not torch.cuda.can_device_access_peer(self._gpu, index):
                return f"GPU {self._gpu} cannot access peer GPU {index}"
        return None

    def _map_peers(self) -> "str | None":
        """Export this rank's slab through CUDA IPC, map every peer's for this rank's GPU and index the peers' rows.
        Returns why it failed on any rank (then no rank keeps peer rows), None on success."""
        from ..kernels.ipc import export_tensor, open_peer

        torch.cuda.synchronize(self.device)  # the slab is filled before a peer may read it
        ids, entries = self.cache.own_entries()
        keep = ~torch.isin(ids, self.placement.replicated)  # peers hold the head themselves
        data = self.cache.slab.data
        export = export_tensor(data) if data.numel() else None
        shared = self._gather((self.rank, self._gpu, export, ids[keep], entries[keep]))
        err: "str | None" = None
        try:
            for rank, _index, exp, _, _ in shared:
                if rank != self.rank and exp is not None:
                    self._peer_maps[rank] = open_peer(exp, self._gpu)
        except Exception as exc:  # any CUDA IPC failure: every rank falls back together
            err = f"CUDA IPC failed on rank {self.rank}: {type(exc).__name__}: {exc}"
        errors = [e for e in self._gather(err) if e is not None]
        if errors:
            self._unmap_peers()
            return errors[0]
        peers = [s for s in shared if s[0] in self._peer_maps]
        none = [torch.empty(0, dtype=torch.int64)]
        self._peer_ids = torch.cat([s[3] for s in peers] or none)
        self.cache.add_peer_rows(self._peer_ids, torch.cat([s[4] for s in peers] or none),
                                 {rank: m.tensor for rank, m in self._peer_maps.items()})
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank indexes its peers before any fetch reads them
        bad = self._check_peer_reads()
        errors = [e for e in self._gather(bad) if e is not None]
        if errors:
            self.cache.add_peer_rows(none[0], none[0], {})
            self._peer_ids = none[0]
            self._unmap_peers()
            return errors[0]
        return None

    def _unmap_peers(self) -> None:
        """Close this rank's mappings of peer slabs (the index no longer points into them)."""
        for mapping in self._peer_maps.values():
            mapping.close()
        self._peer_maps = {}

    def _check_peer_reads(self, k: int = 64) -> "str | None":
        """Read a few peer rows through the lookup and compare them with the host store's bytes: a mapping that
        reads wrong is caught at build time, never served (construction only: this syncs)."""
        if not self._peer_ids.numel():
            return None
        pick = self._peer_ids[torch.linspace(0, self._peer_ids.numel() - 1, min(k, self._peer_ids.numel())).long()]
        got = self.cache.fetch(pick.to(self.device)).view(torch.uint8).reshape(pick.numel(), -1).cpu()
        self.cache.check_errors()
        want = self.cache.host.raw_rows(pick).cpu()
        if not torch.equal(got, want):
            return f"rank {self.rank}: rows read from peer slabs differ from the host store"
        return None

    def _where_table(self) -> torch.Tensor:
        """uint8 [N] on the device: where this rank reads each row (LOCAL, PEER, HOST)."""
        where = torch.full((self.n_rows,), HOST, dtype=torch.uint8)
        where[self._peer_ids] = PEER
        where[self.cache.cached_ids.cpu()] = LOCAL
        return where.to(self.device)

    def refresh(self, hotness: torch.Tensor) -> None:
        """Recompute the placement for a new ``hotness`` and rebuild every rank's slab and index. Collective.

        Every rank first finishes its queued work (fetches that read peer slabs) and meets the others at a barrier:
        only then may any rank reallocate its slab. No fetch may run on any rank until ``refresh`` returns."""
        hot = torch.as_tensor(hotness).reshape(-1).to(torch.float64).cpu()
        if hot.numel() != self.n_rows:
            raise InvalidArgumentError(f"hotness must have one score per row ({self.n_rows}), got {hot.numel()}")
        pending = self._drain()
        dist.barrier(group=self.group)  # no rank reads a peer slab past this point
        if self._timing:  # the set-up check times the independent layout first, as at construction
            self._to_independent(hot, None)
        self._place(hot, built_with_hot=self._timing)
        self.reset_stats()
        if pending is not None:  # raised once every rank is through (no rank left waiting at a barrier)
            raise pending

    def close(self) -> None:
        """Stop reading peer slabs, on every rank together (collective): afterwards any rank may free its cache.
        Fetches still work, from this rank's own slab and the host store."""
        pending = self._drain()
        dist.barrier(group=self.group)  # no rank reads a peer slab past this point
        none = torch.empty(0, dtype=torch.int64)
        if self.cache.peer_rows:
            self.cache.add_peer_rows(none, none, {})
        self._unmap_peers()
        self._peer_ids = none
        self._where = self._where_table()
        dist.barrier(group=self.group)  # every rank has unmapped its peers before any frees its slab
        if pending is not None:
            raise pending

    def _drain(self) -> "IbpcacheError | None":
        """Wait for this rank's queued fetches (those may read peer slabs); the error one of them met, if any, is
        returned for the caller to raise after its collectives, so no peer is left waiting."""
        try:
            self.cache.check_errors()
        except IbpcacheError as exc:
            return exc
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return None

    # ------------------------------------------------------------------------------------------------
    # fetch and stats (local: no collective)
    # ------------------------------------------------------------------------------------------------

    @property
    def peer_access(self) -> bool:
        return self.fallback_reason is None

    @property
    def node_cached_rows(self) -> int:
        """Distinct rows cached on this node's GPUs as this rank sees them (its own + the peers' it indexes); with
        the fallback, this rank's own rows only."""
        return int(self.cache.capacity_rows) + int(self._peer_ids.numel())

    @property
    def holder(self) -> torch.Tensor:
        """uint8 [N] on the device: LOCAL (0), PEER (1) or HOST (2), where this rank reads each row."""
        return self._where

    def fetch(self, ids: torch.Tensor, out: "torch.Tensor | None" = None) -> torch.Tensor:
        """``rows[ids]`` on this rank's device, bit-exact, in request order (global ids, duplicates fine).

        Not a collective: ONE lookup launch reads local hits, peer hits (over NVLink, from the owner's slab) and host
        misses. On CUDA ids are checked in the kernel (``validate="lazy"``, no host sync): a bad id raises
        :class:`~ibpcache.errors.InvalidIdsError` from a later fetch, ``check_errors()`` or ``stats()``."""
        out = self.cache.fetch(ids, out)
        if self.track_sources and out.shape[0]:
            w = self._where[check_ids(ids, self.n_rows, self.device, check_range=False).clamp(0, self.n_rows - 1)]
            # one compare against both codes and one sum: few launches on the fetch thread, which shares the host
            self._local_hits += (w.unsqueeze(1) == self._source_codes).sum(0)
        self.requests += int(out.shape[0])
        return out

    def check_errors(self) -> None:
        """Wait for this rank's queued fetches; raise a bad id or corrupt row one of them met."""
        self.cache.check_errors()

    def stats(self) -> dict[str, Any]:
        """This rank's view of the node cache. Syncs the device.

        ``hit_rate``: (local + peer hits) / requests, counted by the lookup kernel (the node's hit rate).
        ``local_hits`` / ``peer_hits`` / ``host_misses``: where this rank's requested ids were read (None with
        ``track_sources=False``). ``replicated_rows``: the head every GPU holds; ``owned_rows``: this rank's share of
        the tail; ``node_cached_rows``: rows this rank reads from some GPU. ``peer_access`` False means independent
        caches (``fallback`` and ``fallback_reason`` say why). ``replicate``: the fraction of one GPU's budget the
        head takes (1.0 for independent caches). ``placement_costs``: the per-row costs (local, peer, host) the
        placement was planned with and ``costs_rule`` where they came from (``measured``, ``given``, default);
        ``source_costs_us_per_row``: what the set-up probe timed, in microseconds per row (None if nothing was
        timed); ``setup_check``: the placed vs the independent layout on one hotness-weighted batch (None if not
        run). ``local``: the FeatureCache's own stats."""
        if self.device.type == "cuda":  # fetches may run on other threads' streams (a loader's fetch thread)
            torch.cuda.synchronize(self.device)
        st = self.cache.stats()
        local = peer = miss = None
        if self.track_sources:
            local, peer = (int(v) for v in self._local_hits.tolist())
            miss = self.requests - local - peer
        cached = self.cache.cached_ids.cpu()
        replicated = (int(torch.isin(cached, self.placement.replicated).sum()) if self.peer_access
                      else int(cached.numel()))
        return {"rank": self.rank, "world_size": self.world_size, "requests": st["requests"],
                "hit_rate": st["hit_rate"], "local_hits": local, "peer_hits": peer, "host_misses": miss,
                "rows_cached_here": int(self.cache.capacity_rows), "replicated_rows": replicated,
                "owned_rows": int(cached.numel()) - replicated, "node_cached_rows": self.node_cached_rows,
                "placement_rule": self.placement.rule if self.peer_access else "independent: hottest rows that fit",
                "peer_access": self.peer_access, "fallback": None if self.peer_access else "independent",
                "fallback_reason": self.fallback_reason,
                "replicate": self.placement.replicate if self.peer_access else 1.0,
                "placement_costs": self.costs, "costs_rule": self.costs_rule,
                "source_costs_us_per_row": self.source_costs_us_per_row, "setup_check": self.setup_check, "local": st}

    def reset_stats(self) -> None:
        """Zero this rank's counters and its FeatureCache's (contents stay). Not a collective."""
        self._local_hits.zero_()
        self.requests = 0
        self.cache.reset_stats()


def _weighted_sample(pool: torch.Tensor, hotness: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` ids from ``pool`` (int64) with probability ~ ``hotness`` of each (negative counts as 0; uniform where
    nothing in ``pool`` is positive or the sum is not finite): an inverse-CDF lookup, any pool size."""
    weight = hotness[pool].clamp_min(0)
    cdf = torch.cumsum(weight, 0)
    total = float(cdf[-1]) if cdf.numel() else 0.0
    if not (total > 0 and math.isfinite(total)):
        return pool[torch.randint(0, pool.numel(), (n,), generator=gen)]
    u = torch.rand(n, generator=gen, dtype=torch.float64) * total
    return pool[torch.searchsorted(cdf, u, right=True).clamp(max=pool.numel() - 1)]


def _uuid(index: int) -> str:
    """A GPU's UUID as this process sees device ``index`` (to tell that ranks name the same GPUs alike)."""
    return str(torch.cuda.get_device_properties(index).uuid)


