"""``FeatureCache``: a GPU (or CPU) row cache in front of a host store, with IBP compression on either side.

A fetch is two launches on CUDA: the probe kernel (``kernels/hashmap.cu``) looks every requested id up in
the cache index and writes one decode descriptor per id (source address in the slab for a hit, in pinned host
memory for a miss; stored length; compressed flag), then the codec's ``decode_descriptors`` decodes hits and
misses together straight into the output, in request order. The only host sync is the id range check.

The four combinations of ``compress_cache`` x ``compress_host`` are the paper's configurations:

====================  ===============  ===============
name                  compress_cache   compress_host
====================  ===============  ===============
baseline (raw/raw)    False            False
IBP(M)                False            True
IBP(C)                True             False
IBP(C/M)              True             True
====================  ===============  ===============

Static caches are filled once and a fetch never syncs beyond the id check. Dynamic policies (``lru``,
``lfu``) admit missed rows after each fetch has been served, on the same stream, from the decoded output
(re-encoded on the GPU for a compressed slab, so admissions cost no PCIe traffic); their bookkeeping is
vectorised torch code with a few host syncs for data-dependent sizes (``policy.py``).

Concurrency: every policy and device may be fetched from any number of Python threads, each on its own CUDA
stream. A fetch runs under the cache's :class:`~ibpcache.cache.ordering.StreamOrder` (a lock, and on CUDA an event
chain: its stream first waits for the last cache operation enqueued by any thread), so probe/decode workspaces,
slab slots and the index are never used by two streams at once and an admission never overwrites a slot that a
decode on another stream has yet to read. The caller's output is ready on the caller's current stream when ``fetch`` returns, as for any
torch op. Concurrent fetches therefore run one after the other on the GPU; a cache per loader thread is the way
to run them side by side.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._validation import as_row_bytes, check_ids, resolve_budget, resolve_device
from ..codec import Codec
from ..compressed import CompressedRows
from ..errors import (CapacityError, FormatError, InternalError, InvalidArgumentError, InvalidIdsError,
                      InvalidTypeError, RowDtypeError, RowShapeError, UnsupportedError)
from .entry import (EMPTY_ENTRY, MAX_SLABS, check_row_length, entry_compressed, entry_lengths, entry_offsets,
                    entry_slab_ids, pack_entries)
from .hashmap import CacheIndex, DEFAULT_MAX_PROBES, make_index
from .host_store import CacheMirror, FitOptions, HostStore, Transfer, fit_candidates, fit_codec
from .plan_layout import best_compressed, calibrate_layout, codec_named
from .ordering import StreamOrder
from .policy import CachePolicy, PolicyKind, SlotPolicy, StaticPolicy, choose_slot_bytes, make_policy
from .slab import SLAB_ALIGN, Slab, usable_bytes
from .stats import FetchStats

__all__ = ["FeatureCache", "mode_name"]

_SIZE_PIECE_BYTES = 1 << 28
"""Rows are sized on the GPU in pieces of this many bytes (datasets may exceed GPU memory)."""

_GROWTH = 1.5


def mode_name(compress_cache: bool, compress_host: bool) -> str:
    """Paper name of a compress_cache x compress_host combination."""
    return {(False, False): "baseline", (False, True): "IBP(M)", (True, False): "IBP(C)",
            (True, True): "IBP(C/M)"}[(bool(compress_cache), bool(compress_host))]


def _blocks_per_sm(value: object) -> int:
    """``fetch_blocks_per_sm`` checked: None -> the lookup's full grid; else an int in 1..16."""
    from ..kernels.lookup import ROWS_BLOCKS_PER_SM

    if value is None:
        return ROWS_BLOCKS_PER_SM
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value <= ROWS_BLOCKS_PER_SM:
        raise InvalidArgumentError(f"fetch_blocks_per_sm must be None or an int in 1..{ROWS_BLOCKS_PER_SM}, "
                                   f"got {value!r}")
    return int(value)


