"""What each stage of a pipeline costs the resources the stages share: the GPU's SMs, its copy engines, the host.

Why: a pipeline whose stages run on one GPU (a GPU sampler, a feature fetch and the training step) cannot beat the
sum of their GPU time, however well they overlap; "the slowest stage alone" is a lower bound only for stages on
separate resources. Stage wall times cannot tell GPU time from host time, and CUDA events on a stage's stream
cannot either (a host-bound stage leaves its stream idle between launches, and the events time the gaps). The
profiler's device activity can: :class:`StageProfile` runs stages one at a time, each in a named window that ends
with a device sync, and attributes every kernel, copy and blocking CUDA call to the window it started in.

Per stage (:class:`StageBusy`): ``kernel_ms``, the union of its kernel (and memset) intervals, i.e. the time some
SM ran its work; ``copy_ms``, the union of its memcpy intervals (copy engines, which run beside kernels); ``wait_ms``,
host time inside blocking CUDA calls (stream/device/event syncs, blocking copies); ``wall_ms``, the windows'
length under the profiler (slower than unprofiled: use an unprofiled wall for host time, see
:meth:`StageBusy.host_ms`). Importing this module imports neither the profiler nor CUDA.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..errors import StateError

__all__ = ["StageBusy", "StageProfile", "Span", "all_threads_profile", "profile_spans", "stage_busy", "thread_summary",
           "union_length"]

#: the prefix of a stage window's name in the profile (a ``record_function`` range)
WINDOW_PREFIX = "ibpcache.stage:"


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals (same unit in and out): busy time of work that may
    overlap (kernels of two streams, copies in both directions)."""
    total, reach = 0.0, None
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if reach is None or a >= reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


@dataclasses.dataclass
class StageBusy:
    """One stage's share of the shared resources over its windows, milliseconds (module docstring)."""

    wall_ms: float = 0.0
    kernel_ms: float = 0.0
    copy_ms: float = 0.0
    wait_ms: float = 0.0
    windows: int = 0

    def host_ms(self, unprofiled_wall_ms: float) -> float:
        """Host time outside waits for the GPU, from a wall time measured without the profiler (the profiler
        slows the host, not the GPU, so its waits hold; its wall does not)."""
        return max(0.0, unprofiled_wall_ms - self.wait_ms)


def _is_wait(name: str) -> bool:
    """A host-side CUDA call that blocks until the device has done something: syncs and blocking copies (a copy to
    pageable memory, as ``.item()`` and ``.tolist()`` do, returns only when the data is there)."""
    return "Synchronize" in name or name.startswith("cudaMemcpy")


#: one profiler event: (name, on the device?, start us, end us, kineto activity type or "")
Span = tuple[str, bool, float, float, str]


def _device_kind(name: str, activity: str) -> "str | None":
    """``"copy"``, ``"kernel"`` or None (not work: the GPU-side span of a ``record_function`` range, sync markers)."""
    if activity == "gpu_memcpy" or name.startswith("Memcpy"):
        return "copy"
    if activity == "gpu_user_annotation" or name.startswith(WINDOW_PREFIX):
        return None
    return "kernel" if activity in ("kernel", "gpu_memset", "") else None


def stage_busy(spans: Iterable[Span]) -> dict[str, StageBusy]:
    """Per stage window, from profiler spans (:data:`Span`; :func:`profile_spans` reads them from a profile): each
    device activity and each blocking CUDA call goes to the window its start falls in. Windows are the
    ``record_function`` ranges named ``WINDOW_PREFIX + stage`` (host side); a stage may have many."""
    windows: list[tuple[float, float, str]] = []
    device: list[tuple[float, float, str]] = []  # start, end, kind
    waits: list[tuple[float, float]] = []
    for name, on_device, start, end, activity in spans:
        if on_device:
            kind = _device_kind(name, activity)
            if kind is not None:
                device.append((start, end, kind))
        elif name.startswith(WINDOW_PREFIX):
            windows.append((start, end, name[len(WINDOW_PREFIX):]))
        elif _is_wait(name):
            waits.append((start, end))
    windows.sort()
    starts = [w[0] for w in windows]
    out: dict[str, StageBusy] = {}
    work: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for a, b, stage in windows:
        busy = out.setdefault(stage, StageBusy())
        busy.wall_ms += (b - a) / 1e3
        busy.windows += 1

    def owner(t: float) -> "str | None":
        i = bisect.bisect_right(starts, t) - 1
        return windows[i][2] if i >= 0 and t < windows[i][1] else None

    for a, b, kind in device:
        stage = owner(a)
        if stage is not None:
            work.setdefault((stage, kind), []).append((a, b))
    for a, b in waits:
        stage = owner(a)
        if stage is not None:
            out[stage].wait_ms += (b - a) / 1e3
    for stage, busy in out.items():
        busy.kernel_ms = union_length(work.get((stage, "kernel"), [])) / 1e3
        busy.copy_ms = union_length(work.get((stage, "copy"), [])) / 1e3
    return out


