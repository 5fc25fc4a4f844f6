"""Sample ahead, fetch ahead, train now: the prefetching iterator a DGL or PyG loader is wrapped in.

A GNN epoch has three stages per batch: sampling (CPU workers or a GPU sampler), the feature fetch (the cache) and
the training step. Run one after the other, the epoch is their sum; :class:`PipelinedLoader` runs them at the same
time -- the sampling of batch i+2, the fetch of batch i+1 and the training step of batch i -- so the epoch
approaches the slowest stage alone:

* a **sampler thread** iterates the wrapped loader (which may itself sample in worker processes) on its own CUDA
  stream and records an event per batch;
* a **fetch thread** (or, with ``fetch_thread=False``, the caller's thread, one batch ahead) makes its CUDA stream
  wait for that event, runs ``fetch(batch)`` there and records a second event;
* the **caller** gets batches in the loader's order; before a batch is handed over its current stream waits for
  the fetch event (a device-side wait: the host never blocks on the GPU here) and every CUDA tensor of the batch is
  ``record_stream``-ed on it, so the caching allocator cannot hand a side stream's memory to a new tensor while the
  training step still reads it.

Nothing in the pipeline synchronizes the host with the device, so a timer that syncs between stages would measure
a serialized loop instead: time stages in a separate pass, or with CUDA events on each stage's stream.

Exactness: one sampler thread and FIFO queues keep the loader's order, and the fetch is the same call on the same
batch, so batches, features and losses equal an unpipelined loop's (given a loader whose batches do not depend on
timing: DGL's and PyG's loaders with seeded workers, :class:`~ibpcache.loaders.sampling.NeighborSampler`). Without
CUDA the stages still overlap in threads (torch's CPU ops and the cache's Numba passes release the GIL).

Why ``switch_interval`` exists: the three stages share one interpreter lock. Every torch call releases it, and a
thread that wants it back waits until the holder releases it or Python's switch interval (5 ms by default) runs
out. A training thread that issues a few short calls per batch can lose up to that long per call to a sampler
thread running Python between its own calls, so a host-bound pipelined epoch can be slower than the stages in
turn. A shorter interval (e.g. 0.2 ms) bounds that wait but adds switches; it is process-wide, so it is opt-in and
restored when the iteration ends. Measure before setting it: on the GraphSAGE example (one H100; two H200 ranks)
0.2 ms gave no faster epoch (docs/results/2026-11-28-h200x2-h100-s42).

Why ``freeze_gc`` exists: Python's cyclic collector, when enough objects have outlived its younger generations,
walks every tracked object of the process while holding the interpreter lock, so every stage stops. With torch, DGL
and a training script loaded that is about 270k objects, 117 ms a walk on a 2-core host, and it came about every two
epochs in a CPU run of the GraphSAGE example, where a pipelined epoch on an H100 takes 60-100 ms. ``freeze_gc``
moves the objects alive when an iteration starts to the collector's permanent generation (``gc.freeze``) until it
ends, so a collection inside the loop walks only the loop's own objects. It is process-wide, so it is opt-in, and
left to the process when something else has frozen objects already. Measure before setting it (:class:`GcPauses`
counts the collections of a block): on the GraphSAGE example on H200s no timed epoch had a full collection, and
freezing gave no faster epoch, one GPU or two (docs/results/2026-11-28-h200-h200x2-s44).

Why :class:`StageClock` exists: a pipelined epoch longer than both its stages' host time and their GPU time summed
has lost overlap somewhere, and only the stage threads know where: a stage starved (waiting for its input) while the
one before it was busy names the stage that holds the epoch back; a stage blocked (waiting to hand a batch on) names
the one after it. The clock adds two ``perf_counter`` calls per batch and stage and never touches the device.

Why ``fetch_sms`` exists: where the fetch and the training step both run on the GPU, their kernels do not run at the
same time (a training kernel's blocks fill the SMs), so the epoch is bounded by their GPU time summed.
``fetch_sms=k`` runs the sampler's and the fetch's kernels on a CUDA green context of ``k`` SMs and offers
:attr:`PipelinedLoader.step_stream` on the others (:mod:`ibpcache.loaders.sm_split`, which says what it gained and
cost GraphSAGE epochs); the caller trains under ``torch.cuda.stream(loader.step_stream)``. Opt-in: the step gets
fewer SMs, which lengthens epochs whose step holds the GPU.

Why ``fetch_thread=False`` exists: a fetch that is a collective (e.g. ``DistributedRows.fetch``) must be issued in
the same order as the training step's own collectives on every rank (NCCL requires operations on different
communicators to be submitted in one order across ranks); the caller's thread issues fetch i+1 before it returns
batch i, so fetch and step still overlap on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from ..errors import InvalidArgumentError
from .sm_split import SmSplit, split_sms

__all__ = ["GcPauses", "PipelinedLoader", "StageClock", "StepsInFlight", "frozen_gc", "record_stream"]

S = TypeVar("S")
B = TypeVar("B")

_POLL_S = 0.05  # how often a blocked stage looks at the stop flag


def record_stream(obj: Any, stream: Any, leaf: "Callable[[Any, Any], bool] | None" = None) -> None:
    """``record_stream(stream)`` on every CUDA tensor reachable from ``obj``: tensors, mappings, lists, tuples,
    dataclasses, and objects with their own ``record_stream`` (never CPU tensors: torch refuses those).

    ``leaf(obj, stream)`` handles framework objects first (returns True when it did): an adapter's hook for types
    whose own ``record_stream`` would refuse CPU parts (a DGL graph on the CPU holding CUDA features, a PyG
    ``Data`` with CPU attributes).
    """
    if leaf is not None and leaf(obj, stream):
        return
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            record_stream(value, stream, leaf)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            record_stream(value, stream, leaf)
    elif callable(getattr(obj, "record_stream", None)) and not isinstance(obj, type):
        obj.record_stream(stream)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            record_stream(getattr(obj, f.name), stream, leaf)


class _End:
    """End of a stage's output (the loader is exhausted)."""


