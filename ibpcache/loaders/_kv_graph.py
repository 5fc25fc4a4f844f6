"""CUDA graphs of sparse mode's per-layer speculation (issue 13, item 4: the decode step's KV work captured).

Eager, speculating layer j costs the host about 1.5 ms at 8B shapes (profiled on the H100: the query projection,
the scoring and selection, the fetch launch), about 40 ms of a 28-layer decode step that the GPU finishes in half
that time. Captured once per (layer, k), a replay costs one launch: the projection of the layer's query from the
previous layer's input, the partial-key scores and top-k (token count read on the device), and, for a zero-copy
store, the fetch of the selected rows into fixed buffers.

Replays run on their own stream after it waited for the current one, so layer j's speculation and fetch overlap
layer j-1's compute; :meth:`KVOffloadManager.take` makes the current stream wait for the replay's event. Every
input a graph reads is a fixed buffer (the hidden state and RoPE tables copied in on that stream) or device state
that stays in place (the store's descriptor, the partial key cache, the device token counter); a graph is
captured again when one of them is replaced (growth, batch change) or when the planned k changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._kv_select import PartialKeySelector, project_query

if TYPE_CHECKING:
    from .kv import KVOffloadManager

__all__ = ["SpeculationGraphs"]

_PER_LAYER = 2  # graphs kept per layer (k values): a third k evicts the oldest


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    k: int
    keys: torch.Tensor  # the partial key cache captured (identity checked before each replay)
    valid: "torch.Tensor | None"  # the padding buffer the scores read (None: captured without padding)
    store: object  # the manager's store of the layer whose descriptor the fetch reads (None: fetch not captured)
    idx: torch.Tensor
    counts: torch.Tensor
    out: "tuple[torch.Tensor, torch.Tensor] | None"  # fetched K/V [B, H, k + 1, D] when the fetch is captured
    refs: tuple  # buffers the graph reads or writes that nothing else keeps alive


class SpeculationGraphs:
    """Captured speculation of each layer, replayed in place of the eager hooks' work (see the module docstring)."""

    def __init__(self, decoder: "torch.nn.ModuleList", selector: PartialKeySelector, device: torch.device) -> None:
        self.decoder, self.selector, self.device = decoder, selector, device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: list[dict[int, _Graph]] = [{} for _ in range(len(decoder))]
        self._inputs: "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None" = None  # hidden, cos, sin
        self._pos_src: "tuple[torch.Tensor, torch.Tensor] | None" = None
        self._scores: "torch.Tensor | None" = None
        self._valid: "torch.Tensor | None" = None  # bool [B, cap]: the padding of the current step, copied in
        self.captures = 0
        self.replays = 0

    def _static_inputs(self, hidden: torch.Tensor, pos: tuple) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
        cur = self._inputs
        if cur is None or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(cur, (hidden, *pos))):
            self._inputs = tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (hidden, *pos))
            self._graphs = [{} for _ in self._graphs]  # captured against the old buffers
            self._pos_src = None
        return self._inputs

    def _scores_buffer(self, b: int, h: int, cap: int) -> torch.Tensor:
        s = self._scores
        if s is None or s.shape[0] != b or s.shape[1] != h or s.shape[2] < cap:
            s = self._scores = torch.empty((b, h, cap), dtype=torch.float32, device=self.device)
        return s

    def _valid_buffer(self, valid: torch.Tensor, cap: int) -> torch.Tensor:
        """The step's padding [B, n_past] copied into the fixed [B, cap] buffer graphs read (on the graph stream)."""
        buf = self._valid
        if buf is None or buf.shape[0] != valid.shape[0] or buf.shape[1] < cap:
            buf = self._valid = torch.ones((valid.shape[0], cap), dtype=torch.bool, device=self.device)
        return buf

    def _capture(self, j: int, k: int, mgr: "KVOffloadManager", fetch: bool, valid: "torch.Tensor | None") -> _Graph:
        from ..kernels._build import device_index, get_function

        sel = self.selector
        keys = sel.keys_of(j)
        b, hkv, cap, _ = keys.shape
        hidden, cos, sin = self._inputs
        dev = self.device
        scores = self._scores_buffer(b, hkv, cap)
        idx = torch.empty((b, hkv, k), dtype=torch.int64, device=dev)
        counts = torch.empty((b, hkv), dtype=torch.int32, device=dev)
        out = None
        if fetch:
            shape = (b, hkv, k + 1, mgr.head_dim)
            out = (torch.empty(shape, dtype=mgr.dtype, device=dev), torch.empty(shape, dtype=mgr.dtype, device=dev))
        symbols = [("kv_select.cu", "ibp_partial_scores"), ("kv_select.cu", "ibp_select_top")]
        if fetch:
            symbols.append(("kv_packed.cu", "ibp_kvp_fetch"))
        for src, symbol in symbols:  # no module loads while capturing
            get_function(src, symbol, device_index(dev))
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self.stream):  # warm the projection's libraries up on this stream
            project_query(self.decoder[j], hidden, (cos, sin))
        graph = torch.cuda.CUDAGraph()
        # thread_local: the CPU-gather path's worker thread may call the CUDA runtime while this thread captures
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            q = project_query(self.decoder[j], hidden, (cos, sin))
            sel.select_static(j, q, k, scores, idx, counts, valid)
            if fetch:
                mgr.graph_fetch(j, idx, out)
        self.captures += 1
        g = _Graph(graph, k, keys, valid, mgr.layer_store(j) if fetch else None, idx, counts, out,
                   (scores,))
        table = self._graphs[j]
        if len(table) >= _PER_LAYER:
            table.pop(next(iter(table)))
        table[k] = g
        return g

    def speculate(self, j: int, hidden: torch.Tensor, pos: tuple, valid: "torch.Tensor | None",
                  mgr: "KVOffloadManager") -> "tuple[torch.Tensor, torch.cuda.Event]":
        """Replay layer ``j``'s speculation (capturing it first if needed) for the decode query at ``hidden`` with
        RoPE tables ``pos`` and padding ``valid`` ([B, n_past] bool, or None). Returns the selected token indices
        [B, Hkv, k] and the event after which they (and, captured, their fetch) are ready; the fetch is left
        pending in ``mgr`` (captured, or started eagerly after the replay)."""
        sel = self.selector
        k = sel.planned_k(j)
        fetch = mgr.can_graph_fetch(j)
        h_in, cos_in, sin_in = self._static_inputs(hidden, pos)
        keys = sel.keys_of(j)
        vbuf = None if valid is None else self._valid_buffer(valid, keys.shape[2])
        g = self._graphs[j].get(k)
        if g is not None and (g.keys is not keys or g.valid is not vbuf
                              or g.store is not (mgr.layer_store(j) if fetch else None)):
            self._graphs[j].pop(k)
            g = None
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            h_in.copy_(hidden)
            if self._pos_src is None or self._pos_src[0] is not pos[0] or self._pos_src[1] is not pos[1]:
                cos_in.copy_(pos[0])
                sin_in.copy_(pos[1])
                self._pos_src = pos
            if vbuf is not None:
                vbuf[:, : valid.shape[1]].copy_(valid)
                valid.record_stream(self.stream)
        if g is None:
            g = self._capture(j, k, mgr, fetch, vbuf)
        with torch.cuda.stream(self.stream):
            g.graph.replay()
            done = sel.note_static(j, k, g.counts)
        self.replays += 1
        hidden.record_stream(self.stream)
        if g.out is not None:
            mgr.adopt_prefetch(j, g.idx, g.out, 1, done, refs=(g.keys,))
        else:  # the CPU-gather path needs the indices on the host: its prefetch starts after the replay, as eager
            main.wait_event(done)
            mgr.prefetch(j, g.idx, extra_tokens=1)
        return g.idx, done

    def stats(self) -> dict[str, Any]:
        return {"graph_captures": self.captures, "graph_replays": self.replays}
