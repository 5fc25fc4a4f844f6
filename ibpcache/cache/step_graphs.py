"""CUDA graphs of a cache's inference step: one launch instead of about forty.

A DLRM lookup step of batch 1024 over 26 tables is bound by the host, not the device: on an H200 its Python and ~38
launches take 0.5-0.7 ms around 0.19 ms of kernels, and the same step replayed from a CUDA graph takes 0.22-0.24 ms
(``docs/results/2026-11-26-h200-s24/dlrm_step_overhead.jsonl``). :class:`StepGraphs` captures a step once per key
and replays it with the step's inputs copied into static buffers and the output copied out, or, for a step whose
kernels read their output's address from device memory (``by_ref``), with that address stored before the replay:
the replay then writes the caller's output itself (a copy out of 109 MB took 55 us of a 0.6 ms DLRM step at batch
8192, H200).

The key names everything a captured step depends on that may change between steps: the input shapes, the way the
path planner chose, and a generation number the owner bumps whenever a buffer the step reads or writes is replaced.
A key is captured the second time it is seen, after one eager run (kernel builds and first-use allocations happen
outside a capture). Graphs of one owner share one memory pool: the owner serializes its steps (its ``StreamOrder``),
so two replays' intermediates never live at the same time. A capture that fails turns graphs off for the owner
(``error`` says why) and its steps run eagerly from then on: graphs only ever remove host time.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["StepGraphs", "unstick_generator", "generator_kept"]

Inputs = tuple[Optional[torch.Tensor], ...]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: Inputs  # static copies the graph reads
    out: Optional[torch.Tensor]  # static output the graph writes (None: by reference)
    ref: Optional[torch.Tensor]  # int64 [1]: the output address the graph's kernels read (by reference)
    keep: tuple  # objects the graph reads that nothing else may keep alive (layouts' tensors)


def _release(cap: _Captured) -> None:
    """Drop a captured step. Its static buffers may still be read by a replay in flight: they are marked in use by
    the current stream, which the owner's StreamOrder has ordered after every earlier replay, so their memory is
    reused only after those replays; the graph itself is freed by CUDA once it completes."""
    for t in (*cap.inputs, cap.out, cap.ref):
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def unstick_generator(device: torch.device) -> None:
    """Give the device's default CUDA generator back to the caller after a capture that ended in an error.

    torch puts that generator in capture mode when a capture begins and takes it out only when the capture ends
    cleanly; a capture CUDA invalidated (a body that syncs, say) raises first, leaving every later random op on the
    device failing with "Offset increment outside graph capture". A probe draw (its offset restored) tells whether
    the generator is stuck; a stuck one gets a fresh state holding the same seed and offset, so the user's random
    stream goes on exactly where it was.
    """
    gen = torch.cuda.default_generators[torch.device(device).index or 0]
    saved = gen.get_state()
    try:
        torch.empty(4, device=device).uniform_(generator=gen)
    except RuntimeError:
        gen.graphsafe_set_state(gen.clone_state())
    else:
        gen.set_state(saved)


@contextlib.contextmanager
def generator_kept(device: torch.device) -> Iterator[None]:
    """Around a CUDA graph capture (outermost, so it sees ``capture_end``'s error too): if the capture fails,
    :func:`unstick_generator` before the error goes on."""
    try:
        yield
    except BaseException:
        unstick_generator(device)
        raise


class StepGraphs:
    """Captured steps of one owner, keyed (see the module docstring); at most ``max_graphs`` kept, least recently
    replayed dropped first."""

    def __init__(self, device: torch.device, max_graphs: int = 16, capture_stream: Optional[Any] = None) -> None:
        """``capture_stream``: where steps are captured (default: a new stream of ``device``). A captured kernel keeps
        the context it was captured in, so steps meant to run on a CUDA green context's SMs only are captured on a
        stream of that context."""
        self.device = device
        self.capture_stream = capture_stream
        self.max_graphs = int(max_graphs)
        self.enabled = device.type == "cuda"
        self.error: Optional[str] = None
        self.captures = 0
        self.replays = 0
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._seen: set[tuple] = set()
        self._pool: Optional[tuple] = None
        self._stream: Optional[torch.cuda.Stream] = None

    def clear(self) -> None:
        while self._graphs:
            _release(self._graphs.popitem()[1])
        self._seen.clear()

    def disable(self, reason: str) -> None:
        self.enabled = False
        self.error = reason
        self.clear()

    def run(self, key: tuple, inputs: Inputs, out: torch.Tensor, body: Callable[..., None],
            keep: tuple = (), by_ref: bool = False) -> bool:
        """Run the step of ``key`` from its graph (inputs copied in, ``out`` copied out); False where the caller
        must run it eagerly instead: graphs off, the key's first sight, or a capture that failed.

        ``by_ref``: ``body(static inputs, out, ref)`` writes ``out`` only through kernels that read its address
        from ``ref`` (int64 [1] on the device) when they run; each replay stores ``out``'s address there first, so
        the graph writes the caller's ``out`` and nothing is copied. Else ``body(static inputs, static out)``."""
        if not self.enabled:
            return False
        cap = self._graphs.get(key)
        if cap is None:
            if key not in self._seen:
                if len(self._seen) > 8 * self.max_graphs:  # keys of replaced buffers never come back
                    self._seen.clear()
                self._seen.add(key)
                return False
            cap = self._capture(inputs, out, body, keep, by_ref)
            if cap is None:
                return False
            self._graphs[key] = cap
            while len(self._graphs) > self.max_graphs:
                _release(self._graphs.popitem(last=False)[1])
        else:
            self._graphs.move_to_end(key)
        for static, given in zip(cap.inputs, inputs):
            if static is not None:
                static.copy_(given)
        if cap.ref is not None:
            cap.ref.fill_(out.data_ptr())  # in the stream, before the replay reads it
        cap.graph.replay()
        if cap.out is not None:
            out.copy_(cap.out)
        self.replays += 1
        return True

    def _capture(self, inputs: Inputs, out: torch.Tensor, body: Callable[..., None], keep: tuple,
                 by_ref: bool) -> Optional[_Captured]:
        """Capture the body (see :meth:`run`) on a side stream into the shared pool; None (graphs off, the reason
        kept) when the capture fails. Nothing runs: the caller replays the graph for this step."""
        static_in = tuple(None if t is None else t.clone() for t in inputs)
        ref = torch.zeros(1, dtype=torch.int64, device=out.device) if by_ref else None
        static_out = None if by_ref else torch.empty_like(out)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = self.capture_stream if self.capture_stream is not None else torch.cuda.Stream(self.device)
        caller = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(caller)  # the static copies are made on the caller's stream
        graph = torch.cuda.CUDAGraph()
        try:
            with generator_kept(self.device), torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    if by_ref:
                        body(static_in, out, ref)  # out: its shape only; the kernels write where ref points
                    else:
                        body(static_in, static_out)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 -- any capture failure: eager steps, the reason in stats()
            caller.wait_stream(self._stream)
            self.disable(f"{type(exc).__name__}: {exc}")
            return None
        caller.wait_stream(self._stream)
        self.captures += 1
        return _Captured(graph, static_in, static_out, ref, keep)

    def stats(self) -> dict:
        return {"graphs": len(self._graphs), "graph_captures": self.captures, "graph_replays": self.replays,
                "graphs_enabled": self.enabled, "graph_error": self.error}