class FeatureCache:
    """Rows of a dataset, served by id from a byte-budgeted cache slab plus a host store.

    Args:
        rows: ``[N, ...]`` tensor of any dtype (kept in host memory; pinned on CUDA), or a
            :class:`CompressedRows` (then its codec is used and rows stay compressed on the host). A
            non-contiguous tensor (a slice, a transpose) is copied once with ``.contiguous()`` during
            construction, which copies every row into the cache and host store anyway; fetches never copy it.
        budget_bytes: cache slab size. A float in (0, 1] is a fraction of the raw feature bytes (``0.01`` = 1% of
            ``N * row_bytes``, ``1.0`` = all of them); an int >= 1 is a byte count (so ``1`` is one byte, not 100%);
            ``None`` builds no slab (every row is read from the host store: e.g. labels kept beside features). The
            budget must hold at least one stored row (rows sit in 16-byte units): a smaller one, 0, a negative
            number, NaN, a bool or a float above 1 raises an :class:`~ibpcache.errors.IbpcacheError`
            (``ValueError`` / ``TypeError``) naming the value and the smallest valid budget. The slab never
            exceeds it. Index and per-row tables are metadata outside the budget and are reported by :meth:`stats`.
        hotness: ``[N]`` score for the ``static`` policy (node degree, trace frequency); None = id order.
            Ignored by dynamic policies.
        policy: ``"static"``, ``"lru"`` or ``"lfu"`` (see ``policy.py``).
        device: ``"cuda"`` or ``"cpu"`` (the CPU path runs the same design with Numba decoders).
        codec: None or ``"auto"`` (fit on the rows when any compression is on), or a :class:`Codec`.
        compress_cache / compress_host: store compressed rows in the slab / in host memory. ``compress_host="auto"``
            lets the host-layout planner (``plan_layout.py``, as the embedding bags do by default) time compressed vs
            raw zero-copy misses on this machine and keep the faster (``stats()["host_layout"]`` says which); a
            ``CompressedRows`` input stays compressed (decompressing it would cost the memory it saves).
        index: ``"auto"``, ``"hash"`` or ``"direct"`` (see ``hashmap.make_index``).
        max_probes: hash probe bound.
        slot_bytes: slot size of dynamic policies, ``"auto"`` (``policy.choose_slot_bytes``) or an int.
        validate: ``"eager"`` checks the id range before every fetch (one min/max reduction: a host sync on CUDA)
            and raises at once; ``"lazy"`` (CUDA, static policy) lets the lookup kernel check ids with no sync: a bad
            id's row comes back as zeros and :class:`InvalidIdsError` is raised by a later ``fetch``, by
            :meth:`check_errors` or by :meth:`stats`. Lazy fetches of a static cache never sync the host and can be
            captured in a CUDA graph (they use no workspace; pass ``out=`` and keep ``ids`` in place to replay).
        transfer: how a static CUDA cache reads misses when ``fetch`` gets ids on the CPU (as DGL's and PyG's
            samplers hand them over): ``"zero_copy"`` (the ids are copied over and one lookup launch reads misses
            from pinned host memory), ``"cpu_gather"`` (the CPU packs the misses' stored bytes and every id's
            decode descriptor into one pinned buffer: one copy, one decode launch, no device sync),
            ``"host_gather"`` (raw host rows only, sensibly: the CPU gathers every id's row, cached or not, with
            torch's row gather into pinned staging, one copy: the raw baseline, which small rows from a large table
            may not beat otherwise), or ``"auto"`` (the planner times them on this store at construction, host work
            included; with ``compress_host="auto"`` the layout planner weighs the CPU's raw gather against compressed
            zero-copy reads too; ``stats()["transfer"]`` and ``stats()["host_layout"]``). Ids already on the GPU
            always take the zero-copy lookup; dynamic policies always read zero-copy.
        slab_id: the id (0..7) this cache's own slab carries in its entries. Caches whose indexes also hold rows
            of other caches' slabs (:meth:`add_peer_rows`: the GPUs of one node, ``cache/partitioned.py``) give
            every slab its own id; a lone cache keeps 0.
        fetch_blocks_per_sm: CUDA, static policy: at most this many blocks (of 8 warps) per multiprocessor in a
            fetch's lookup kernel (1..16; ``None``: 16, which fills the GPU). Why: a fetch whose misses are read
            from host memory is bound by the link, not by the multiprocessors, yet a full grid holds them all until
            it ends, so a training step's kernels on another stream (a pipelined loader) wait behind it instead of
            running beside it. A few blocks per multiprocessor keep most host reads in flight (1 per SM: 91% of
            the full grid's throughput on an H200) with the rest of the GPU free, for kernels that can use it:
            cuBLAS matmuls gained little (overlap 1.08x -> 1.2x) and GraphSAGE epochs nothing
            (docs/results/2026-11-28-h200-s45), hence the default. Output bytes do not depend on it.
    """

    def __init__(
        self,
        rows: "torch.Tensor | CompressedRows",
        budget_bytes: "int | float | None",
        hotness: torch.Tensor | None = None,
        policy: "str | PolicyKind" = "static",
        device: "str | torch.device" = "cuda",
        codec: "Codec | str | None" = None,
        compress_cache: bool = True,
        compress_host: "bool | str" = True,
        *,
        index: str = "auto",
        max_probes: int = DEFAULT_MAX_PROBES,
        slot_bytes: "int | str" = "auto",
        validate: str = "eager",
        transfer: str = "auto",
        slab_id: int = 0,
        fetch_blocks_per_sm: "int | None" = None,
    ) -> None:
        self.device = resolve_device(device)
        self.fetch_blocks_per_sm = _blocks_per_sm(fetch_blocks_per_sm)
        if validate not in ("eager", "lazy"):
            raise InvalidArgumentError(f"validate must be 'eager' or 'lazy', got {validate!r}")
        self.validate = validate
        self.policy_kind = PolicyKind.from_str(policy)
        self.compress_cache = bool(compress_cache)
        if compress_host not in (True, False, "auto"):
            raise InvalidArgumentError(f"compress_host must be True, False or 'auto', got {compress_host!r}")
        self.compress_host = compress_host is not False  # "auto" decides below, once the codec is fitted
        rows = self._describe_rows(rows)
        # before the codec fit: a raw slab's rows are row_bytes each; a compressed one's are known after sizing
        self.budget_bytes = self._budget(budget_bytes, 1 if self.compress_cache else self.row_bytes)
        self.codec, self.host_layout = self._choose_codec(rows, codec, compress_host)
        self._decode_codec = self.codec if self.codec is not None else Codec.raw(self.dtype, self.row_shape)
        self.host = HostStore(rows, codec=self.codec, compress=self.compress_host, device=self.device,
                              transfer=transfer if self.policy_kind is PolicyKind.STATIC else "zero_copy",
                              share_rows=True)  # read-only here: raw rows already pinned are served in place
        self._rows = rows
        self.cache_lengths = self._cache_lengths(rows)  # int32 [N] on CPU: stored bytes in the slab format
        self._budget(budget_bytes, int(self.cache_lengths.min()))  # now exact: the budget holds the smallest row
        self._index_kind, self._max_probes = index, max_probes
        self.stats_ = FetchStats(self.device, self.row_bytes)
        self._probe_status = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._ws: dict[str, torch.Tensor] = {}
        self._order = StreamOrder(self.device)  # one fetch/admission at a time (see the module docstring)
        from ..kernels.lookup import LookupErrors

        self._errors = LookupErrors(pin=self.device.type == "cuda")  # the lookup kernel's bad-id report
        self._hits_host: Any = None  # host_store.CacheMirror of a static index (the cpu-gather path)
        if not isinstance(slab_id, (int, np.integer)) or isinstance(slab_id, bool) or not 0 <= slab_id < MAX_SLABS:
            raise InvalidArgumentError(f"slab_id must be an int in 0..{MAX_SLABS - 1}, got {slab_id!r}")
        self._slab_id = int(slab_id)
        self._peer_slabs: dict[int, torch.Tensor] = {}  # slab id -> another cache's slab that entries point into
        self.peer_rows = 0
        if self.policy_kind is PolicyKind.STATIC:
            self._build_static(StaticPolicy(hotness))
        else:
            self._build_dynamic(slot_bytes)
        self._set_slab_bases()
        if self._host_gathers_enabled:
            self._hit_table()  # built now: the first cpu-gather fetch does no set-up work
        self._rows = None  # the slab is filled; keep no second reference to the caller's rows
        self._source = None  # the fused lookup's view of index + slab + host store (built on first use)
        if self.device.type == "cuda":  # uploaded now: a fetch never pays (or syncs) for it
            self._tables = self._decode_codec.kernel_tables(self.device)
        self.path_counts = {"zero_copy": 0, "cpu_gather": 0, "host_gather": 0, "probe_decode": 0, "cpu": 0}

    # ------------------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------------------

    def _budget(self, budget_bytes: object, min_row_bytes: int) -> int:
        """Budget bytes (0 for ``None``: no slab); raises unless the budget holds a row of ``min_row_bytes``."""
        if budget_bytes is None:
            return 0
        return resolve_budget(budget_bytes, self.n_rows * self.row_bytes, min_row_bytes, "budget_bytes", SLAB_ALIGN)

    def _describe_rows(self, rows: "torch.Tensor | CompressedRows") -> "torch.Tensor | CompressedRows":
        """Record the rows' geometry; returns them contiguous (a strided tensor is copied once, here, so the
        codec fit, the host store and the slab fill below all read the same transient copy)."""
        if isinstance(rows, CompressedRows):
            self.n_rows, self.row_bytes = rows.n_rows, rows.row_bytes
            self.dtype, self.row_shape = rows.dtype, tuple(rows.codec.row_shape)
        elif isinstance(rows, torch.Tensor):
            if rows.dim() < 1:
                raise InvalidArgumentError("rows: expected a tensor of shape [N, ...], got a 0-d tensor")
            if not rows.is_contiguous():  # construction copies every row into the slab / host store anyway
                rows = rows.contiguous()
            self.n_rows = int(rows.shape[0])
            self.dtype, self.row_shape = rows.dtype, tuple(rows.shape[1:])
            self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * rows.element_size()
            if self.row_bytes == 0:
                raise InvalidArgumentError(f"rows of zero bytes cannot be cached (shape {tuple(rows.shape)})")
        else:
            raise InvalidTypeError(f"rows: expected a torch.Tensor or CompressedRows, got {type(rows).__name__}")
        if self.n_rows == 0:
            raise InvalidArgumentError("rows: expected at least one row")
        check_row_length(self.row_bytes)
        return rows

    def _choose_codec(self, rows: "torch.Tensor | CompressedRows", codec: "Codec | str | None",
                      compress_host: "bool | str") -> "tuple[Codec | None, dict[str, Any]]":
        """The codec of slab and host rows, and the host layout (``stats()['host_layout']``): a given codec (checked
        against the rows), the CompressedRows' own, an IBP fit (``None``), or the planner's choice (``"auto"``)."""
        if isinstance(rows, CompressedRows):
            if isinstance(codec, Codec) and not codec.same_tables(rows.codec):
                raise InvalidArgumentError("codec differs from the codec the CompressedRows were made with")
            reason = ("CompressedRows given: kept compressed" if compress_host == "auto"
                      else f"compress_host={compress_host!r} (set)")
            return rows.codec, {"compress": bool(compress_host), "reason": reason, "method": rows.codec.method}
        if isinstance(codec, Codec):
            self._check_codec_rows(codec)
        elif codec not in (None, "auto"):
            raise InvalidArgumentError(f"codec must be None, 'auto' or a Codec, got {codec!r}")
        if codec is None or isinstance(codec, Codec):
            if codec is None and (self.compress_cache or self.compress_host):
                codec = fit_codec(rows, self.device)  # large tables: a seeded sample (the engine's one rule)
            return codec, self._plan_host(rows, codec, compress_host)
        # codec="auto": the planner weighs IBP, exponent coding (float rows) and, with compress_host="auto", raw rows
        if not (self.compress_cache or self.compress_host):
            return None, {"compress": False, "reason": "compress_host=False (set)", "method": "raw"}
        options = FitOptions(method="auto")
        if compress_host is False:  # only the slab is coded: the most rows per byte (no transfer to time)
            return fit_codec(rows, self.device, options), {"compress": False, "reason": "compress_host=False (set)",
                                                           "method": "raw"}
        candidates = fit_candidates(rows, self.device, options)
        choice = calibrate_layout(rows, candidates, self.device, host_paths=self.policy_kind is PolicyKind.STATIC,
                                  allow_raw=compress_host == "auto")
        self.compress_host = choice.compress
        slab_method = choice.method if choice.compress else best_compressed(choice)
        return codec_named(candidates, slab_method), choice.as_dict()

    def _check_codec_rows(self, codec: Codec) -> None:
        """A codec given for tensor rows must be for rows like them: another dtype or shape would store them wrong."""
        if codec.dtype != self.dtype:
            raise RowDtypeError(f"codec is for {codec.dtype} rows, got {self.dtype} rows")
        if (codec.row_bytes, tuple(codec.row_shape)) != (self.row_bytes, self.row_shape):
            raise RowShapeError(f"codec is for rows of shape {tuple(codec.row_shape)}, got rows of shape "
                                f"{self.row_shape}")

    def _plan_host(self, rows: torch.Tensor, codec: "Codec | None", option: "bool | str") -> dict[str, Any]:
        """``compress_host="auto"`` with one codec: the planner's compressed-vs-raw choice for a tensor of rows."""
        if option != "auto":
            return {"compress": bool(option), "reason": f"compress_host={option!r} (set)",
                    "method": codec.method if option and codec is not None else "raw"}
        if codec is None:
            return {"compress": False, "reason": "no codec", "method": "raw"}
        # static CUDA caches may take ids on the CPU: the CPU's own gather of raw rows is a candidate there too
        choice = calibrate_layout(rows, codec, self.device, host_paths=self.policy_kind is PolicyKind.STATIC)
        self.compress_host = choice.compress
        return choice.as_dict()

    def _cache_lengths(self, rows: "torch.Tensor | CompressedRows") -> torch.Tensor:
        """Stored bytes of every row in the slab's format (compressed or raw), int32 on the CPU."""
        if not self.compress_cache:
            return torch.full((self.n_rows,), self.row_bytes, dtype=torch.int32)
        if self.host.packed is not None:
            return self.host.packed.lengths
        if isinstance(rows, CompressedRows):
            return rows.lengths
        assert self.codec is not None
        if self.device.type == "cuda" and not rows.is_cuda:  # size on the GPU, streaming pieces of the rows
            step = max(1, _SIZE_PIECE_BYTES // self.row_bytes)
            return torch.cat([self.codec.stored_lengths(rows[i : i + step].to(self.device)).cpu()
                              for i in range(0, self.n_rows, step)]).to(torch.int32)
        return self.codec.stored_lengths(rows).to("cpu", torch.int32)

    def _raw_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """uint8 [len(ids), row_bytes] raw bytes of rows ``ids`` (for filling the slab)."""
        if isinstance(self._rows, torch.Tensor) and self._rows.device.type == "cpu":
            return as_row_bytes(self._rows)[ids.to(self._rows.device)]
        return self.host.raw_rows(ids)

    def _slab_payload(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Bytes of rows ``ids`` in slab format, back to back (1-D uint8)."""
        raw = self._raw_rows(ids)
        if not self.compress_cache:
            return raw.reshape(-1)
        assert self.codec is not None
        typed = raw.contiguous().view(self.dtype).reshape(ids.numel(), *self.row_shape)
        packed = self.codec.compress(typed, layout="packed", pin=False, device=self.device)
        if not torch.equal(packed.lengths.cpu(), lengths.cpu().to(torch.int32)):
            raise InternalError("internal error: re-compressed rows differ in length from the dataset pass")
        return packed.data

    def _build_static(self, policy: StaticPolicy) -> None:
        self.policy: CachePolicy = policy
        self.slot_bytes = 0
        chosen = policy.select(self.cache_lengths, usable_bytes(self.budget_bytes))
        lens = self.cache_lengths[chosen]
        self.slab = Slab(int(lens.sum(dtype=torch.int64)), self.budget_bytes, self.device, self._slab_id)
        offsets = self.slab.pack(lens)
        if chosen.numel():
            self.slab.write(0, self._slab_payload(chosen, lens))
        self.capacity_rows = int(chosen.numel())
        self.index: CacheIndex = make_index(self.n_rows, self.capacity_rows, self.device, self._index_kind,
                                            self._max_probes)
        entries = pack_entries(offsets, lens, lens < self.row_bytes, self.slab.slab_id)
        self.index.build(chosen.to(self.device), entries.to(self.device))
        self.cached_ids = chosen
        self._own_entries = entries.cpu()  # what peers index to read these rows from this slab (own_entries)
        self._slab_offsets = offsets  # slab byte offset of each cached row (the cpu-gather path's hit addresses)

    def _set_slab_bases(self) -> None:
        """The lookup's slab base table: this cache's slab and every peer slab, each at its id."""
        bases = torch.zeros(MAX_SLABS, dtype=torch.int64)
        bases[self.slab.slab_id] = self.slab.base_ptr
        for sid, data in self._peer_slabs.items():
            bases[sid] = int(data.data_ptr()) if data.numel() else 0
        self.slab_bases = bases.to(self.device)
        self._source = None  # the fused lookup's arguments hold the index and the base table: rebuilt on use

    # ------------------------------------------------------------------------------------------------
    # composition: one index over several slabs (the GPUs of one node)
    # ------------------------------------------------------------------------------------------------

    def _require_static(self, what: str) -> None:
        if self.dynamic:
            raise UnsupportedError(f"{what} needs a static-policy cache (a dynamic one owns its index)")

    def own_entries(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """``(ids, entries)`` of the rows in this cache's own slab (int64, CPU): what another cache passes to
        :meth:`add_peer_rows` to read them from here. Static policy only."""
        self._require_static("own_entries")
        return self.cached_ids.cpu(), self._own_entries

    def restock(self, hotness: torch.Tensor | None) -> None:
        """Refill the static slab with the hottest rows under a new ``hotness`` (same budget, same slab id) and
        drop every peer row. The slab is reallocated: a peer that mapped the old one must stop reading it first
        (the node cache's ``refresh`` holds its ranks at a barrier for that). Waits for this cache's queued work."""
        self._require_static("restock")
        with self._order.exclusive():
            self._order.synchronize()
            self._peer_slabs = {}
            self.peer_rows = 0
            self._build_static(StaticPolicy(hotness))
            self._set_slab_bases()
            self._hits_host = None
            if self._host_gathers_enabled:
                self._hit_table()

    def add_peer_rows(self, ids: torch.Tensor, entries: torch.Tensor, slabs: "dict[int, torch.Tensor]") -> None:
        """Index rows that live in other caches' slabs, so ONE lookup serves them with this cache's own hits.

        ``ids`` / ``entries``: int64 [k], rows cached elsewhere and their packed entries (:meth:`own_entries` of
        their caches: the slab id in each entry names the slab). ``slabs``: slab id -> that slab's bytes as a tensor
        this process can read (a peer GPU's slab opened through CUDA IPC, or on the CPU another cache's
        ``slab.data``); the tensors are kept referenced as long as the index points into them. Replaces earlier
        peer rows; rows also in this cache's own slab are served from its own. The rows must be the same table
        stored the same way (same codec): entries are decoded with this cache's codec. Static policy only."""
        self._require_static("add_peer_rows")
        ids = torch.as_tensor(ids).to("cpu", torch.int64).reshape(-1)
        entries = torch.as_tensor(entries).to("cpu", torch.int64).reshape(-1)
        if ids.numel() != entries.numel():
            raise InvalidArgumentError(f"ids and entries differ in length ({ids.numel()} vs {entries.numel()})")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n_rows):
            raise InvalidIdsError(f"peer ids outside [0, {self.n_rows})")
        sids = set(entry_slab_ids(entries).unique().tolist()) if ids.numel() else set()
        if self.slab.slab_id in sids or not sids <= set(slabs):
            raise InvalidArgumentError(f"peer entries name slabs {sorted(sids)}: each must be in slabs "
                                       f"({sorted(slabs)}) and differ from this cache's own slab "
                                       f"{self.slab.slab_id}")
        for sid, data in slabs.items():
            if data.dtype != torch.uint8 or data.dim() != 1 or data.device.type != self.device.type:
                raise InvalidArgumentError(f"slab {sid}: expected a 1-D uint8 tensor on {self.device.type}, got "
                                           f"{data.dtype} {tuple(data.shape)} on {data.device}")
        ends = entry_offsets(entries) + entry_lengths(entries).to(torch.int64)
        for sid in sids:  # construction time: a host loop over at most 8 slabs
            end = int(ends[entry_slab_ids(entries) == sid].max())
            if end > int(slabs[sid].numel()):
                raise InvalidArgumentError(f"peer entries point past the end of slab {sid} ({end} > "
                                           f"{int(slabs[sid].numel())} bytes)")
        keep = torch.ones(ids.numel(), dtype=torch.bool)
        keep[torch.isin(ids, self.cached_ids.cpu())] = False
        ids, entries = ids[keep], entries[keep]
        with self._order.exclusive():
            self._order.synchronize()  # the old index may still be read by queued lookups
            own_ids, own = self.own_entries()
            all_ids, all_entries = torch.cat([own_ids, ids]), torch.cat([own, entries])
            self.index = make_index(self.n_rows, int(all_ids.numel()), self.device, self._index_kind,
                                    self._max_probes)
            self.index.build(all_ids.to(self.device), all_entries.to(self.device))
            self._peer_slabs = {int(k): v for k, v in slabs.items() if int(k) in sids}
            self.peer_rows = int(ids.numel())
            self._set_slab_bases()

    def _check_slots(self, asked: "int | str", n_slots: int) -> None:
        """An explicit ``slot_bytes`` must let the cache hold a row: slots no smaller than the smallest stored row,
        and at least one slot in the budget (``"auto"`` and ``budget_bytes=None`` always pass)."""
        if asked == "auto" or self.budget_bytes == 0:
            return
        smallest = int(self.cache_lengths.min())
        if self.slot_bytes < smallest:
            raise CapacityError(f"slot_bytes={asked!r}: smaller than every stored row (the smallest takes {smallest} "
                                f"bytes), so no row could be cached; use slot_bytes >= {smallest} or 'auto'")
        if n_slots == 0:
            raise CapacityError(f"slot_bytes={asked!r}: budget_bytes ({self.budget_bytes} bytes, used in "
                                f"{SLAB_ALIGN}-byte units) holds no slot of {self.slot_bytes} bytes; use a smaller "
                                "slot_bytes, 'auto', or a larger budget")

    def _build_dynamic(self, slot_bytes: "int | str") -> None:
        if slot_bytes == "auto":
            self.slot_bytes = choose_slot_bytes(self.cache_lengths, usable_bytes(self.budget_bytes), self.row_bytes)
        elif isinstance(slot_bytes, (int, np.integer)) and not isinstance(slot_bytes, bool) and 0 < slot_bytes:
            self.slot_bytes = min(int(slot_bytes), self.row_bytes)
        else:
            raise InvalidArgumentError(f"slot_bytes must be 'auto' or a positive int, got {slot_bytes!r}")
        n_slots = min(usable_bytes(self.budget_bytes) // self.slot_bytes, self.n_rows)
        self._check_slots(slot_bytes, n_slots)
        self.slab = Slab(n_slots * self.slot_bytes, self.budget_bytes, self.device)
        self.slot_view = self.slab.slots(self.slot_bytes)
        self.capacity_rows = n_slots
        self.policy = make_policy(self.policy_kind, n_slots=n_slots, n_rows=self.n_rows, device=self.device)
        self.index = make_index(self.n_rows, n_slots, self.device, self._index_kind, self._max_probes)
        self._lengths_dev = self.cache_lengths.to(self.device)
        self._cacheable = self._lengths_dev <= self.slot_bytes
        self.cached_ids = None

    # ------------------------------------------------------------------------------------------------
    # fetch
    # ------------------------------------------------------------------------------------------------

    @property
    def dynamic(self) -> bool:
        return isinstance(self.policy, SlotPolicy)

    def fetch(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``rows[ids]``, bit-identical, in request order, on the cache's device.

        ``ids``: 1-D int64 (int32 is widened) tensor on any device; any order, duplicates allowed; an empty
        batch returns an empty ``[0, *row_shape]`` tensor. Negative or out-of-range ids raise
        :class:`InvalidIdsError` (one min/max reduction: the fetch's only host sync); float or bool ids too.
        ``out``: optional preallocated ``[len(ids), *row_shape]`` tensor of the rows' dtype on the device.
        """
        fused = self.device.type == "cuda" and not self.dynamic
        if fused and self._host_gathers(ids):
            return self._fetch_cpu_gather(ids, out)
        lazy = fused and self.validate == "lazy"
        if lazy:
            self._raise_pending_error()
        ids = check_ids(ids, self.n_rows, self.device, check_range=not lazy)
        self.host.check_live()  # an attached shared store that was replaced raises before any read
        b = int(ids.numel())
        out = self._check_out(out, b)
        if b == 0:
            return out
        out_u8 = out.view(torch.uint8).reshape(b, self.row_bytes)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and not fused:
            raise UnsupportedError("only a static-policy CUDA FeatureCache can be captured in a CUDA graph (dynamic "
                               "policies decide admissions on the host)")
        with self._order.exclusive():
            t0 = None if capturing else self.stats_.start()
            if fused:
                self._lookup(ids, out_u8)
                self.path_counts["zero_copy"] += 1
            elif self.device.type == "cuda":
                entries = self._probe(ids)
                self._decode(out_u8, b)
                self.path_counts["probe_decode"] += 1
            else:
                entries = self._fetch_cpu(ids, out_u8)
                self.path_counts["cpu"] += 1
            if self.dynamic:
                self._admit(ids, entries, out_u8)
            if t0 is not None:
                self.stats_.stop(t0, b)
        return out

    def _lookup(self, ids: torch.Tensor, out_u8: torch.Tensor) -> None:
        """CUDA, static policy: ONE launch probes the index, reads each row from the slab or zero-copy from the
        host store, and decodes it into ``out_u8`` (ids range-checked in the kernel)."""
        from ..kernels.lookup import RowSource, lookup_rows

        if self._source is None:
            h = self.host.host_args()
            self._source = RowSource(self.index.kernel_args(), self.slab_bases, h.base, h.offsets, h.stride,
                                     h.lengths, self.n_rows)
        lookup_rows(ids, out_u8, self._source, self._tables, self.stats_.counters, self._errors.ptr,
                    blocks_per_sm=self.fetch_blocks_per_sm)

    @property
    def _host_gathers_enabled(self) -> bool:
        """A static CUDA cache whose host store reads through a host-side path (cpu_gather or host_gather)."""
        return (self.device.type == "cuda" and not self.dynamic
                and self.host.transfer in (Transfer.CPU_GATHER, Transfer.HOST_GATHER))

    def _host_gathers(self, ids: object) -> bool:
        """Take the cpu-gather path? Static CUDA caches whose planner chose it, for ids handed over on the CPU."""
        return (self._hits_host is not None and isinstance(ids, torch.Tensor) and ids.device.type == "cpu"
                and not torch.cuda.is_current_stream_capturing())

    def _hit_table(self) -> CacheMirror:
        """Host mirror of a static cache's index (built once; 4 bytes of host memory per row): what the cpu-gather
        path needs to send hits to the slab and read only misses on the host."""
        if self._hits_host is None:
            pos = np.full(self.n_rows, -1, dtype=np.int32)
            chosen = self.cached_ids.cpu().numpy()
            pos[chosen] = np.arange(chosen.shape[0], dtype=np.int32)
            lens = np.ascontiguousarray(self.cache_lengths[self.cached_ids.cpu()].numpy(), dtype=np.int32)
            src = self._slab_offsets.cpu().numpy().astype(np.int64) + self.slab.base_ptr
            self._hits_host = CacheMirror(pos, src, lens)
        return self._hits_host

    def _fetch_cpu_gather(self, ids: torch.Tensor, out: "torch.Tensor | None") -> torch.Tensor:
        """Static CUDA cache, ids on the CPU, through the host store's host-side path. ``cpu_gather``: every id's
        decode descriptor (slab address of a hit, staged address of a miss), the misses' STORED bytes and the
        fetch's counters in one pinned buffer, one copy, one decode launch. ``host_gather`` (raw rows, where it
        measured fastest): every id gathered by the CPU from host memory, cache or not, one copy. Ids are
        range-checked on the CPU; nothing waits for the GPU."""
        ids = check_ids(ids, self.n_rows, torch.device("cpu"))
        self.host.check_live()
        b = int(ids.numel())
        out = self._check_out(out, b)
        if b == 0:
            return out
        out_u8 = out.view(torch.uint8).reshape(b, self.row_bytes)
        with self._order.exclusive():
            t0 = self.stats_.start()
            if self.host.transfer is Transfer.HOST_GATHER:
                self.host.read_into(ids, out_u8)
                self.stats_.add_cpu(b, 0, b * self.row_bytes, 0)
            else:
                self.stats_.counters += self.host.read_staged(ids.numpy(), out_u8, None, self._hit_table(),
                                                              self._tables)
            self.path_counts[self.host.transfer.value] += 1
            self.stats_.stop(t0, b)
        return out

    def _raise_pending_error(self) -> None:
        """Raise (once) the report a lookup left in host memory: a bad id (lazily validated), or a stored row that
        does not decode (a corrupt store; exponent-coded rows can tell)."""
        from ..kernels.lookup import CORRUPT_ROW

        report = self._errors.take()
        if report is not None and report[0] == CORRUPT_ROW:
            raise FormatError(f"a recent fetch read a corrupt {self._decode_codec.method}-coded row (it does not "
                              "decode within its stored length; that row was returned as zeros)")
        if report is not None:
            raise InvalidIdsError(f"ids: a recent fetch got an id outside [0, {self.n_rows}) (validate='lazy' "
                                  "reports it after the fact; that id's row was returned as zeros)")

    def check_errors(self) -> None:
        """Wait for the cache's queued work and raise :class:`InvalidIdsError` if a lazily validated fetch saw a
        bad id (a no-op with ``validate='eager'``), or FormatError if a read met a corrupt stored row."""
        self._order.synchronize()
        self._raise_pending_error()
        self.host.check_errors()

    def _check_out(self, out: torch.Tensor | None, b: int) -> torch.Tensor:
        shape = (b, *self.row_shape)
        if out is None:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        if not isinstance(out, torch.Tensor):
            raise InvalidTypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        if out.dtype != self.dtype or tuple(out.shape) != shape:
            raise InvalidArgumentError(f"out: expected a {self.dtype} tensor of shape {shape}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        if out.device.type != self.device.type:
            raise InvalidArgumentError(f"out: expected a tensor on {self.device}, got {out.device}")
        if not out.is_contiguous():
            raise InvalidArgumentError("out: expected a contiguous tensor")
        return out

    def _workspace(self, b: int) -> dict[str, torch.Tensor]:
        """Descriptor buffers, grown geometrically to the largest batch seen (no allocation per fetch)."""
        have = self._ws["src"].numel() if self._ws else 0
        if b > have:
            if have and self.device.type == "cuda":
                # the old buffers may still be read by work queued on another thread's stream: let it finish
                # before they go back to the allocator (growth happens a few times at warm-up, not per fetch)
                torch.cuda.synchronize(self.device)
            cap = max(b, int(have * _GROWTH))
            dev = self.device
            self._ws = {
                "src": torch.empty(cap, dtype=torch.int64, device=dev),
                "len": torch.empty(cap, dtype=torch.int32, device=dev),
                "comp": torch.empty(cap, dtype=torch.uint8, device=dev),
                "entries": torch.empty(cap, dtype=torch.int64, device=dev),
            }
        return self._ws

    def _probe(self, ids: torch.Tensor) -> torch.Tensor:
        """CUDA: one probe launch writes the decode descriptors of ``ids``; returns their entries."""
        from ..kernels.hashmap import launch_probe

        b = ids.numel()
        ws = self._workspace(b)
        entries = ws["entries"][:b]
        launch_probe(ids, self.n_rows, self.index.kernel_args(), self.slab_bases, self.host.host_args(),
                     ws["src"][:b], ws["len"][:b], ws["comp"][:b], entries, self.stats_.counters,
                     self._probe_status)
        return entries

    def _decode(self, out_u8: torch.Tensor, b: int) -> None:
        """CUDA: one decode launch over the descriptors written by :meth:`_probe`."""
        from ..kernels.bitpack import decode_descriptors

        ws = self._ws
        decode_descriptors(out_u8, ws["src"][:b], ws["len"][:b], ws["comp"][:b], None,
                           self._decode_codec.kernel_tables(out_u8.device), self.host.decode_errors)

    def _fetch_cpu(self, ids: torch.Tensor, out_u8: torch.Tensor) -> torch.Tensor:
        """CPU: look ids up, decode hits from the slab and misses from the host store."""
        entries = self.index.lookup(ids)
        hit = entries != EMPTY_ENTRY
        hit_pos = torch.nonzero(hit).reshape(-1)
        miss_pos = torch.nonzero(~hit).reshape(-1)
        codec = self._decode_codec
        out_np = out_u8.numpy()
        slab_bytes = host_bytes = 0
        if hit_pos.numel():
            e = entries[hit_pos]
            sids = entry_slab_ids(e)
            for sid in sids.unique().tolist():  # one slab on its own, several when peer rows are indexed
                part = (sids == sid).nonzero().reshape(-1)
                data = self.slab.data if sid == self.slab.slab_id else self._peer_slabs[sid]
                es = e[part]
                lens = entry_lengths(es)
                codec.decode_rows_at(data.numpy(), entry_offsets(es).numpy(), lens.numpy(), out_np,
                                     hit_pos[part].numpy(), compressed=entry_compressed(es).numpy())
                slab_bytes += int(lens.sum(dtype=torch.int64))
        if miss_pos.numel():
            offsets, lens_np, comp = self.host.cpu_descriptors(ids[miss_pos].numpy())
            codec.decode_rows_at(self.host.data.numpy(), offsets, lens_np, out_np, miss_pos.numpy(), compressed=comp)
            host_bytes = int(lens_np.sum(dtype=np.int64))
        self.stats_.add_cpu(ids.numel(), int(hit_pos.numel()), host_bytes, slab_bytes)
        return entries

    # ------------------------------------------------------------------------------------------------
    # dynamic admission
    # ------------------------------------------------------------------------------------------------

    def _admit(self, ids: torch.Tensor, entries: torch.Tensor, out_u8: torch.Tensor) -> None:
        """After serving a batch: let the policy admit missed rows (taken from the decoded output)."""
        policy = self.policy
        assert isinstance(policy, SlotPolicy)
        hit = entries != EMPTY_ENTRY
        hit_slots = torch.div(entry_offsets(entries[hit]), self.slot_bytes, rounding_mode="floor")
        policy.record(ids, hit_slots)
        if policy.n_slots == 0:
            return
        miss_pos = torch.nonzero(~hit).reshape(-1)
        if miss_pos.numel() == 0:
            return
        cand, inverse, counts = torch.unique(ids[miss_pos], return_inverse=True, return_counts=True)
        first = torch.full((cand.numel(),), miss_pos.numel(), dtype=torch.int64, device=ids.device)
        first.scatter_reduce_(0, inverse, torch.arange(miss_pos.numel(), device=ids.device), "amin")
        keep = self._cacheable[cand]
        cand, counts, first = cand[keep], counts[keep], miss_pos[first[keep]]
        plan = policy.plan(cand, counts)
        if plan.empty:
            return
        if plan.evicted.numel():
            self.index.erase(plan.evicted)
        self._write_slots(plan.slots, plan.ids, out_u8[first[plan.picks]])
        self.index.insert(plan.ids, self._slot_entries(plan.slots, plan.ids))
        if self.index.wants_rebuild:
            self._rebuild_index()

    def _slot_entries(self, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        lens = self._lengths_dev[ids]
        return pack_entries(slots * self.slot_bytes, lens, lens < self.row_bytes, self.slab.slab_id, check=False)

    def _write_slots(self, slots: torch.Tensor, ids: torch.Tensor, rows_u8: torch.Tensor) -> None:
        """Store decoded rows ``rows_u8`` (raw bytes) into ``slots`` in the slab's format."""
        if not self.compress_cache:
            self.slot_view[slots] = rows_u8
            return
        codec = self.codec
        assert codec is not None
        k = ids.numel()
        if self.device.type == "cuda":  # the codec's own GPU encoder (it writes each row's length as it encodes)
            stage = torch.empty((k, self.row_bytes), dtype=torch.uint8, device=self.device)
            dst = stage.data_ptr() + torch.arange(k, dtype=torch.int64, device=self.device) * self.row_bytes
            got = torch.empty(k, dtype=torch.int32, device=self.device)
            codec.encode_rows_gpu(rows_u8.contiguous(), dst, got)
            self.slot_view[slots] = stage[:, : self.slot_bytes]
        else:
            offsets = (slots * self.slot_bytes).numpy()
            codec.encode_rows_at(rows_u8.contiguous().numpy(), self.slab.data.numpy(), offsets,
                                 self.cache_lengths[ids].numpy())

    def _rebuild_index(self) -> None:
        """Rebuild a hash index from the resident slots (drops tombstones; frees duplicate slots)."""
        policy = self.policy
        assert isinstance(policy, SlotPolicy)
        slots, ids = policy.resident()
        uniq, inverse = torch.unique(ids, return_inverse=True)
        first = torch.full((uniq.numel(),), slots.numel(), dtype=torch.int64, device=ids.device)
        first.scatter_reduce_(0, inverse, torch.arange(slots.numel(), device=ids.device), "amin")
        dup = torch.ones(slots.numel(), dtype=torch.bool, device=ids.device)
        dup[first] = False
        if bool(dup.any()):
            policy.free(slots[dup])
        slots, ids = slots[first], ids[first]
        self.index.build(ids, self._slot_entries(slots, ids))

    # ------------------------------------------------------------------------------------------------
    # reporting
    # ------------------------------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return mode_name(self.compress_cache, self.compress_host)

    @property
    def capacity_rows_raw(self) -> int:
        """Rows an uncompressed cache of the same budget holds."""
        return usable_bytes(self.budget_bytes) // self.row_bytes

    @property
    def ratio(self) -> float:
        """Dataset compression ratio under the codec (raw bytes / stored bytes, metadata excluded)."""
        if self.codec is None:
            return 1.0
        if self.host.packed is not None:
            return self.host.ratio
        return self.n_rows * self.row_bytes / max(int(self.cache_lengths.sum(dtype=torch.int64)), 1)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes: hits, misses, host bytes read, raw-equivalent bytes, GB/s, capacity...

        ``raw_bytes_equivalent`` is what fetching the same requests raw and uncached would have read;
        ``effective_gbps`` is output bytes per second over recent timed fetches (None before the first).
        Reading stats syncs the device.
        """
        with self._order.exclusive():
            snap = self.stats_.snapshot()
            status = int(self._probe_status[0])
            self._raise_pending_error()
        return {
            **snap,
            "mode": self.mode,
            "policy": self.policy_kind.value,
            "ratio": self.ratio,
            "host_ratio": self.host.ratio,
            "host_layout": self.host_layout,
            "transfer": self.host.stats()["transfer"],
            "fetch_paths": dict(self.path_counts),
            "transfer_ratio": (snap["raw_host_bytes_equivalent"] / snap["host_bytes_read"]
                               if snap["host_bytes_read"] else None),
            "capacity_rows": self.capacity_rows,
            "capacity_rows_raw": self.capacity_rows_raw,
            "capacity_increase": self.capacity_rows / self.capacity_rows_raw if self.capacity_rows_raw else None,
            "budget_bytes": self.budget_bytes,
            "used_bytes": self.slab.used_bytes,
            "slab_bytes": self.slab.nbytes,
            "slot_bytes": self.slot_bytes or None,
            "index": self.index.status(),
            "metadata_bytes": self.metadata_nbytes,
            "kernel_status": status,
            "fetch_blocks_per_sm": self.fetch_blocks_per_sm,
        }

    @property
    def metadata_nbytes(self) -> int:
        """Device bytes outside the slab: index, per-row host tables, policy state, codec tables."""
        extra = self.index.nbytes + self.host.device_table_nbytes
        if self.codec is not None:
            extra += self.codec.metadata_nbytes
        if self.dynamic:
            extra += self._lengths_dev.numel() * 4 + self.policy.nbytes  # type: ignore[attr-defined]
        return extra

    def reset_stats(self) -> None:
        """Zero the counters and timings (cache contents stay)."""
        with self._order.exclusive():
            self.stats_.reset()
            self._probe_status.zero_()

    def __repr__(self) -> str:
        return (f"FeatureCache(mode={self.mode}, policy={self.policy_kind.value}, device={self.device}, "
                f"n_rows={self.n_rows}, row_bytes={self.row_bytes}, budget_bytes={self.budget_bytes}, "
                f"capacity_rows={self.capacity_rows})")
