"""KV-cache offload for LLM decoding: K/V rows kept (losslessly compressed) in host memory, fetched by the GPU.

Long-context decoding that keeps the KV cache in CPU memory is bound by PCIe (paper section 6.4). The
manager stores every layer's K and V as rows of ``head_dim`` values, one per (token, batch, head) — the
unit InfiniGen fetches — numbered by *slot* (token-major), in the engine's append-only packed store,
:class:`~ibpcache.cache.append_store.AppendStore`: per request it chooses one codec per layer and tensor on a
sample of the prompt (IBP, exponent coding or raw, whichever stores the sample smallest, see
:func:`~ibpcache.cache.plan_codecs.choose_row_codecs`), and each append's rows are encoded on the GPU and packed back
to back in pinned host memory, so host memory and PCIe bytes shrink with the ratio. A fetch turns token indices
into (position, length) pairs on the GPU and decodes K and V in one launch; an append is two launches. Neither
waits for the device. A layer's decode step can be captured in a CUDA graph
(:meth:`KVOffloadManager.capture_decode_step`).

Prefill (time to first token): a layer's prompt (and any large append: a prefill piece) goes to a worker thread
that fits the layer's codecs on a sample, places and encodes the rows on its own stream into a device buffer and
copies that to pooled pinned chunks (:mod:`~ibpcache.cache.host_pool`), while the caller's thread goes on launching
the model's next layers. The caller never waits for it unless it reads or appends to that layer (or too many
bytes are in flight); every operation on a layer first waits for that layer's jobs and orders the current stream
after them.

The manager knows the decoder's KV geometry only (layers, KV heads, head dim, dtype), never a model:
:class:`ibpcache.loaders.kv.IBPOffloadedCache` (a transformers ``Cache``) puts it under ``model.generate``.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codec import Codec
from ..errors import (CapacityError, DeviceError, InvalidArgumentError, InvalidIdsError, InvalidTypeError,
                      RowDtypeError, StateError)
from .append_store import (AppendStore, RowCodec, StagedChunks, chunk_bytes_for, chunk_margin,
                           measure_scattered)
from .host_pool import host_pool
from .cpu_gather_store import CpuGatherStore
from .kv_slots import SlotLayout
from .step_graphs import generator_kept
from .plan_codecs import ROW_METHODS, RowCodecChoice, ScatteredCost, apply_scattered_cost, choose_row_codecs

__all__ = ["KVOffloadManager", "KVStepGraph", "TRANSFERS", "DENSE_FETCHES", "PREFILLS", "pin_ahead", "host_blocks_for"]

TRANSFERS = ("zero_copy", "cpu_gather", "host")
"""``zero_copy``: GPU reads packed pinned host rows through UVA and decodes them (ours). ``cpu_gather``: InfiniGen's
path, the CPU gathers the rows into a staging buffer and copies it in bulk (baseline, raw rows only).
``host``: no CUDA; the same packed store in plain memory with the Numba twins (CI): identical stored bytes."""

DENSE_FETCHES = ("bulk", "zero_copy")
"""How a fetch of every token reads a GPU store (see ``KVOffloadManager(dense_fetch=...)``)."""

PREFILLS = ("auto", "async", "sync")
"""Who stores a prompt (see ``KVOffloadManager(prefill=...)``)."""

_ASYNC_MIN_BYTES = 1 << 20
"""Appends whose worst case (all rows raw) reaches this go to the prefill worker, as does every layer's first: the
hand-off costs ~0.1 ms, which a decode step's small append would not win back."""

_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _identity_codec(row_bytes: int, dtype: torch.dtype, row_shape: tuple[int, ...]) -> Codec:
    """The raw codec (:meth:`Codec.raw`) for these rows: gives the uncompressed variant the same kernels."""
    codec = Codec.raw(dtype, row_shape)
    assert codec.row_bytes == row_bytes, (codec.row_bytes, row_bytes)
    return codec


def _check_geometry(dtype: object, **counts: object) -> None:
    """Raise naming the first argument that is not a positive int, or a dtype the KV stores do not hold."""
    for name, val in counts.items():
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise InvalidArgumentError(f"{name}: expected a positive int, got {val!r}")
    if dtype not in _KV_DTYPES:
        raise InvalidTypeError(f"dtype: expected one of {_KV_DTYPES}, got {dtype}")


