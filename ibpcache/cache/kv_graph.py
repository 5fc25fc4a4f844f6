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

The layer's update after attention is captured too (:meth:`SpeculationGraphs.append`, per speculation graph): the
new token's K/V are copied to the last position of the replay's output (the attention input), and a graph appends
them from there to the store (``KVOffloadManager.graph_append``: slot and token from the device's count) and to the
partial key cache (``PartialKeySelector.append_keys_static``: position from the device counter). Eager, that update
was ~15 ms of host work per Qwen2.5-7B-shaped step (profiled on the H100). The CPU-gather baseline's store write
stays eager (a host copy to a slot that moves every step); its partial-key append is replayed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from .kv_select import PartialKeySelector
from .step_graphs import generator_kept

if TYPE_CHECKING:
    from .kv_manager import KVOffloadManager

__all__ = ["SpeculationGraphs", "QueryProjection"]

QueryProjection = Callable[[int, torch.Tensor, "tuple[torch.Tensor, ...]"], torch.Tensor]
"""``project(j, hidden, pos)``: layer ``j``'s query states [B, Hq, T, D] after RoPE from the residual input ``hidden``
and the position tables ``pos`` (the model's business: the transformers adapter passes it in). Captured into the
graphs, so it must only launch device work (no host sync, no allocation that outlives the capture)."""

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
    append: "_AppendGraph | None" = None  # the layer's append after attending to this selection


@dataclass
class _AppendGraph:
    """The append of one decode step's K/V, captured: the partial key columns and, on a zero-copy store, the store's
    append (``KVOffloadManager.graph_append``), read from ``inputs``: the last token position of the speculation's
    output buffers (zero-copy: the attention input) or buffers of its own (CPU-gather)."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple  # [B, Hkv, 1, D] K (and V, zero-copy) the graph reads
    keys: torch.Tensor  # the partial key cache it writes (identity checked before each replay)
    store: object  # the store it appends to, with the (slot, token) of the capture (None: the store is eager)
    where: tuple[int, int]


class SpeculationGraphs:
    """Captured speculation of each layer, replayed in place of the eager hooks' work (see the module docstring)."""

    def __init__(self, project: QueryProjection, selector: PartialKeySelector, device: torch.device) -> None:
        self.project, self.selector, self.device = project, selector, device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: list[dict[int, _Graph]] = [{} for _ in range(selector.num_layers)]
        self._last_k: list[int] = [-1] * selector.num_layers  # each layer's k at its previous speculation
        self._inputs: "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None" = None  # hidden, cos, sin
        self._pos_src: "tuple[torch.Tensor, torch.Tensor] | None" = None
        self._scores: "torch.Tensor | None" = None
        self._valid: "torch.Tensor | None" = None  # bool [B, cap]: the padding of the current step, copied in
        self.captures = 0
        self.replays = 0
        self.append_replays = 0
        self.eager = 0  # speculations left to the caller (a k not seen at the layer's previous step)

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
            self.project(j, hidden, (cos, sin))
        graph = torch.cuda.CUDAGraph()
        # thread_local: the CPU-gather path's worker thread may call the CUDA runtime while this thread captures
        with generator_kept(dev), torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                                    capture_error_mode="thread_local"):
            q = self.project(j, hidden, (cos, sin))
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
                  mgr: "KVOffloadManager") -> "tuple[torch.Tensor, torch.cuda.Event] | None":
        """Replay layer ``j``'s speculation (capturing it first if needed) for the decode query at ``hidden`` with
        RoPE tables ``pos`` and padding ``valid`` ([B, n_past] bool, or None). Returns the selected token indices
        [B, Hkv, k] and the event after which they (and, captured, their fetch) are ready; the fetch is left
        pending in ``mgr`` (captured, or started eagerly after the replay).

        Returns None, doing nothing, when k has no graph and differs from the layer's previous k: the caller then
        speculates eagerly. A capture waits for the device and costs more than an eager step, so only a k seen twice
        in a row is captured: short contexts, where k follows the token count every step, stay eager."""
        sel = self.selector
        k = sel.planned_k(j)
        fetch = mgr.can_graph_fetch(j)
        keys = sel.keys_of(j)
        h_in, cos_in, sin_in = self._static_inputs(hidden, pos)  # (new static inputs drop every graph)
        g = self._graphs[j].get(k)
        if g is None and self._last_k[j] != k:
            self._last_k[j] = k
            self.eager += 1
            return None
        self._last_k[j] = k
        vbuf = None if valid is None else self._valid_buffer(valid, keys.shape[2])
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

    def append(self, j: int, idx: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mgr: "KVOffloadManager") -> "tuple[torch.Tensor, torch.Tensor] | None":
        """Layer ``j``'s decode-step update after the replay that selected ``idx``: take the fetched K/V, put the new
        token's ``keys``/``values`` ([B, Hkv, 1, D]) after them and append it to the store and the partial key cache,
        the appends replayed from a graph (captured at the first use). Returns the attention input [B, Hkv, k + 1, D],
        or None when ``idx`` is not this object's latest selection of ``j`` (then the caller updates eagerly)."""
        g = self._graphs[j].get(idx.shape[-1])
        if g is None or g.idx is not idx or keys.shape[2] != 1:
            return None
        sel = self.selector
        out = mgr.take(j, idx, extra_tokens=1)
        zero_copy = g.out is not None and out[0] is g.out[0]
        cache = sel.reserve_keys(j, 1)
        a = g.append
        if a is not None and (a.keys is not cache or a.store is not None and not mgr.graph_append_ok(j, a.store,
                                                                                                   *a.where)):
            a = g.append = None
        if zero_copy and (a is None or a.store is None) and not mgr.can_graph_append(j):
            zero_copy = False  # e.g. the first step after a crop rewrites slots: the store appends eagerly
        if a is not None and (a.store is not None) != zero_copy:
            a = g.append = None
        if a is None:
            a = g.append = self._capture_append(j, g, mgr, zero_copy)
        if zero_copy:  # the new token goes where attention reads it; the graph appends it from there
            out[0][:, :, -1:].copy_(keys)
            out[1][:, :, -1:].copy_(values)
            mgr.before_graph_append(j)
            a.graph.replay()
            mgr.after_graph_append(j)
        else:
            mgr.append(j, keys, values, into=out)
            a.inputs[0].copy_(keys)
            a.graph.replay()
        sel.note_appended(j, 1)
        self.append_replays += 1
        return out

    def _capture_append(self, j: int, g: _Graph, mgr: "KVOffloadManager", zero_copy: bool) -> _AppendGraph:
        """Capture layer ``j``'s append after the selection of ``g``: partial keys always, the store's append when
        ``zero_copy`` (it then reads the new token from ``g.out``'s last position). Growth and kernel loading happen
        before the capture, so the graph holds only the append's own launches."""
        from ..kernels._build import device_index, get_function

        if zero_copy:
            mgr.prepare_graph_append(j)  # growth is never captured
            inputs = (g.out[0][:, :, -1:], g.out[1][:, :, -1:])
            for symbol in ("ibp_kvp_size", "ibp_kvp_encode"):  # no module loads while capturing
                get_function("kv_packed.cu", symbol, device_index(self.device))
        else:
            shape = (*g.idx.shape[:2], 1, mgr.head_dim)
            inputs = (torch.empty(shape, dtype=mgr.dtype, device=self.device),)
        sel = self.selector
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):  # the partial-key append's kernels, loaded outside the capture
            pos = sel.length_on_device(j).clone()
            cols = sel._columns(inputs[0], sel._dims[j])
            torch.empty_like(cols).index_copy_(2, pos * 0, cols)
            pos.add_(1)
        main.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        where = (0, 0)
        with generator_kept(self.device), torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                                            capture_error_mode="thread_local"):
            if zero_copy:
                where = mgr.graph_append(j, *inputs)
            sel.append_keys_static(j, inputs[0])
        self.captures += 1
        return _AppendGraph(graph, inputs, sel.keys_of(j), mgr.layer_store(j) if zero_copy else None, where)

    def stats(self) -> dict[str, Any]:
        return {"graph_captures": self.captures, "graph_replays": self.replays,
                "append_graph_replays": self.append_replays, "graph_eager_speculations": self.eager}