@dataclasses.dataclass
class _Failure:
    """An exception raised in a stage, re-raised in the caller at the batch where it happened."""

    exc: BaseException


@dataclasses.dataclass
class _Item:
    value: Any
    event: Any  # torch.cuda.Event or None


def _put(q: "queue.Queue[Any]", item: Any, stop: threading.Event) -> bool:
    """Put unless the consumer has stopped; False when it has."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _get(q: "queue.Queue[Any]", stop: threading.Event) -> Any:
    """Get, or ``_End`` once the consumer has stopped."""
    while not stop.is_set():
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            continue
    return _End


@contextlib.contextmanager
def frozen_gc(enabled: bool = True) -> Iterator[None]:
    """Inside, the objects alive on entry sit in the cyclic collector's permanent generation (``gc.freeze``), so a
    collection walks only objects made since; unfrozen on exit. Does nothing when ``enabled`` is false or the
    process has frozen objects of its own (it keeps its policy). Why: module docstring (``freeze_gc``)."""
    frozen = enabled and gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    try:
        yield
    finally:
        if frozen:
            gc.unfreeze()


_OLDEST_GENERATION = len(gc.get_count()) - 1


class GcPauses:
    """Counts the cyclic collector's collections, and the seconds they held the interpreter, while entered.

    ``full``: collections of the oldest generation (they walk every tracked, unfrozen object); ``young``: the rest;
    ``seconds``: their wall time summed. Why: a collection stops every thread of a pipelined loop, so an epoch that
    ran long with a full collection inside it was paused by the collector, not by a stage. Installed as a
    ``gc.callbacks`` entry; the start time is kept per thread, as any thread may trigger a collection.
    """

    def __init__(self) -> None:
        self.full = 0
        self.young = 0
        self.seconds = 0.0
        self._started = threading.local()

    def _callback(self, phase: str, info: Mapping[str, Any]) -> None:
        if phase == "start":
            self._started.t = time.perf_counter()
            return
        t0 = getattr(self._started, "t", None)
        if t0 is None:  # entered while a collection ran: its start was not seen
            return
        self._started.t = None
        self.seconds += time.perf_counter() - t0
        if info.get("generation") == _OLDEST_GENERATION:
            self.full += 1
        else:
            self.young += 1

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


@contextlib.contextmanager
def _switch_interval(seconds: "float | None") -> Iterator[None]:
    """Python's thread switch interval set to ``seconds`` inside, restored on exit; ``None`` leaves it alone. Why:
    module docstring (``switch_interval``)."""
    if seconds is None:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


@dataclasses.dataclass
class StageClock:
    """Seconds the stage threads of a :class:`PipelinedLoader` spent, summed over its iterations; each field is
    written by one thread only (a stretch counts when it ends), so take :meth:`snapshot` differences to read a span.

    ``sample_busy``: in the wrapped loader's ``next()`` (sampling, or waiting for its worker processes);
    ``sample_blocked``: waiting for room to hand a sampled batch on (the fetch stage is behind);
    ``fetch_starved``: waiting for a sampled batch (the sampler is behind); ``fetch_busy``: in ``fetch`` (with the
    stream bookkeeping around it); ``fetch_blocked``: waiting for room to hand a fetched batch on (the caller is
    behind; zero with ``fetch_thread=False``, where the caller fetches itself).
    """

    sample_busy: float = 0.0
    sample_blocked: float = 0.0
    fetch_starved: float = 0.0
    fetch_busy: float = 0.0
    fetch_blocked: float = 0.0

    def snapshot(self) -> "StageClock":
        return dataclasses.replace(self)

    def since(self, earlier: "StageClock") -> "StageClock":
        """The seconds spent between ``earlier`` (a snapshot) and now."""
        return StageClock(**{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                             for f in dataclasses.fields(self)})


class PipelinedLoader(Generic[S, B]):
    """Iterate ``batches`` with sampling, fetching and the caller's training step overlapped (module docstring).

    Args:
        batches: what yields sampled batches: a DGL/PyG loader, a :class:`~ibpcache.loaders.sampling`-based
            iterable, any re-iterable (``iter()`` once per epoch, in the caller's thread; ``next()`` in the sampler
            thread).
        fetch: ``fetch(sampled) -> batch``: the feature fetch (and anything else that should run ahead of the
            step); ``None`` hands sampled batches over as they are.
        device: the training device; streams and events are used when it is a CUDA device.
        prefetch: fetched batches waiting for the caller (>= 1).
        sample_ahead: sampled batches waiting for the fetch (>= 1).
        fetch_thread: fetch in a thread (default) or in the caller's thread, one batch ahead (collective fetches).
        record: ``record(obj, stream)`` marks a batch's CUDA tensors as used on ``stream``; the default walks
            tensors, containers, dataclasses and ``record_stream`` methods (:func:`record_stream`).
        switch_interval: seconds; while an iteration runs, Python's thread switch interval
            (``sys.setswitchinterval``) is set to this, and restored afterwards. ``None`` leaves it alone.
        freeze_gc: while an iteration runs, the objects alive when it started are frozen (``gc.freeze``; unfrozen
            when it ends), unless the process has frozen objects of its own.
        fetch_sms: CUDA only: the sampler's and the fetch's streams on a green context of this many of the GPU's SMs
            (:func:`~ibpcache.loaders.sm_split.split_sms`), the caller's step on :attr:`step_stream`, the others.
            ``None``: every stream on the whole GPU.

    Attributes:
        clock: the stage threads' busy and waiting time over every iteration (:class:`StageClock`).
        sm_split: with ``fetch_sms``, the split (:class:`~ibpcache.loaders.sm_split.SmSplit`), else ``None``.
        step_stream: with ``fetch_sms``, the stream to train on (the SMs the fetch does not use), else ``None``.
    """

    def __init__(self, batches: Iterable[S], fetch: "Callable[[S], B] | None" = None, *,
                 device: "str | torch.device | None" = None, prefetch: int = 2, sample_ahead: int = 2,
                 fetch_thread: bool = True, record: "Callable[[Any, Any], None] | None" = None,
                 switch_interval: "float | None" = None, freeze_gc: bool = False,
                 fetch_sms: "int | None" = None) -> None:
        if not hasattr(batches, "__iter__"):
            raise InvalidArgumentError(f"PipelinedLoader: batches must be iterable, got {type(batches).__name__}")
        for name, value in (("prefetch", prefetch), ("sample_ahead", sample_ahead)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"PipelinedLoader: {name} must be an int >= 1, got {value!r}")
        if switch_interval is not None and (isinstance(switch_interval, bool)
                                            or not isinstance(switch_interval, (int, float))
                                            or not 0 < switch_interval <= 1):
            raise InvalidArgumentError(
                f"PipelinedLoader: switch_interval must be seconds in (0, 1] or None, got {switch_interval!r}")
        self.switch_interval = None if switch_interval is None else float(switch_interval)
        if not isinstance(freeze_gc, bool):
            raise InvalidArgumentError(f"PipelinedLoader: freeze_gc must be a bool, got {freeze_gc!r}")
        self.freeze_gc = freeze_gc
        self.batches = batches
        self.fetch = fetch if fetch is not None else _identity
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch = prefetch
        self.sample_ahead = sample_ahead
        self.fetch_thread = bool(fetch_thread)
        self.record = record if record is not None else record_stream
        self._cuda = self.device.type == "cuda"
        self._streams: "tuple[Any, Any] | None" = None
        self.clock = StageClock()
        self.sm_split: "SmSplit | None" = None
        if fetch_sms is not None:
            if not self._cuda:
                raise InvalidArgumentError(f"PipelinedLoader: fetch_sms splits a GPU's SMs; device is {self.device}")
            self.sm_split = split_sms(self.device, fetch_sms)
            self._streams = (self.sm_split.sample_stream, self.sm_split.fetch_stream)

    @property
    def step_stream(self) -> Any:
        return self.sm_split.step_stream if self.sm_split is not None else None

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def _stage_streams(self) -> "tuple[Any, Any]":
        """(sampler stream, fetch stream): created once, reused every epoch, at high priority: their kernels are short
        and the step waits for them, so the GPU should run them as soon as a training kernel leaves room."""
        if not self._cuda:
            return None, None
        if self._streams is None:
            # a lower number is a higher priority; torch maps one outside the device's range to the nearest valid
            self._streams = (torch.cuda.Stream(self.device, priority=-1), torch.cuda.Stream(self.device, priority=-1))
        return self._streams

    def __iter__(self) -> Iterator[B]:
        sample_stream, fetch_stream = self._stage_streams()
        stop = threading.Event()
        sampled: "queue.Queue[Any]" = queue.Queue(maxsize=self.sample_ahead)
        # iter() in the caller's thread, only next() in the sampler thread: a loader's set-up (the epoch's shuffle,
        # forking its worker processes) happens where an unpipelined loop has it. DGL's workers draw from random
        # state inherited from the thread that forks them, so forking from another thread changes the batches.
        batches = iter(self.batches)
        threads = [threading.Thread(target=self._sample_loop, args=(batches, sampled, stop, sample_stream),
                                    name="ibpcache-sample", daemon=True)]
        if self.fetch_thread:
            fetched: "queue.Queue[Any]" = queue.Queue(maxsize=self.prefetch)
            threads.append(threading.Thread(target=self._fetch_loop, args=(sampled, fetched, stop, fetch_stream),
                                            name="ibpcache-fetch", daemon=True))
            source = self._from_thread(fetched, stop)
        else:
            source = self._fetch_here(sampled, stop, fetch_stream)
        interpreter = contextlib.ExitStack()  # the process-wide settings of an iteration, restored when it ends
        interpreter.enter_context(_switch_interval(self.switch_interval))
        interpreter.enter_context(frozen_gc(self.freeze_gc))
        for t in threads:
            t.start()
        try:
            yield from source
        finally:
            stop.set()
            queues = [sampled] + ([fetched] if self.fetch_thread else [])
            for t in threads:
                while t.is_alive():  # a stage blocked on put() sees the stop flag within _POLL_S
                    for q in queues:
                        with contextlib.suppress(queue.Empty):
                            q.get_nowait()
                    t.join(timeout=_POLL_S)
            interpreter.close()

    # -- stages ---------------------------------------------------------------------------------------------------

    def _sample_loop(self, batches: Iterator[Any], out: "queue.Queue[Any]", stop: threading.Event,
                     stream: Any) -> None:
        clock = self.clock
        try:
            self._use_device()
            with _on_stream(stream):
                while True:
                    t0 = time.perf_counter()
                    item = next(batches, _End)
                    if item is _End:
                        break
                    ready = _Item(item, _record_event(stream))
                    t1 = time.perf_counter()
                    clock.sample_busy += t1 - t0
                    handed = _put(out, ready, stop)
                    clock.sample_blocked += time.perf_counter() - t1
                    if not handed:
                        return
            _put(out, _End, stop)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            _put(out, _Failure(exc), stop)

    def _use_device(self) -> None:
        """A new thread starts on CUDA device 0; a stage of a loader for another GPU (a DDP rank) must not."""
        if self._cuda:
            torch.cuda.set_device(self.device)

    def _fetch_one(self, item: _Item, stream: Any) -> _Item:
        with _on_stream(stream):
            if item.event is not None:
                stream.wait_event(item.event)
                self.record(item.value, stream)  # made on the sampler's stream, read on this one
            value = self.fetch(item.value)
            return _Item(value, _record_event(stream))

    def _fetch_loop(self, inp: "queue.Queue[Any]", out: "queue.Queue[Any]", stop: threading.Event,
                    stream: Any) -> None:
        clock = self.clock
        try:
            self._use_device()
            while True:
                t0 = time.perf_counter()
                item = _get(inp, stop)
                t1 = time.perf_counter()
                clock.fetch_starved += t1 - t0
                if item is _End or isinstance(item, _Failure):
                    _put(out, item, stop)
                    return
                ready = self._fetch_one(item, stream)
                t2 = time.perf_counter()
                clock.fetch_busy += t2 - t1
                handed = _put(out, ready, stop)
                clock.fetch_blocked += time.perf_counter() - t2
                if not handed:
                    return
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            _put(out, _Failure(exc), stop)

    def _hand_over(self, item: _Item) -> Any:
        """Make the caller's stream wait for the batch and own its tensors."""
        if item.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(item.event)
            self.record(item.value, current)
        return item.value

    def _from_thread(self, fetched: "queue.Queue[Any]", stop: threading.Event) -> Iterator[Any]:
        while True:
            item = _get(fetched, stop)
            if item is _End:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield self._hand_over(item)

    def _fetch_here(self, sampled: "queue.Queue[Any]", stop: threading.Event, stream: Any) -> Iterator[Any]:
        """The caller's thread fetches batch i+1 before it returns batch i (collective fetches). A failure is
        raised after the batches before it were handed over, as in the threaded path."""
        pending: "_Item | None" = None
        clock = self.clock
        while True:
            t0 = time.perf_counter()
            item = _get(sampled, stop)
            t1 = time.perf_counter()
            clock.fetch_starved += t1 - t0
            if item is _End:
                break
            failure: "BaseException | None" = item.exc if isinstance(item, _Failure) else None
            if failure is None:
                try:
                    ready = self._fetch_one(item, stream)
                except BaseException as exc:  # noqa: BLE001 - raised below, after the batch before it
                    failure = exc
                clock.fetch_busy += time.perf_counter() - t1
            if pending is not None:
                yield self._hand_over(pending)
                pending = None
            if failure is not None:
                raise failure
            pending = ready
        if pending is not None:
            yield self._hand_over(pending)


class StepsInFlight:
    """Bound how far the training thread runs ahead of the GPU: ``step_done()`` after each step records an event and
    waits for the one ``limit`` steps back.

    Why: a pipelined loop never reads the GPU back, so with batches ready the host would enqueue step after step,
    each holding its batch's device memory until the GPU reaches it (``record_stream``), and the caching allocator
    could only reuse those blocks later, or sync to reclaim them. Waiting for step i - limit costs nothing while the
    GPU is the bottleneck (step i - 1 is still queued) and caps the batches alive at ``limit`` + the prefetch.
    A no-op on the CPU.
    """

    def __init__(self, device: "str | torch.device", limit: int = 2) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise InvalidArgumentError(f"StepsInFlight: limit must be an int >= 1, got {limit!r}")
        self.device = torch.device(device)
        self.limit = limit
        self._events: "list[Any]" = []

    def step_done(self) -> None:
        if self.device.type != "cuda":
            return
        self._events.append(torch.cuda.current_stream(self.device).record_event())
        if len(self._events) > self.limit:
            self._events.pop(0).synchronize()


def _identity(x: Any) -> Any:
    return x


def _on_stream(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record_event(stream: Any) -> Any:
    return stream.record_event() if stream is not None else None