def host_blocks_for(num_layers: int, rows_per_token: int, row_bytes: int, raw: int, compress: bool,
                    host_chunk_bytes: int = 4 << 20, chunk: "int | None" = None) -> "tuple[int, int]":
    """The pinned blocks (bytes each, count) that ``num_layers`` layers' zero-copy stores take for a prompt of
    ``raw`` bytes (K + V, per layer): one chunk and its margin per block; per layer the raw size over a conservative
    ratio (1.25 with compression: real KV codecs store >= 1.4x) plus one chunk. ``chunk``: the stores' chunk size
    where their first prompt fixed it (else the size a prompt of ``raw`` bytes gets)."""
    chunk = chunk or chunk_bytes_for(rows_per_token, row_bytes, None, host_chunk_bytes, raw)
    ratio = 1.25 if compress else 1.0
    return chunk + chunk_margin(row_bytes), num_layers * (-(-int(raw / ratio) // chunk) + 1)


def pin_ahead(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, batch_size: int, tokens: int,
              *, compress: bool = True, host_chunk_bytes: int = 4 << 20) -> int:
    """Start pinning, on the pool's background thread, the host blocks that a prompt of ``tokens`` tokens for
    ``batch_size`` sequences will take (:func:`host_blocks_for`); returns the bytes asked for (0 without CUDA).

    Why: page-locking runs at ~2-2.5 GB/s and does not scale with threads (``scripts/experiments/pin_rate.py``), so
    the first prefill of a process waits for it (a 32k x 4 Llama-8B prompt: 6-9 s). Called while the model loads,
    the blocks are pinned before that prefill asks for them; they stay in the process's pool for later stores."""
    _check_geometry(dtype, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    batch_size=batch_size, tokens=tokens)
    if not torch.cuda.is_available():
        return 0
    row_bytes = head_dim * torch.empty((), dtype=dtype).element_size()
    rows_per_token = batch_size * num_kv_heads
    block, count = host_blocks_for(num_layers, rows_per_token, row_bytes, 2 * tokens * rows_per_token * row_bytes,
                                   compress, host_chunk_bytes)
    host_pool().prepare(block, count)
    return block * count


_SCATTERED_COSTS: "dict[tuple, ScatteredCost]" = {}


def _scattered_key(method: str, rows: torch.Tensor, rows_per_token: int, store_bytes: int) -> "tuple[tuple, int]":
    """What a scattered read's cost depends on (GPU, dtype and row shape of ``rows`` [N, ...], N unused; codec
    method; power-of-two store size: how far reads spread changes what they cost), and the store size measured (the
    prompt's, up to 512 MiB)."""
    size = min(int(store_bytes), 512 << 20)
    return (str(rows.device), rows.dtype, tuple(rows.shape[1:]), rows_per_token, method, size.bit_length()), size


def scattered_cost(codec: Any, sample: torch.Tensor, rows_per_token: int, store_bytes: int = 64 << 20) -> ScatteredCost:
    """:func:`~ibpcache.cache.append_store.measure_scattered` once per process and :func:`_scattered_key` (the
    codec's own tables barely matter), measured with the first codec and sample that ask, on a store of
    ``store_bytes`` raw bytes (the layer's prompt size, up to 512 MiB: the reads then spread over as many pages as a
    real layer's)."""
    key, size = _scattered_key(codec.method, sample, rows_per_token, store_bytes)
    if key not in _SCATTERED_COSTS:
        _SCATTERED_COSTS[key] = measure_scattered(codec, sample, rows_per_token, store_bytes=size)
    return _SCATTERED_COSTS[key]


@dataclass
class _Pending:
    """A fetch started on the side stream (or the gather thread) and not consumed yet."""

    idx: "torch.Tensor | None"
    n_tokens: int
    extra: int
    keys: torch.Tensor
    values: torch.Tensor
    event: "torch.cuda.Event | None" = None
    future: "Future | None" = None
    refs: tuple = ()  # tensors the side stream still reads: must outlive it

    def matches(self, idx: "torch.Tensor | None", n_tokens: int, extra: int) -> bool:
        return self.idx is idx and self.n_tokens == n_tokens and self.extra == extra

    def done_event(self) -> "torch.cuda.Event | None":
        if self.future is not None:
            self.event = self.future.result()
            self.future = None
        return self.event


@dataclass
class _LayerState:
    """One layer: ``kv`` (the packed append store: zero-copy and host paths) or ``gather`` (CPU-gather baseline)."""

    kv: "AppendStore | None" = None
    gather: "CpuGatherStore | None" = None
    job: "Future | None" = None  # the layer's latest prefill-worker job (jobs run in order: waiting for it waits all)
    job_done: "torch.cuda.Event | None" = None  # CUDA: recorded on the worker's stream after that job's copies
    n_tokens: int = 0
    fit_s: float = 0.0
    choices: tuple = ()  # (K, V) RowCodecChoice of the planner
    pending: "_Pending | None" = None
    written: list = field(default_factory=list)
    slots: SlotLayout = field(default_factory=SlotLayout)  # which slot holds each (token, batch row, head)
    # CUDA: recorded after the layer's latest append. A bulk prefetch's copies wait for it, not for everything the
    # current stream has queued: waiting there would also wait for the previous layer's decode, serialising copy
    # and decode (measured on the H100: 1.40 s/token at 32k instead of the ~1 s the copies take).
    appended: "torch.cuda.Event | None" = None


class KVOffloadManager:
    """Per-layer K/V of a decoder, offloaded to host memory as losslessly compressed rows, packed per append.

    Args:
        num_layers, num_kv_heads, head_dim, dtype: the decoder's KV geometry (fp16, bf16 or fp32).
        batch_size: sequences decoded together; rows are kept per (token, batch, head).
        device: where attention runs ("cuda" for the GPU paths, "cpu" for the Numba path); default cuda if present.
        compress: compress the rows (codecs chosen per layer and K/V at the first append). False stores raw rows.
        codec: with ``compress``, the codec of every layer and tensor: ``"auto"`` (default: per layer and K/V,
            whichever of IBP, exponent coding and raw stores the prompt's sample in the fewest bytes), ``"ibp"``,
            ``"exponent"`` (bf16/fp16 only) or ``"raw"``.
        transfer: one of :data:`TRANSFERS`, or "auto" (``zero_copy`` on CUDA, ``host`` on CPU).
        sample_rows: rows of the prompt the per-layer fit looks at (the paper samples; 10% loses ~nothing).
        threshold, chunk_bytes: passed to :meth:`Codec.fit` ("auto" searches both). ``chunk_bytes="auto_once"``
            searches the chunk size on the first layer fitted (K and V separately) and reuses it for the others:
            one fit-size pass per codec instead of four (prefill fit time), same stored format.
        reserve_tokens: per-slot metadata to allocate up front per layer (prompt + new tokens avoids growth).
        host_chunk_bytes: the largest host chunk of the packed store (chunks grow from a small size to this).
        timing: record CUDA events around every transfer, summarised by :meth:`stats` (benchmarks).
        count_bytes: keep exact PCIe byte counters (an atomic add per row in the transfer kernels; turn off
            when timing end-to-end latency).
        dense_fetch: how a fetch of every stored token reads a GPU store: ``"bulk"`` (default) copies the layer's
            packed chunks to the device with one DMA copy each, then decodes from device memory (a dense fetch
            reads every stored byte anyway, and the copy engine reaches PCIe's bulk rate, which scattered zero-copy
            reads of small rows do not); ``"zero_copy"`` decodes straight from pinned host memory (no device
            buffer for the chunks). Selected tokens (sparse) are always read zero-copy; a captured decode step
            (:meth:`capture_decode_step`) too.
        prefill: who stores a layer's first append (its prompt) and every append of >= 1 MiB worst case:
            ``"async"`` a worker thread on its own CUDA stream (fit on a sample, encode into a device buffer, DMA to
            pooled pinned chunks) while the caller goes on; ``"sync"`` the caller, on its stream (one host sync
            per such append); ``"auto"`` (default): async on CUDA with the zero-copy store, sync otherwise (the
            CPU path can be asked for ``"async"``: the same ordering, a thread running the Numba encoders).
        prefill_inflight_bytes: device bytes of appended rows the worker may hold before :meth:`append` waits for
            it (backpressure); None: half the device memory free when the manager is created.
        scattered_reads: the stores will mostly be read by selections of a few hundred tokens per head (sparse
            mode). With compression and ``codec="auto"`` on the zero-copy path, each layer and side then keeps its
            codec only where the store's own fetch of selected coded rows, timed against raw rows on this GPU once
            per process and geometry (:func:`~ibpcache.cache.append_store.measure_scattered`), is faster at the
            layer's ratio by :data:`~ibpcache.cache.plan_codecs.SCATTERED_MARGIN`; else it stores raw rows
            (``stats()["codecs"]`` shows the costs compared). A named ``codec`` is used as named.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        batch_size: int = 1,
        device: "str | torch.device | None" = None,
        compress: bool = True,
        transfer: str = "auto",
        sample_rows: int = 4096,
        threshold: "float | str" = "auto",
        chunk_bytes: "int | str" = "auto",
        reserve_tokens: int = 0,
        host_chunk_bytes: int = 4 << 20,
        codec: str = "auto",
        timing: bool = False,
        count_bytes: bool = True,
        dense_fetch: str = "bulk",
        prefill: str = "auto",
        prefill_inflight_bytes: "int | None" = None,
        scattered_reads: bool = False,
    ) -> None:
        _check_geometry(dtype, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        batch_size=batch_size, sample_rows=sample_rows)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise DeviceError("device='cuda' was requested but no CUDA GPU is available (use device='cpu')")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.type != "cpu":
            raise InvalidArgumentError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if transfer == "auto":
            transfer = "zero_copy" if dev.type == "cuda" else "host"
        if transfer not in TRANSFERS:
            raise InvalidArgumentError(f"transfer must be one of {TRANSFERS} or 'auto', got {transfer!r}")
        if (transfer == "host") != (dev.type == "cpu"):
            raise InvalidArgumentError(f"transfer={transfer!r} does not run on device {dev} ('host' is the CPU path; "
                                       f"'zero_copy' and 'cpu_gather' need CUDA)")
        if transfer == "cpu_gather" and compress:
            raise InvalidArgumentError("transfer='cpu_gather' is InfiniGen's uncompressed baseline: pass "
                                       "compress=False")
        if dense_fetch not in DENSE_FETCHES:
            raise InvalidArgumentError(f"dense_fetch must be one of {DENSE_FETCHES}, got {dense_fetch!r}")
        if codec not in ROW_METHODS:
            raise InvalidArgumentError(f"codec must be one of {ROW_METHODS}, got {codec!r}")
        if prefill not in PREFILLS:
            raise InvalidArgumentError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
        if compress and codec == "exponent" and dtype not in (torch.float16, torch.bfloat16):
            raise RowDtypeError(f"codec='exponent' codes bfloat16/float16 rows, not {dtype} (use 'auto', 'ibp' or "
                                "'raw')")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.batch_size, self.dtype, self.device = batch_size, dtype, dev
        self.compress, self.transfer = bool(compress), transfer
        self.codec_method = codec if compress else "raw"
        self.sample_rows, self.threshold, self.chunk_bytes = sample_rows, threshold, chunk_bytes
        self.reserve_tokens, self.host_chunk_bytes = int(reserve_tokens), int(host_chunk_bytes)
        self.dense_fetch = dense_fetch
        self.timing = bool(timing)
        self.count_bytes = bool(count_bytes)
        if prefill == "auto":
            prefill = "async" if transfer == "zero_copy" else "sync"
        if prefill == "async" and transfer == "cpu_gather":
            raise InvalidArgumentError("prefill='async' stores through the packed store; transfer='cpu_gather' (the "
                                       "InfiniGen baseline) stores its prompts as the baseline does: prefill='sync'")
        self.prefill = prefill
        self.scattered_reads = bool(scattered_reads)
        if prefill_inflight_bytes is None:
            prefill_inflight_bytes = torch.cuda.mem_get_info(dev)[0] // 2 if dev.type == "cuda" else 1 << 30
        self.prefill_inflight_bytes = max(1, int(prefill_inflight_bytes))
        self._inflight = 0  # bytes held by queued worker jobs
        self._inflight_cond = threading.Condition()
        self._worker: "ThreadPoolExecutor | None" = None
        self._prefill_stream = torch.cuda.Stream(dev) if dev.type == "cuda" and prefill == "async" else None
        self._pin_chunk: "int | None" = None  # the stores' chunk size, once the first prompt fixed it
        self.row_bytes = head_dim * torch.empty((), dtype=dtype).element_size()
        self.rows_per_token = batch_size * num_kv_heads
        self._layers = [_LayerState() for _ in range(num_layers)]
        self._bh_cache: dict[torch.device, torch.Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._chunk_once: dict[str, int] = {}  # chunk_bytes="auto_once": the size found for "k" / "v"
        self._side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        # bulk dense prefetches copy on their own stream, so that layer i+1's copy overlaps layer i's decode
        self._copy = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-cpu-gather") if transfer == "cpu_gather" else None
        self._reset_counters()
        if self._prefill_stream is not None:  # compile the kernels the first prompt needs while the model computes
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-prefill")
            self._worker.submit(self._load_kernels)

    def _load_kernels(self) -> None:
        """Worker thread: build (or load from CuPy's cache) the modules a prompt's store uses, ahead of its first job:
        in a fresh process that takes seconds (NVRTC), which the first prefill then does not wait for. A build error
        is not reported here: the job that needs the module raises it."""
        from ..kernels._build import get_function

        symbols = [("kv_packed.cu", "ibp_kvp_size")]
        if self.compress:  # the fit's size kernels
            symbols += [("exponent.cu", "ibp_exp_sizes_e2"), ("bitpack.cu", "ibp_bitcount")]
        with torch.cuda.device(self.device):
            for src, symbol in symbols:
                get_function(src, symbol, self.device.index)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self.decode_steps = 0
        self._read_host = 0  # bytes moved by paths that know them on the host
        self._read_worker = 0  # same, counted by the gather thread
        self._written_host = 0
        # zero-copy kernels add the bytes they move here (atomically: any stream may read or write)
        zc = self.transfer == "zero_copy" and self.count_bytes
        self._dev_read = torch.zeros(1, dtype=torch.int64, device=self.device) if zc else None
        self._dev_written = torch.zeros(1, dtype=torch.int64, device=self.device) if zc else None
        self._timings: list[tuple[Any, Any]] = []  # (start, end) CUDA events of every timed transfer

    def _count(self, moved: int, counter: str) -> None:
        """Add bytes moved by the CPU-gather and host paths (known on the host)."""
        if counter == "read_worker":
            self._read_worker += moved
        elif counter == "read":
            self._read_host += moved
        else:
            self._written_host += moved

    def _timed_start(self) -> "torch.cuda.Event | None":
        if not (self.timing and self.device.type == "cuda"):
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _timed_end(self, start: "torch.cuda.Event | None") -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timings.append((start, end))

    def _state(self, layer: int) -> _LayerState:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise InvalidIdsError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return self._layers[layer]

    def seq_length(self, layer: int) -> int:
        """Tokens stored for ``layer``."""
        return self._state(layer).n_tokens

    def codecs(self, layer: int) -> "tuple[RowCodec, RowCodec] | None":
        """The (K, V) codecs chosen for ``layer`` (None before its first append)."""
        st = self._ready(self._state(layer))
        if st.kv is not None:
            return st.kv.codecs
        return None if st.gather is None else st.gather.codecs

    # -- the prefill worker -----------------------------------------------------------------------
    def _ready(self, st: _LayerState) -> _LayerState:
        """Wait for the layer's prefill-worker jobs (re-raising their errors) and order the current stream after
        their device work. Every operation that touches a layer's store starts here."""
        job = st.job
        if job is not None:
            job.result()
            if st.job is job:
                st.job = None
        ev, st.job_done = st.job_done, None
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        return st

    def _ready_all(self) -> None:
        for st in self._layers:
            self._ready(st)

    def flush(self) -> None:
        """Wait until every append handed to the prefill worker is stored (errors it met are raised here). Reads
        and appends of a layer wait for that layer's jobs by themselves; this is for timing a whole prefill."""
        self._ready_all()

    def _is_async(self, st: _LayerState, worst: int) -> bool:
        return self.prefill == "async" and (worst >= _ASYNC_MIN_BYTES or (st.kv is None and st.job is None))

    def _submit(self, layer: int, st: _LayerState, keys: torch.Tensor, values: torch.Tensor,
                into: "tuple[torch.Tensor, torch.Tensor] | None", donate: bool) -> None:
        """Hand an append to the prefill worker; the caller only does the slot bookkeeping and the attention copy."""
        n = keys.shape[2]
        if not donate:  # the caller may reuse its buffers once append returns
            keys, values = keys.clone(), values.clone()
        if into is not None:
            into[0][:, :, -n:].copy_(keys)
            into[1][:, :, -n:].copy_(values)
        first = st.kv is None and st.job is None
        t0 = st.n_tokens
        slot0 = st.slots.place(t0, n, self.batch_size, self.num_kv_heads, self.device)
        st.n_tokens += n
        if layer == 0 and not first:
            self.decode_steps += 1
        nbytes = 2 * keys.numel() * keys.element_size()
        if layer == 0:
            self._pin_ahead(nbytes)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        with self._inflight_cond:
            while self._inflight and self._inflight + nbytes > self.prefill_inflight_bytes:
                self._inflight_cond.wait()
            self._inflight += nbytes
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="kv-prefill")
        st.job = self._worker.submit(self._job, st, keys, values, slot0, t0, ready, nbytes)

    def _job(self, st: _LayerState, keys: torch.Tensor, values: torch.Tensor, slot0: int, t0: int,
             ready: "torch.cuda.Event | None", nbytes: int) -> None:
        """Worker thread: store an append on the worker's stream (after the caller's stream made the rows)."""
        try:
            if ready is None:
                self._store(st, keys, values, slot0, t0)
                return
            stream = self._prefill_stream
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                try:
                    self._store(st, keys, values, slot0, t0)
                finally:  # the rows' memory is reused only after what this stream enqueued read them
                    keys.record_stream(stream)
                    values.record_stream(stream)
                done = torch.cuda.Event()
                done.record(stream)
                st.job_done = done
        finally:
            with self._inflight_cond:
                self._inflight -= nbytes
                self._inflight_cond.notify_all()

    def _pin_ahead(self, raw: int) -> None:
        """At layer 0's prompt (or prefill piece) of ``raw`` bytes (K + V): ask the pinned pool to have the blocks
        every layer's will need (:func:`host_blocks_for`) pinned by its background thread, while the model
        computes. Under-estimating costs the worker a synchronous pin, never the caller."""
        if self.device.type != "cuda" or self.transfer != "zero_copy":
            return
        if self._pin_chunk is None:  # the stores' chunk size follows from their first append (all alike)
            self._pin_chunk = chunk_bytes_for(self.rows_per_token, self.row_bytes, None, self.host_chunk_bytes, raw)
        host_pool().prepare(*host_blocks_for(self.num_layers, self.rows_per_token, self.row_bytes, raw,
                                             self.compress, self.host_chunk_bytes, self._pin_chunk))

    def _store(self, st: _LayerState, keys: torch.Tensor, values: torch.Tensor, slot0: int, t0: int) -> None:
        """Fit the layer's codecs if it has no store yet, then append (a large append syncs once, on this stream)."""
        if st.kv is None and st.gather is None:
            self._fit_layer(st, keys, values)
        self._write(st, keys, values, slot0, t0, None)

    # -- writing ----------------------------------------------------------------------------------
    def _check_kv(self, x: object, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise InvalidTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise InvalidTypeError(f"{name}: expected dtype {self.dtype}, got {x.dtype}")
        if x.device != self.device:
            raise InvalidArgumentError(f"{name}: expected a tensor on {self.device}, got {x.device}")
        want = (self.batch_size, self.num_kv_heads)
        if x.dim() != 4 or tuple(x.shape[:2]) != want or x.shape[3] != self.head_dim:
            raise InvalidArgumentError(f"{name}: expected shape [{want[0]}, {want[1]}, n_tokens, {self.head_dim}], "
                                       f"got {tuple(x.shape)}")
        return x

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, n, D] -> token-major typed rows [n * B * H, D] (slot order)."""
        return x.permute(2, 0, 1, 3).reshape(-1, self.head_dim).contiguous()

    def _fit_sample(self, x: torch.Tensor) -> torch.Tensor:
        """``sample_rows`` token-major rows of ``x`` [B, H, n, D] drawn with replacement, where x lives (no host round
        trip, no sync): the rows ``_rows(x)[idx]`` would give, gathered without copying the whole prompt."""
        b, h, n = x.shape[0], x.shape[1], x.shape[2]
        total = n * b * h
        if total <= self.sample_rows:
            return self._rows(x)
        gen = self._generators.get(x.device)
        if gen is None:
            gen = self._generators[x.device] = torch.Generator(device=x.device).manual_seed(0)
        idx = torch.randint(0, total, (self.sample_rows,), device=x.device, generator=gen)
        tok, bh = idx // (b * h), idx % (b * h)
        return x[bh // h, bh % h, tok]

    def _make_codecs(self, samples: "list[torch.Tensor]", prompt_bytes: int = 0) -> "list[RowCodecChoice]":
        """Codec choices for ``samples`` (K0, V0, K1, V1, ... rows; the engine's planner); for scattered reads on the
        GPU, each checked against the measured cost of fetching its rows from a store of ``prompt_bytes`` (raw where
        coded rows fetch slower)."""
        if not self.compress:
            ident = RowCodecChoice(_identity_codec(self.row_bytes, self.dtype, (self.head_dim,)), "raw", {})
            return [ident] * len(samples)
        method = self.codec_method
        choices: list[RowCodecChoice] = []
        if self.chunk_bytes == "auto_once" and "k" not in self._chunk_once and method in ("auto", "ibp"):
            choices += choose_row_codecs(samples[:2], method, self.threshold, "auto")  # sizes searched on layer one
            self._chunk_once.update(k=choices[0].ibp_chunk_bytes, v=choices[1].ibp_chunk_bytes)
        if self.chunk_bytes == "auto_once":
            once = [self._chunk_once.get("k", "auto"), self._chunk_once.get("v", "auto")]
            chunks: "list[int | str]" = once * ((len(samples) - len(choices)) // 2)
        else:
            chunks = [self.chunk_bytes] * (len(samples) - len(choices))
        choices += choose_row_codecs(samples[len(choices):], method, self.threshold, chunks)
        if self._measures_scattered():
            choices = [apply_scattered_cost(c, None if c.method == "raw" else
                                            scattered_cost(c.codec, x, self.rows_per_token, max(prompt_bytes, 1 << 20)))
                       for c, x in zip(choices, samples)]
        return choices

    def _calibrate_scattered(self, keys: torch.Tensor) -> None:
        """Before a layer's prompt is stored: time scattered reads (:func:`scattered_cost`) of every codec the
        planner may pick for these rows, with the device drained, unless this process already has them for this
        geometry and size. The fits that follow (the prefill worker's, beside the model's prefill kernels) then find
        them measured: timed there, they were 11-45x the idle cost (one 32k prefill on the H100: coded rows at 87.7
        ns/row against 7.8 idle; on the H200 raw rows at 352.8), so the choice followed the noise. Costs the first
        prompt of a geometry one device sync and the measurement (its pinned blocks go back to the pool, where the
        store takes them)."""
        if not self._measures_scattered():
            return
        prompt = max(2 * keys.numel() * keys.element_size(), 1 << 20)
        methods = ["ibp"] + (["exponent"] if self.dtype in (torch.float16, torch.bfloat16) else [])
        shape = keys[0, 0]  # [n, D]: the rows' device, dtype and shape, without a copy
        todo = [m for m in methods if _scattered_key(m, shape, self.rows_per_token, prompt)[0] not in _SCATTERED_COSTS]
        if not todo:
            return
        b, h = keys.shape[0], keys.shape[1]
        sample = self._rows(keys[:, :, : -(-self.sample_rows // (b * h))])  # the first tokens: any real rows do
        cuda = self.device.type == "cuda"
        with torch.cuda.device(self.device) if cuda else nullcontext():  # the stores' device, as on the worker
            if cuda:
                torch.cuda.synchronize(self.device)
            for method in todo:
                scattered_cost(Codec.fit(sample, method=method), sample, self.rows_per_token, prompt)

    def _measures_scattered(self) -> bool:
        """Whether codecs are checked against the measured cost of scattered reads (sparse mode's GPU store; only
        with ``codec="auto"``: a codec the caller named is used as named)."""
        return self.scattered_reads and self.codec_method == "auto" and self._zero_copy_gpu()

    def _zero_copy_gpu(self) -> bool:
        """Whether the stores are read zero-copy by GPU kernels (where a scattered fetch's cost can be timed)."""
        return self.transfer == "zero_copy" and self.device.type == "cuda"

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
               into: "tuple[torch.Tensor, torch.Tensor] | None" = None, *, donate: bool = False) -> None:
        """Store new tokens' K/V ([B, H, n, D] each) after the layer's existing tokens.

        The first append of a layer (the prompt) also fits that layer's K and V codecs on a sample of its rows (the
        time this takes is kept per layer: ``stats()['fit_s']``). With ``prefill="async"`` it, and any append of
        >= 1 MiB worst case, is stored by the prefill worker: this call returns at once (a copy of the rows on the
        current stream, none with ``donate``). Other appends (decode steps) are compressed on the GPU and written to
        pinned memory without a host sync.
        ``into``: the [B, H, W, D] buffers :meth:`take` returned; their last n token positions get the new
        tokens too (on the zero-copy path in the same launch as the append).
        ``donate``: the caller will not write ``keys``/``values`` again, so the worker may read them as they are.
        """
        st = self._state(layer)
        keys, values = self._check_kv(keys, "keys"), self._check_kv(values, "values")
        if keys.shape != values.shape:
            raise InvalidArgumentError(f"keys and values differ in shape: {tuple(keys.shape)} vs {tuple(values.shape)}")
        n = keys.shape[2]
        if n == 0:
            return
        # A prefetch not taken is stale after this append (take matches on the token count); retiring it orders
        # the current stream after its reads, so chunks this append changes are never read half-written.
        self._retire(st)
        if st.kv is None and st.gather is None and st.job is None:
            self._calibrate_scattered(keys)
        if self._is_async(st, 2 * keys.numel() * keys.element_size()):
            self._submit(layer, st, keys, values, into, donate)
            return
        self._ready(st)
        first = st.kv is None and st.gather is None
        if first:
            self._fit_layer(st, keys, values)
        elif layer == 0:
            self.decode_steps += 1
        t0 = st.n_tokens
        slot0 = st.slots.place(t0, n, self.batch_size, self.num_kv_heads, self.device)
        self._write(st, keys, values, slot0, t0, into)
        st.n_tokens += n

    def _write(self, st: _LayerState, keys: torch.Tensor, values: torch.Tensor, slot0: int, t0: int,
               into: "tuple[torch.Tensor, torch.Tensor] | None") -> None:
        """Store [B, H, n, D] keys/values as tokens ``t0 .. t0 + n - 1`` from slot ``slot0`` (placed by the layer's
        :class:`SlotLayout`: slots of tokens cropped away are reused; a new batch size starts a segment)."""
        n = keys.shape[2]
        need = slot0 + n * self.rows_per_token
        reserve = max(need, self.reserve_tokens * self.rows_per_token)
        if st.kv is not None:
            if need > st.kv.slot_cap:
                st.kv.reserve(reserve)
            att_pos0 = 0 if into is None else into[0].shape[2] - n
            moved = st.kv.append(keys, values, slot0, t0, into=into, att_pos0=att_pos0, written=self._dev_written)
            self._count(moved, "write")
            self._mark_appended(st)
        else:
            if need > st.gather.slot_cap:
                st.gather.reserve(reserve)
            self._count(st.gather.append(keys, values, slot0), "write")
            if into is not None:
                into[0][:, :, -n:].copy_(keys)
                into[1][:, :, -n:].copy_(values)

    @staticmethod
    def _mark_appended(st: _LayerState) -> None:
        """Record (on the current stream) that every append of this layer so far has been enqueued."""
        if st.kv is not None and st.kv.cuda:
            if st.appended is None:
                st.appended = torch.cuda.Event()
            st.appended.record()

    def _fit_layer(self, st: _LayerState, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fit the layer's K and V codecs on its prompt and create its store (timed on its own: the current stream
        is drained first, so ``fit_s`` is the fit's time, not the model's)."""
        cuda = self.device.type == "cuda"
        if cuda and self.compress:
            torch.cuda.current_stream(self.device).synchronize()
        t0 = time.perf_counter()
        samples = [self._fit_sample(x) for x in (keys, values)] if self.compress else [keys, values]
        k_choice, v_choice = self._make_codecs(samples, 2 * keys.numel() * keys.element_size())
        st.choices = (k_choice, v_choice)
        if self.transfer == "cpu_gather":
            st.gather = CpuGatherStore(k_choice.codec, v_choice.codec, self.device)
        else:
            st.kv = AppendStore(k_choice.codec, v_choice.codec, self.device, rows_per_token=self.rows_per_token,
                                max_chunk_bytes=self.host_chunk_bytes,
                                slots=self.reserve_tokens * self.rows_per_token,
                                expected_bytes=2 * keys.numel() * keys.element_size())
        if cuda and self.compress:
            torch.cuda.current_stream(self.device).synchronize()
        st.fit_s = time.perf_counter() - t0 if self.compress else 0.0

    # -- reading ----------------------------------------------------------------------------------
    def _check_idx(self, token_idx: object, n_tokens: int) -> torch.Tensor:
        """Token indices [B, H, k] (int64/int32) in [0, n_tokens): one reduction, one sync."""
        if not isinstance(token_idx, torch.Tensor):
            raise InvalidTypeError(f"token_idx: expected an int64 torch.Tensor, got {type(token_idx).__name__}")
        if token_idx.dtype not in (torch.int64, torch.int32):
            raise InvalidIdsError(f"token_idx: expected dtype int64 (or int32), got {token_idx.dtype}")
        want = (self.batch_size, self.num_kv_heads)
        if token_idx.dim() != 3 or tuple(token_idx.shape[:2]) != want:
            raise InvalidIdsError(f"token_idx: expected shape [{want[0]}, {want[1]}, k], got {tuple(token_idx.shape)}")
        idx = token_idx.to(device=self.device, dtype=torch.int64)
        if idx.numel():
            lo, hi = (int(v) for v in torch.aminmax(idx))
            if lo < 0:
                raise InvalidIdsError(f"token_idx: negative token index {lo} (indices must be in [0, {n_tokens}))")
            if hi >= n_tokens:
                raise InvalidIdsError(f"token_idx: token index {hi} is out of range for {n_tokens} stored tokens")
        return idx

    def _bh(self, device: torch.device) -> torch.Tensor:
        """[B, H, 1] int64: b * H + h, the slot of (b, h) within one token (cached per device)."""
        bh = self._bh_cache.get(device)
        if bh is None:
            bh = torch.arange(self.rows_per_token, device=device).view(self.batch_size, self.num_kv_heads, 1)
            self._bh_cache[device] = bh
        return bh

    def _slots(self, st: _LayerState, idx: torch.Tensor) -> torch.Tensor:
        """[B, H, k] token indices -> flat slot ids in [B, H, k] order: ``(t * B + b) * H + h`` (one kernel), or
        ``row0[t, b] + h`` after a beam reorder / batch selection."""
        if st.slots.row0 is None:
            return torch.add(self._bh(idx.device), idx, alpha=self.rows_per_token).reshape(-1)
        row0 = st.slots.row0.to(idx.device)
        b = torch.arange(self.batch_size, device=idx.device).view(-1, 1, 1)
        h = torch.arange(self.num_kv_heads, device=idx.device).view(1, -1, 1)
        return (row0.view(-1)[idx * self.batch_size + b] + h).reshape(-1)

    def _alloc(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.batch_size, self.num_kv_heads, n, self.head_dim)
        return (torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device))

    def _out_rows(self, k: int, width: int) -> "torch.Tensor | None":
        """Destination rows of a [B, H, k] read inside [B, H, width] buffers (None when width == k)."""
        if width == k:
            return None
        bh = torch.arange(self.rows_per_token, device=self.device).view(-1, 1) * width
        return (bh + torch.arange(k, device=self.device).view(1, -1)).reshape(-1)

    def _bulk(self, st: _LayerState, idx: "torch.Tensor | None") -> bool:
        """Whether this read copies the layer's chunks in bulk first (a dense read of a GPU store)."""
        return idx is None and self.dense_fetch == "bulk" and st.kv is not None and st.kv.cuda

    def _read(self, st: _LayerState, idx: "torch.Tensor | None", out: tuple[torch.Tensor, torch.Tensor],
              counter: str = "read", staged: "StagedChunks | None" = None) -> None:
        """Fill ``out`` ([B, H, k + extra, D]) with the rows of ``idx`` (None: every stored token).

        Runs on the current stream (the side stream when prefetching). ``staged``: the layer's chunks already
        being copied to the device (bulk prefetch); a bulk read without it copies them on the current stream."""
        if self._bulk(st, idx):
            if staged is None:
                staged = st.kv.stage_chunks()
            st.kv.fetch(None, st.n_tokens, out[0], out[1], row0=st.slots.row0, staged=staged)
            self._count(staged.nbytes, counter)  # the DMA copies' bytes: what crossed PCIe
            return
        if st.kv is not None and st.kv.cuda:  # one launch for K and V; slots and positions looked up in the kernel
            if idx is not None and idx.dtype != torch.int64:
                idx = idx.to(torch.int64)
            st.kv.fetch(idx if idx is None or idx.is_contiguous() else idx.contiguous(),
                        st.n_tokens if idx is None else idx.shape[-1], out[0], out[1], read=self._dev_read,
                        row0=st.slots.row0)
            return
        width = out[0].shape[2]
        t = st.n_tokens
        if idx is None and st.slots.row0 is not None:  # every token, through the slot table
            idx = torch.arange(t, device=self.device).view(1, 1, t).expand(self.batch_size, self.num_kv_heads, t)
        if idx is None:
            if st.gather is not None:
                for side, dst in enumerate(out):
                    tmp = torch.empty((t * self.rows_per_token, self.row_bytes), dtype=torch.uint8, device=self.device)
                    self._count(st.gather.read_range(side, t * self.rows_per_token, tmp), counter)
                    dst[:, :, :t].copy_(tmp.view(self.dtype).view(t, self.batch_size, self.num_kv_heads,
                                                                  self.head_dim).permute(1, 2, 0, 3))
                return
            slots = torch.arange(t * self.rows_per_token, device=self.device)
            # slot s = token * BH + bh goes to row bh * width + token of the [B, H, width] output
            out_rows = (self._bh(self.device).view(1, -1) * width
                        + torch.arange(t, device=self.device).view(-1, 1)).reshape(-1)
        else:
            slots = self._slots(st, idx)
            out_rows = self._out_rows(idx.shape[-1], width)
        if st.kv is not None:  # the CPU twin of the packed store
            for side, dst in enumerate(out):
                out_u8 = dst.view(-1, self.head_dim).view(torch.uint8).numpy()
                self._count(st.kv.read_rows(side, slots.numpy(), out_u8, None if out_rows is None else out_rows.numpy()),
                            counter)
            return
        for side, dst in enumerate(out):
            out_u8 = dst.view(-1, self.head_dim).view(torch.uint8)
            self._count(st.gather.read(side, slots, out_u8, out_rows), counter)

    def fetch(self, layer: int, token_idx: torch.Tensor,
              out: "tuple[torch.Tensor, torch.Tensor] | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V [B, H, k, D] of the tokens ``token_idx`` [B, H, k] selects per (batch, head).

        Duplicates and k == 0 are allowed; indices outside ``[0, seq_length(layer))`` raise
        :class:`InvalidIdsError` (checking them costs one host sync). One launch for K and V (zero-copy) on the
        current stream.
        """
        st = self._ready(self._state(layer))
        idx = self._check_idx(token_idx, st.n_tokens)
        k = idx.shape[-1]
        if out is None:
            out = self._alloc(k)
        else:
            self._check_out(out, k)
        if k and st.n_tokens:
            start = self._timed_start()
            self._read(st, idx, out)
            self._timed_end(start)
        return out

    def _check_out(self, out: object, k: int) -> None:
        want = (self.batch_size, self.num_kv_heads, k, self.head_dim)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise InvalidTypeError("out: expected a (keys, values) pair of tensors")
        for name, t in zip(("out[0]", "out[1]"), out):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != self.dtype \
                    or t.device != self.device or not t.is_contiguous():
                got = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidArgumentError(f"{name}: expected a contiguous {self.dtype} tensor of shape {want} on "
                                           f"{self.device}, got {got}")

    def fetch_all(self, layer: int, extra_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token's K and V, as [B, H, T + extra_tokens, D] (the last ``extra_tokens`` left unset).

        ``extra_tokens`` leaves room for the current step's tokens so attention gets one buffer, no concat.
        """
        st = self._ready(self._state(layer))
        if extra_tokens < 0:
            raise InvalidArgumentError(f"extra_tokens must be >= 0, got {extra_tokens}")
        out = self._alloc(st.n_tokens + extra_tokens)
        if st.n_tokens:
            start = self._timed_start()
            self._read(st, None, out)
            self._timed_end(start)
        return out

    # -- overlap ----------------------------------------------------------------------------------
    def prefetch(self, layer: int, token_idx: "torch.Tensor | None" = None, extra_tokens: int = 0) -> None:
        """Start fetching ``layer`` (the tokens ``token_idx`` selects, or all) off the critical path.

        GPU paths run on a side stream that first waits for the current stream (so it sees every append),
        and record an event; :meth:`take` makes the current stream wait for that event. No device-wide
        sync. Indices are trusted here (they come from the selector); validate with :meth:`fetch`.
        On the CPU path nothing runs ahead: :meth:`take` reads synchronously. Nor while the prefill worker is still
        storing the layer: this never waits for it (:meth:`take` does, then reads).
        """
        st = self._state(layer)
        if st.job is not None and not st.job.done():
            return
        self._ready(st)
        self._retire(st)
        if self.device.type != "cuda" or st.n_tokens == 0:
            return
        n = st.n_tokens if token_idx is None else token_idx.shape[-1]
        out = self._alloc(n + extra_tokens)  # allocated on the current stream, which waits before using it
        main = torch.cuda.current_stream(self.device)
        if self.transfer == "cpu_gather":
            st.pending = self._prefetch_cpu_gather(st, token_idx, extra_tokens, out, main)
            return
        staged = None
        if self._bulk(st, token_idx):  # copies wait for this layer's appends only (see _LayerState.appended)
            if st.appended is not None:
                self._copy.wait_event(st.appended)
            else:
                self._copy.wait_stream(main)
            with torch.cuda.stream(self._copy):
                start = self._timed_start()
                staged = st.kv.stage_chunks(self._copy)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            if staged is None:
                start = self._timed_start()
            self._read(st, token_idx, out, staged=staged)
            self._timed_end(start)
            ev = torch.cuda.Event()
            ev.record(self._side)
        self._set_pending(st, token_idx, out, extra_tokens, ev, (st.slots.row0,))

    @staticmethod
    def _set_pending(st: _LayerState, token_idx: "torch.Tensor | None", out: tuple[torch.Tensor, torch.Tensor],
                     extra_tokens: int, done: "torch.cuda.Event", refs: tuple) -> None:
        """A device fetch into ``out`` that ends at ``done`` becomes the layer's prefetch. It reads tensors that a
        later append on the current stream may replace (growth): keep them alive until take() has made the current
        stream wait for ``done``."""
        live = st.kv.live_tensors() if st.kv is not None else ()
        st.pending = _Pending(token_idx, st.n_tokens, extra_tokens, out[0], out[1], event=done,
                              refs=(token_idx, *refs, *live))

    def graph_fetch(self, layer: int, token_idx: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Enqueue the zero-copy read of ``token_idx`` [B, H, k] into ``out`` ([B, H, >= k, D]) on the current stream,
        with no bookkeeping: the fetch part of a captured speculation graph (see :meth:`can_graph_fetch`). Hand each
        run's result to :meth:`adopt_prefetch`."""
        self._read(self._state(layer), token_idx, out)

    def graph_append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> "tuple[int, int]":
        """Capturable: enqueue the append of one decode step's [B, H, 1, D] K/V (fixed buffers) to the layer's
        zero-copy store at the token count the device keeps, so a replay appends after whatever is stored then.
        Returns ``(slot0, t0)``, where the capture was made. Call :meth:`prepare_graph_append` before the capture,
        :meth:`before_graph_append` before and :meth:`after_graph_append` after every replay (no bookkeeping here)."""
        st = self._state(layer)
        if not self.can_graph_append(layer) or keys.shape[2] != 1:
            raise InvalidArgumentError(f"graph_append: layer {layer} needs a zero-copy CUDA store in the identity slot "
                                       "layout whose next slot is its next free one (no crop since), and one token")
        t0 = st.n_tokens
        slot0 = st.slots.slot_of_token(t0)
        st.kv.launch_dynamic(keys, values, slot0, t0, written=self._dev_written)
        return slot0, t0

    def prepare_graph_append(self, layer: int) -> None:
        """Outside the capture of :meth:`graph_append`: grow the store's slot tables and scratch for it now."""
        st = self._state(layer)
        st.kv.prepare_capture(st.slots.slot_of_token(st.n_tokens), self.rows_per_token)

    def can_graph_append(self, layer: int) -> bool:
        """Whether :meth:`graph_append` may be captured for ``layer`` now (see :meth:`graph_append_ok`)."""
        st = self._state(layer)
        return self.can_graph_fetch(layer) and self.graph_append_ok(layer, st.kv,
                                                                    st.slots.slot_of_token(st.n_tokens), st.n_tokens)

    def graph_append_ok(self, layer: int, store: "AppendStore", slot0: int, t0: int) -> bool:
        """Whether a decode-step append captured at ``(slot0, t0)`` of ``store`` may be replayed now: same store,
        identity slot layout, as many slots per token, and its next slot is the store's next free one (an eager
        append, crop, reorder or batch change in between makes this False: capture again or append eagerly)."""
        st = self._state(layer)
        if st.kv is not store or st.slots.row0 is not None or st.job is not None:
            return False
        segments = st.slots.segments
        if not segments or segments[-1][2] != self.rows_per_token or segments[-1][0] > t0:
            return False
        slot = slot0 + (st.n_tokens - t0) * self.rows_per_token
        return slot == st.slots.slot_of_token(st.n_tokens) == store.high_water

    def before_graph_append(self, layer: int) -> None:
        """Host bookkeeping before a replay of :meth:`graph_append` (room for its slots and chunks; never waits)."""
        st = self._ready(self._state(layer))
        self._retire(st)
        st.kv.prepare_dynamic(self.rows_per_token)

    def after_graph_append(self, layer: int) -> None:
        """Host bookkeeping after a replay of :meth:`graph_append` was enqueued: one more token."""
        st = self._state(layer)
        self._mark_appended(st)
        st.n_tokens += 1
        if layer == 0:
            self.decode_steps += 1

    def layer_store(self, layer: int) -> "AppendStore | None":
        """The layer's packed store (None before its prompt or on the CPU-gather path): a captured fetch reads its
        descriptor, so a graph is only valid while this is the same object. None too while the prefill worker is
        still storing the layer (never waits for it)."""
        st = self._state(layer)
        return st.kv if self._settled(st) else None

    def _settled(self, st: _LayerState) -> bool:
        """Whether the layer has no unfinished prefill-worker job (then :meth:`_ready` has run: no waiting)."""
        if st.job is not None and not st.job.done():
            return False
        self._ready(st)
        return True

    def can_graph_fetch(self, layer: int) -> bool:
        """Whether :meth:`graph_fetch` may be captured for ``layer`` now: a zero-copy CUDA store in the identity slot
        layout (a beam reorder or batch selection makes reads go through a slot table that may be replaced)."""
        st = self._state(layer)
        return (self.transfer == "zero_copy" and self._settled(st) and st.kv is not None and st.kv.cuda
                and st.slots.row0 is None and st.n_tokens > 0)

    def adopt_prefetch(self, layer: int, token_idx: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor],
                       extra_tokens: int, done: "torch.cuda.Event", refs: tuple = ()) -> None:
        """A fetch enqueued elsewhere (a replayed graph, ending at ``done``) becomes ``layer``'s prefetch: :meth:`take`
        with the same ``token_idx`` object returns ``out`` after the current stream waited for ``done``."""
        st = self._ready(self._state(layer))
        self._retire(st)
        self._set_pending(st, token_idx, out, extra_tokens, done, refs)

    def _prefetch_cpu_gather(self, st: _LayerState, idx: "torch.Tensor | None", extra: int,
                             out: tuple[torch.Tensor, torch.Tensor], main: torch.cuda.Stream) -> _Pending:
        """InfiniGen's path: the CPU waits for the indices, gathers, and issues one bulk copy per tensor."""
        slots_host = None
        refs: tuple = (idx,)
        if idx is not None:
            slots = self._slots(st, idx)
            slots_host = torch.empty(slots.shape, dtype=torch.int64, pin_memory=True)
            slots_host.copy_(slots, non_blocking=True)
            refs = (idx, slots, slots_host)
        ready = torch.cuda.Event()
        ready.record(main)
        n_tokens = st.n_tokens
        future = self._pool.submit(self._cpu_gather_job, st, ready, slots_host, out, n_tokens, extra)
        return _Pending(idx, n_tokens, extra, out[0], out[1], future=future, refs=refs)

    def _cpu_gather_job(self, st: _LayerState, ready: torch.cuda.Event, slots_host: "torch.Tensor | None",
                        out: tuple[torch.Tensor, torch.Tensor], n_tokens: int, extra: int) -> torch.cuda.Event:
        ready.synchronize()  # indices computed and every append of this layer landed in host memory
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            start = self._timed_start()
            if slots_host is None:
                self._read(st, None, out, counter="read_worker")
            else:
                k = out[0].shape[2] - extra
                for side, dst in enumerate(out):
                    if extra == 0:
                        moved = st.gather.read_cpu(side, slots_host, dst.view(-1, self.head_dim).view(torch.uint8))
                    else:
                        tmp = torch.empty((slots_host.numel(), self.row_bytes), dtype=torch.uint8, device=self.device)
                        moved = st.gather.read_cpu(side, slots_host, tmp)
                        dst[:, :, :k].copy_(tmp.view(self.dtype).view(self.batch_size, self.num_kv_heads, k,
                                                                      self.head_dim))
                    self._count(moved, "read_worker")  # K and V have their own staging buffers
            self._timed_end(start)
            ev = torch.cuda.Event()
            ev.record(self._side)
        return ev

    def take(self, layer: int, token_idx: "torch.Tensor | None" = None,
             extra_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of :meth:`prefetch` (same ``token_idx`` object, same length), or a synchronous fetch.

        Returns [B, H, k + extra_tokens, D] buffers whose last ``extra_tokens`` positions are left unset.
        """
        st = self._ready(self._state(layer))
        p, st.pending = st.pending, None
        if p is not None and p.matches(token_idx, st.n_tokens, extra_tokens):
            ev = p.done_event()
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
            return p.keys, p.values
        if p is not None:
            self._retire_pending(p)
        if token_idx is None:
            return self.fetch_all(layer, extra_tokens)
        out = self._alloc(token_idx.shape[-1] + extra_tokens)
        if token_idx.shape[-1] and st.n_tokens:
            start = self._timed_start()
            self._read(st, token_idx, out)
            self._timed_end(start)
        return out

    def _retire_pending(self, p: _Pending) -> None:
        """Drop a prefetch nobody will use, after the current stream has waited for it (its buffers get reused)."""
        ev = p.done_event()
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def _retire(self, st: _LayerState) -> None:
        if st.pending is not None:
            p, st.pending = st.pending, None
            self._retire_pending(p)

    # -- beam search, batch selection, crop ---------------------------------------------------------
    # These rewrite the layers' slot layouts (``kv_slots.SlotLayout``), never the stored rows.
    def _table(self, st: _LayerState) -> torch.Tensor:
        """The layer's slot table (see :meth:`SlotLayout.table`)."""
        return st.slots.table(st.n_tokens, self.batch_size, self.num_kv_heads, self.device)

    def _layers_for(self, layer: "int | None") -> "list[_LayerState]":
        states = self._layers if layer is None else [self._state(layer)]
        for st in states:
            self._ready(st)
            self._retire(st)  # a prefetch started before the change read the old order
        return states

    def _check_batch_index(self, index: object, name: str) -> torch.Tensor:
        if not isinstance(index, torch.Tensor) or index.dim() != 1:
            raise InvalidTypeError(f"{name}: expected a 1-D integer torch.Tensor, got {index!r:.80}")
        if index.dtype == torch.bool:
            if index.numel() != self.batch_size:
                raise InvalidArgumentError(f"{name}: a boolean mask needs {self.batch_size} entries, got "
                                           f"{index.numel()}")
            index = index.nonzero().view(-1)  # a mask's size is data-dependent: this one syncs
        elif index.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise InvalidTypeError(f"{name}: expected an integer tensor, got {index.dtype}")
        return index.to(device=self.device, dtype=torch.int64, non_blocking=True)

    def reorder(self, beam_idx: torch.Tensor, layer: "int | None" = None) -> None:
        """Beam search: batch row ``b`` continues old row ``beam_idx[b]`` (``beam_idx`` [B], values trusted).

        Rewrites the slot table of ``layer`` (None: every layer) with one gather on the device; the stored
        rows are not touched and nothing waits for the device."""
        beam_idx = self._check_batch_index(beam_idx, "beam_idx")
        if beam_idx.numel() != self.batch_size:
            raise InvalidArgumentError(f"beam_idx: expected {self.batch_size} entries (the batch size), got "
                                       f"{beam_idx.numel()}")
        for st in self._layers_for(layer):
            if st.n_tokens:
                st.slots.row0 = self._table(st).index_select(1, beam_idx)  # a new tensor: pending readers keep the old

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices`` (in that order; repeats allowed) of every layer: a new batch size."""
        indices = self._check_batch_index(indices, "indices")
        self._set_batch([self._table(st).index_select(1, indices) if st.n_tokens else None
                         for st in self._layers_for(None)], indices.numel())

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (``repeat_interleave`` on the batch dimension)."""
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise InvalidArgumentError(f"repeats: expected a positive int, got {repeats!r}")
        self._set_batch([self._table(st).repeat_interleave(repeats, dim=1) if st.n_tokens else None
                         for st in self._layers_for(None)], self.batch_size * repeats)

    def _set_batch(self, tables: "list[torch.Tensor | None]", batch_size: int) -> None:
        if batch_size < 1:
            raise InvalidArgumentError("a batch selection must keep at least one row")
        for st, table in zip(self._layers, tables):
            st.slots.row0 = table
        self.batch_size = batch_size
        self.rows_per_token = batch_size * self.num_kv_heads
        self._bh_cache.clear()

    def crop(self, n_tokens: int, layer: "int | None" = None) -> None:
        """Keep the first ``n_tokens`` tokens of ``layer`` (None: every layer); their slots are reused."""
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 0:
            raise InvalidArgumentError(f"n_tokens: expected an int >= 0, got {n_tokens!r}")
        for st in self._layers_for(layer):
            st.n_tokens = min(st.n_tokens, n_tokens)

    # -- CUDA graphs ------------------------------------------------------------------------------
    def capture_decode_step(self, layer: int, max_tokens: int) -> "KVStepGraph":
        """Capture ``layer``'s decode-step KV work in a CUDA graph: fetch every stored token, append one new token.

        Replays (:meth:`KVStepGraph.replay`) need no host work beyond a little bookkeeping, which is what bounds
        decoding of small models. The layer must hold its prompt already (the codecs are chosen there), use the
        identity slot layout (no beam reorder / batch selection since the prompt) and ``transfer='zero_copy'``.
        ``max_tokens``: the most tokens a replay may return (prompt + steps); the output buffers have that width.
        """
        return KVStepGraph(self, layer, max_tokens)

    # -- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Memory and traffic so far. Synchronises the device (reads GPU counters and timing events).

        ``host_bytes``: host memory held (packed store: its chunks, within ``host_slack_allowed_bytes`` of
        ``stored_bytes``: one chunk per layer and the chunks' margins); ``chunk_bytes``: the stores' chunk size;
        ``stored_bytes``/``raw_bytes``: KV bytes as stored / uncompressed; ``codecs``: per layer the (K, V) method
        the planner chose and the sample sizes it compared;
        ``gpu_bytes``: per-row metadata and tables on the GPU; ``pcie_read_bytes(_per_step)``: bytes the
        fetches moved host->GPU (zero-copy reads: the rows' stored bytes; bulk dense reads: the chunk bytes copied,
        i.e. the stored bytes plus chunk tails and padding); ``fit_s``: total prefill fit time;
        ``transfer_s_per_step``: GPU time of all timed transfers divided by the decode steps (``timing=True``;
        a transfer overlapped with compute still counts in full); ``prefill``: who stored the prompts;
        ``host_pool``: the process's pinned block pool (CUDA: bytes pinned, free, time spent pinning).
        """
        self._ready_all()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for st in self._layers:
            self._retire(st)
        read = self._read_host + self._read_worker
        written = self._written_host
        if self._dev_read is not None:
            read += int(self._dev_read)
            written += int(self._dev_written)
        stored = raw = host = gpu = slack = 0
        chunk_bytes = []
        for st in self._layers:
            n_slots = st.slots.slot_of_token(st.n_tokens)  # physical slots in use (rows beams dropped included)
            raw += 2 * st.n_tokens * self.rows_per_token * self.row_bytes
            store = st.kv if st.kv is not None else st.gather
            if st.kv is not None:
                st.kv.check()  # a kernel's status word (never expected to be set) becomes an exception here
                slack += st.kv.host_slack_bound
                chunk_bytes.append(st.kv.chunk_bytes)
            if store is not None:
                stored += store.stored_bytes(n_slots)
                host += store.host_nbytes
                gpu += store.device_nbytes
        transfer_s = sum(start.elapsed_time(end) for start, end in self._timings) / 1e3
        steps = max(self.decode_steps, 1)
        return {
            "transfer": self.transfer,
            "dense_fetch": self.dense_fetch,
            "compress": self.compress,
            "tokens": self._layers[0].n_tokens,
            "decode_steps": self.decode_steps,
            "host_bytes": host,
            "host_slack_allowed_bytes": slack if chunk_bytes else None,
            "chunk_bytes": max(chunk_bytes) if chunk_bytes else None,
            "gpu_bytes": gpu,
            "raw_bytes": raw,
            "stored_bytes": stored,
            "ratio": raw / stored if stored else 1.0,
            "pcie_read_bytes": read,
            "pcie_write_bytes": written,
            "pcie_read_bytes_per_step": read / steps,
            "fit_s": sum(st.fit_s for st in self._layers),
            "fit_s_per_layer": [st.fit_s for st in self._layers],
            "codecs": [tuple(c.as_dict() for c in st.choices) for st in self._layers],
            "transfer_s_total": transfer_s if self._timings else None,
            "transfer_s_per_step": transfer_s / steps if self._timings else None,
            "prefill": self.prefill,
            "sparse_reads": self.scattered_reads,
            "host_pool": host_pool().stats() if self.device.type == "cuda" else None,
        }

    def reset(self) -> None:
        """Forget every stored token (codecs are refitted at the next prompt)."""
        self._wait_workers()
        self._release_stores()  # waits for the device: side-stream prefetches may still read the chunks
        self._layers = [_LayerState() for _ in range(self.num_layers)]
        self._chunk_once.clear()
        self._pin_chunk = None
        self._reset_counters()

    def _wait_workers(self) -> None:
        """Let every prefill job and CPU gather finish (their errors no longer matter: the stores are dropped)."""
        for st in self._layers:
            for fut in (st.job, st.pending.future if st.pending is not None else None):
                if fut is not None:
                    try:
                        fut.result()
                    except Exception:  # noqa: BLE001 - reset/close discard what the job was storing
                        pass
            st.job = None

    def _release_stores(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for st in self._layers:
            for store in (st.kv, st.gather):
                if store is not None:
                    store.release()

    def close(self) -> None:
        """Stop the worker threads (the prefill worker, cpu_gather's gather thread) and give the host chunks back.
        The manager is unusable afterwards."""
        self._wait_workers()
        for name in ("_pool", "_worker"):
            pool = getattr(self, name)
            if pool is not None:
                pool.shutdown(wait=True)
                setattr(self, name, None)
        self._release_stores()


class KVStepGraph:
    """One layer's decode-step KV work (fetch of every stored token + append of the new one) as a CUDA graph.

    Write the new token's K/V into :attr:`keys_in` / :attr:`values_in` ([B, H, 1, D]) and call :meth:`replay`: it
    returns the attention input [B, H, T + 1, D] (views of :attr:`keys_out` / :attr:`values_out`), every earlier token
    decoded from host memory and the new one at position T, and the new token is stored. The graph reads the token
    count and the store's pointers from device memory, so it stays valid while the store grows; the host only moves
    its cursor bound and adds chunks before each replay (no sync). Any other change to the layer (an eager append,
    crop, reorder, reset) makes the next replay raise: capture again.
    """

    def __init__(self, mgr: KVOffloadManager, layer: int, max_tokens: int) -> None:
        from ..kernels._build import get_function

        st = mgr._ready(mgr._state(layer))
        mgr._retire(st)
        if mgr.transfer != "zero_copy" or st.kv is None or not st.kv.cuda:
            raise InvalidArgumentError("capture_decode_step: needs transfer='zero_copy' on CUDA and a layer that holds "
                                       "its prompt")
        segments = st.slots.segments
        if st.slots.row0 is not None or not segments or segments[-1][2] != mgr.rows_per_token:
            raise InvalidArgumentError("capture_decode_step: the layer's slots were reordered or selected (beam "
                                       "search); only the identity layout can be captured")
        t0 = st.n_tokens
        if not isinstance(max_tokens, int) or max_tokens < t0 + 1:
            raise InvalidArgumentError(f"max_tokens: expected an int >= {t0 + 1} (stored tokens + 1), got "
                                       f"{max_tokens!r}")
        self.mgr, self.layer, self.max_tokens = mgr, layer, max_tokens
        shape = (mgr.batch_size, mgr.num_kv_heads, 1, mgr.head_dim)
        dev = mgr.device
        self.keys_in = torch.zeros(shape, dtype=mgr.dtype, device=dev)
        self.values_in = torch.zeros(shape, dtype=mgr.dtype, device=dev)
        self.keys_out = torch.zeros((*shape[:2], max_tokens, shape[3]), dtype=mgr.dtype, device=dev)
        self.values_out = torch.zeros_like(self.keys_out)
        store = st.kv
        slot0 = st.slots.slot_of_token(t0)
        store.prepare_capture(slot0, mgr.rows_per_token)
        for symbol in ("ibp_kvp_size", "ibp_kvp_encode", "ibp_kvp_fetch"):  # no module loads while capturing
            get_function("kv_packed.cu", symbol, dev.index)
        torch.cuda.synchronize(dev)
        self.graph = torch.cuda.CUDAGraph()
        with generator_kept(dev), torch.cuda.graph(self.graph):
            store.fetch(None, max_tokens, self.keys_out, self.values_out, read=mgr._dev_read, k_dyn=True)
            store.launch_dynamic(self.keys_in, self.values_in, slot0, t0, into=(self.keys_out, self.values_out),
                                 att_pos0=t0, written=mgr._dev_written)
        self._store = store
        self._tokens = t0  # what the layer must hold before the next replay

    def replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the captured step; returns (keys, values) [B, H, T + 1, D] views of the output buffers."""
        mgr = self.mgr
        st = mgr._state(self.layer)
        if st.kv is not self._store or st.n_tokens != self._tokens or st.slots.row0 is not None:
            raise StateError(f"layer {self.layer} changed since capture_decode_step (an eager append, crop, reorder "
                             "or reset): capture again")
        n = st.n_tokens
        if n + 1 > self.max_tokens:
            raise CapacityError(f"the captured step of layer {self.layer} holds at most {self.max_tokens} tokens")
        mgr.before_graph_append(self.layer)
        self.graph.replay()
        mgr.after_graph_append(self.layer)
        self._tokens = n + 1
        return self.keys_out[:, :, : n + 1], self.values_out[:, :, : n + 1]