def profile_spans(prof: Any) -> list[Span]:
    """The spans of a finished ``torch.profiler.profile``: from kineto's raw events when the profile exposes them
    (``prof.profiler.kineto_results``: no per-event Python objects, no call tree, seconds faster on a GPU step's
    thousands of events), else from ``prof.events()``."""
    cuda = torch.autograd.DeviceType.CUDA
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    try:  # the raw events' accessors vary across torch versions; prof.events() is the public, slower way
        return [(e.name(), e.device_type() == cuda, e.start_ns() / 1e3, e.end_ns() / 1e3,
                 str(e.activity_type() if hasattr(e, "activity_type") else "")) for e in raw.events()]
    except AttributeError:
        pass
    return [(e.name, e.device_type == cuda, float(e.time_range.start), float(e.time_range.end),
             str(getattr(e, "activity_type", None) or "")) for e in prof.events()]


class StageProfile:
    """Profile stages run one at a time: ``with StageProfile(device) as p:``, then ``with p.stage("fetch"): ...``
    around each stage's work (the window syncs the device before it closes, so the stage's GPU work lies inside
    it); :meth:`result` gives :class:`StageBusy` per stage. Without CUDA only host windows are recorded.

    For a measurement pass of its own, never a timed run: the profiler slows the host. ``all_threads``: record the
    ops of every thread (:func:`all_threads_profile`), not only the caller's. After the block, ``finished`` is the
    profile and ``spans`` its spans (:func:`profile_spans`), for other summaries of the same run.
    """

    def __init__(self, device: "str | torch.device", all_threads: bool = False) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._all_threads = all_threads
        self._prof: Any = None
        self._result: "dict[str, StageBusy] | None" = None
        self.finished: Any = None
        self.spans: list[Span] = []

    def __enter__(self) -> "StageProfile":
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        self._sync()
        self._prof = all_threads_profile(self._cuda) if self._all_threads else profile(activities=activities)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sync()
        prof, self._prof = self._prof, None
        prof.__exit__(*exc)
        if exc[0] is None:
            self.finished, self.spans = prof, profile_spans(prof)
            self._result = stage_busy(self.spans)

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """A window of stage ``name``; the device is synced inside it, at its end."""
        if self._prof is None:
            raise StateError("StageProfile.stage: enter the profile first (with StageProfile(device) as p: ...)")
        with torch.profiler.record_function(WINDOW_PREFIX + name):
            yield
            self._sync()

    def result(self) -> dict[str, StageBusy]:
        if self._result is None:
            raise StateError("StageProfile.result: no finished profile (leave the with block first)")
        return self._result


def all_threads_profile(cuda: bool) -> Any:
    """A ``torch.profiler.profile`` (not yet entered) that records the ops of every thread of the process, not only
    the thread that starts it: a pipeline's sampler and fetch threads compete with the training thread for the
    host (and the GIL), and a profile of the trainer alone cannot show it. Where this torch lacks the option, the
    other threads' CUDA runtime calls are still recorded (``cuda``: the device activity is, through CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return profile(activities=activities)
    return profile(activities=activities, experimental_config=config)


def _is_launch(name: str) -> bool:
    return "LaunchKernel" in name or name.startswith("cuLaunch")


def thread_summary(events: Iterable[Any], top: int = 15) -> dict[str, Any]:
    """Where a profiled window's host time went, per thread, from a finished profile's ``events()``.

    ``threads``: per thread id, ``host_ms`` (its top-level ops' total time: nested ops are not counted twice),
    ``ops`` (top-level ops), ``launches`` (kernel launches), ``wait_ms`` (time in blocking CUDA calls: syncs and
    blocking copies) and its ``top_ops`` by self time; ``top_ops``: every thread's ops by self host time, with counts.
    Times in milliseconds; thread ids are the profiler's (tell the threads apart by their ops)."""
    threads: dict[int, dict[str, Any]] = {}
    own: dict[int, dict[str, list[float]]] = {}
    every: dict[str, list[float]] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        t = threads.setdefault(int(e.thread), {"host_ms": 0.0, "ops": 0, "launches": 0, "wait_ms": 0.0})
        if e.cpu_parent is None:
            t["host_ms"] += e.cpu_time_total / 1e3
            t["ops"] += 1
        if _is_launch(e.name):
            t["launches"] += 1
        if _is_wait(e.name):
            t["wait_ms"] += e.cpu_time_total / 1e3
        for table in (own.setdefault(int(e.thread), {}), every):
            c = table.setdefault(e.name, [0.0, 0.0])
            c[0] += 1
            c[1] += e.self_cpu_time_total / 1e3

    def ranked(table: dict[str, list[float]]) -> list[dict[str, Any]]:
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return [{"name": n, "count": int(c), "self_ms": round(ms, 3)} for n, (c, ms) in rows]

    for tid, t in threads.items():
        t["top_ops"] = ranked(own[tid])[:5]
    return {"threads": {str(k): v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]["host_ms"])},
            "top_ops": ranked(every)}
