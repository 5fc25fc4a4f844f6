"""GPU slab caches across the GPUs of one node: each rank caches a disjoint hot set, peers serve each other.

One process per GPU (``torchrun``), one shared compressed host store (``CompressedRows.attach``). Rows are dealt
to ranks round-robin down the hotness order (rank ``k % W`` gets the k-th hottest row), and each rank's
:class:`~ibpcache.cache.feature_cache.FeatureCache` is a static cache over its share only (other rows get hotness
``-inf``: never admitted). So the node caches about the ``W x capacity`` hottest rows instead of every GPU caching
the same ones: the node's cache capacity is W times one GPU's.

``fetch(ids)`` (a collective: every rank calls it, each with its own ids) routes each id:

* cached on this rank, or cached nowhere -> this rank's FeatureCache (slab hit, or a zero-copy read of the shared
  host store: a miss never crosses to a peer);
* cached on a peer -> asked from that peer with ``all_to_all_single`` (counts first, then ids, then rows; NCCL over
  NVLink on GPUs, gloo on CPU), served from its slab, sent back as decoded rows.

The counts exchange needs one host sync per fetch (split sizes are data-dependent); the rest is device work.
Rows travel decoded (bit-exact either way); sending them compressed is left for when NVLink, not decode, bounds it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._validation import check_ids
from ..codec import Codec
from ..compressed import CompressedRows
from ..errors import InvalidIdsError
from .feature_cache import FeatureCache

__all__ = ["PartitionedFeatureCache", "deal_rows"]


def deal_rows(hotness: torch.Tensor, world_size: int) -> torch.Tensor:
    """Owner rank of every row: round-robin down the hotness order (hottest first, ties by id)."""
    order = torch.argsort(hotness.reshape(-1).to(torch.float64), descending=True, stable=True)
    owner = torch.empty(order.numel(), dtype=torch.int64)
    owner[order] = torch.arange(order.numel()) % world_size
    return owner


class PartitionedFeatureCache:
    """This rank's share of a node-wide cache over ``rows``; ``fetch`` returns any rows, bit-exact. Collective.

    ``budget_bytes`` is each rank's slab, as :class:`~ibpcache.cache.feature_cache.FeatureCache` takes it: a float in
    (0, 1] is a fraction of the whole table's raw bytes, an int >= 1 a byte count; a budget that holds no stored row
    of the table raises on every rank (each rank checks the same table and budget, before any exchange).

    ``cache_kwargs`` go to each rank's FeatureCache. Any codec serves (IBP, exponent coding, raw; a shared
    CompressedRows keeps its own). Where the planner would choose (``codec="auto"`` or ``compress_host="auto"`` for a
    tensor of rows), rank 0 of the group chooses once, timing its own fetch, and every other rank takes that codec
    and layout (sent as ``header()`` + ``sections()``): ranks never store one table differently because their
    timings differed by noise.
    """

    def __init__(self, rows: Any, hotness: torch.Tensor, budget_bytes: "int | float", device: "str | torch.device",
                 group: "dist.ProcessGroup | None" = None, **cache_kwargs: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        hot = torch.as_tensor(hotness).reshape(-1).to(torch.float64).cpu()
        owner = deal_rows(hot, self.world_size)
        mine = torch.where(owner == self.rank, hot, torch.full_like(hot, float("-inf")))
        if torch.device(device).type == "cuda":  # fetch checks every id first: the inner lookups need not sync again
            cache_kwargs.setdefault("validate", "lazy")
        self.cache = self._build_cache(rows, budget_bytes, mine, device, cache_kwargs)
        self.device = self.cache.device
        self.n_rows, self.row_bytes = self.cache.n_rows, self.cache.row_bytes
        self.holder = self._holders()
        cached = self.cache.cached_ids
        self._filler = torch.tensor(int(cached[0]) if cached.numel() else 0, dtype=torch.int64, device=self.device)
        self._counts = torch.zeros(3, dtype=torch.int64, device=self.device)  # peer hits, local hits, host misses
        self.requests = 0  # ids this rank asked for
        self.peer_rows = 0  # ids this rank got from peers (== peer hits)
        self.served_rows = 0  # ids this rank served to peers
        self.bytes_received = 0  # row bytes that came from peers
        self.bytes_sent_total = self.bytes_received_total = 0  # headers + ids + rows, each way

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

    def _holders(self) -> torch.Tensor:
        """int32 [N] on the device: the rank whose GPU caches each row, -1 where none does (exchanged once)."""
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, self.cache.cached_ids.cpu(), group=self.group)
        holder = torch.full((self.n_rows,), -1, dtype=torch.int32)
        for r, ids in enumerate(everyone):
            holder[ids] = r
        return holder.to(self.device)

    @property
    def node_cached_rows(self) -> int:
        return int((self.holder >= 0).sum())

    def _a2a(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        recv = torch.empty((sum(recv_splits), *send.shape[1:]), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=self.group)
        return recv

    def fetch(self, ids: torch.Tensor) -> torch.Tensor:
        """``rows[ids]`` on this rank's device (global ids, duplicates fine). Every rank must call it together.

        Bad ids (negative, out of range, wrong dtype or shape) raise :class:`InvalidIdsError` on *every* rank: the
        range check rides in the counts exchange, so a rank with bad ids never leaves its peers waiting in a
        collective. (A wrong dtype or shape raises before any exchange, on that rank only: a caller bug.)
        """
        ids = check_ids(ids, self.n_rows, self.device, check_range=False)
        bad = ((ids < 0) | (ids >= self.n_rows)).any()
        h = self.holder[ids.clamp(0, self.n_rows - 1)].to(torch.int64)
        remote = (h >= 0) & (h != self.rank)
        dest = torch.where(remote, h, torch.full_like(h, self.rank))
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world_size)
        send_counts[self.rank] = 0
        # header row k for rank k: (ids this rank asks of k, whether this rank's ids are bad)
        header = torch.stack([send_counts, bad.to(torch.int64).expand(self.world_size)], dim=1)
        recv_header = self._a2a(header, [1] * self.world_size, [1] * self.world_size)
        sc, head = send_counts.tolist(), recv_header.tolist()  # the one host sync: split sizes (+ the bad flags)
        rc = [int(c) for c, _ in head]
        self._raise_bad(ids, [r for r, (_, flag) in enumerate(head) if flag])
        n_remote = sum(sc)
        self._counts += torch.stack([remote.sum(), (h == self.rank).sum(), (h < 0).sum()])
        wanted = self._a2a(ids[order[dest[order] != self.rank]], sc, rc)  # grouped by destination rank
        served = self.cache.fetch(wanted).view(torch.uint8).reshape(-1, self.row_bytes)
        got = self._a2a(served, rc, sc)
        out = torch.empty((ids.numel(), *self.cache.row_shape), dtype=self.cache.dtype, device=self.device)
        # every position is fetched in place (no scatter of the whole batch): a peer's id is replaced by a row
        # cached here, a cheap slab hit, and overwritten with what the peer sent
        self.cache.fetch(torch.where(remote, self._filler, ids), out=out)
        if n_remote:
            remote_pos = order[dest[order] != self.rank]
            words = _widest_view(out.view(torch.uint8).reshape(ids.numel(), self.row_bytes))
            words.index_copy_(0, remote_pos, _widest_view(got))
        n_served = sum(rc)
        self.requests += int(ids.numel())
        self.peer_rows += n_remote
        self.served_rows += n_served
        self.bytes_received += n_remote * self.row_bytes
        header_bytes = 2 * 8 * (self.world_size - 1)
        self.bytes_sent_total += header_bytes + 8 * n_remote + n_served * self.row_bytes
        self.bytes_received_total += header_bytes + 8 * n_served + n_remote * self.row_bytes
        return out

    def _raise_bad(self, ids: torch.Tensor, bad_ranks: list[int]) -> None:
        """Every rank raises when any rank passed bad ids (all of them saw the flags in the same exchange)."""
        if not bad_ranks:
            return
        if self.rank in bad_ranks:
            check_ids(ids, self.n_rows, self.device)  # raises InvalidIdsError naming the bad id and the range
        raise InvalidIdsError(f"ids out of range [0, {self.n_rows}) on rank(s) {bad_ranks}: the partitioned fetch "
                              f"fails on every rank together")

    def stats(self) -> dict[str, Any]:
        """Where this rank's requested ids were served from, and what crossed to and from peers. Syncs the device.

        ``local_hits + peer_hits + host_misses == requests`` (ids asked by this rank; ids it served to peers are
        ``served_rows``, counted by the asking rank). ``hit_rate`` = (local + peer hits) / requests: the node
        cache's hit rate. ``bytes_sent`` / ``bytes_received``: everything this rank's fetches put on / took off the
        wire (headers, ids, rows). ``local`` is the FeatureCache's own counters: it also counts the rows served to
        peers and the filler hits that stand in for peer rows, so its hit rate is not the node's.
        """
        peer, local, miss = (int(v) for v in self._counts.tolist())
        st = self.cache.stats()
        return {"rank": self.rank, "world_size": self.world_size, "rows_cached_here": int(self.cache.capacity_rows),
                "rows_cached_on_node": self.node_cached_rows, "requests": self.requests, "local_hits": local,
                "peer_hits": peer, "host_misses": miss,
                "hit_rate": (local + peer) / self.requests if self.requests else None,
                "peer_rows": self.peer_rows, "served_rows": self.served_rows, "bytes_from_peers": self.bytes_received,
                "bytes_sent": self.bytes_sent_total, "bytes_received": self.bytes_received_total, "local": st}

    def reset_stats(self) -> None:
        """Zero this rank's counters and its FeatureCache's (cache contents stay). Not a collective."""
        self._counts.zero_()
        self.requests = self.peer_rows = self.served_rows = self.bytes_received = 0
        self.bytes_sent_total = self.bytes_received_total = 0
        self.cache.reset_stats()


def _widest_view(rows_u8: torch.Tensor) -> torch.Tensor:
    """``[n, row_bytes]`` bytes as the widest integer words that divide a row (fewer elements to copy)."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if rows_u8.shape[1] % size == 0:
            return rows_u8.view(dt)
    return rows_u8
