"""Optimizer state that follows its rows through the row cache, so training equals ``torch.optim`` on the full table.

The row cache's rows are one ``nn.Parameter`` of ``C`` slots standing for ``N`` table rows. A torch optimizer over it
has two habits that break that picture:

* it keeps per-element state shaped like the parameter (SGD's momentum buffer, Adam's moments, Adagrad's sums), so
  the state belongs to a *slot*, not to the row living there (and does not even match the parameter's size once an
  oversized batch grew it: "The size of tensor a must match the size of tensor b");
* it moves every row of the parameter at every step, also rows absent from the batch (their gradient is zero, but
  momentum, moments and weight decay still move them). The reference, ``nn.EmbeddingBag`` + the same optimizer,
  moves every row of the table, so a row the cache evicted falls behind.

:class:`RowOptimizer` (``CachedRowManager.attach_optimizer``) fixes both. A row's state is saved to host memory when
the row leaves and restored when it returns; and a row that was out of the cache for updates ``u0+1 .. U`` gets them
on its way back (and the host rows at ``flush``/``weight``): the optimizer's own functional update
(``torch.optim.sgd.sgd`` / ``adam.adam`` / ``adagrad.adagrad``) with a zero gradient, update by update, with the
hyperparameters each update ran with (learning-rate schedules, Adam's step count), logged by a step hook. The same
function on the same device rounds the same way, so the result is bit for bit the reference's; the replay is
vectorised over rows, one call per missed update. Cost: the work the reference's dense update does on those rows
(plus a Python call per missed update), so a row long absent is expensive to bring back; optimizers whose
zero-gradient update leaves a row as it is (plain SGD, Adagrad without weight decay, SparseAdam) replay nothing, and
rows never updated skip updates that cannot move them (no weight decay).

Exactness and its one documented tolerance: the replay and the optimizer's own steps run torch's kernels on the
cache's device, so they round as the reference does wherever torch's rounding does not depend on where an element
sits in its tensor. One CPU kernel does: fp16/bf16 ``Tensor.add(other, alpha=...)`` rounds once in the vectorized
body of a loop and twice in its scalar tail (the last elements of the tensor or of a thread's chunk). SGD's update
and weight decay added to the gradient (SGD, Adam, Adagrad) use it, and the cache's rows sit in tensors of other
lengths than the table's, so with fp16/bf16 rows on the CPU a few elements may differ from the reference by about
one rounding of the table's largest value per such update (tested: within 2 ulps of it and under 3% of elements
after 12 updates; torch itself gives different bits for a table of another length). fp32 rows, and Adam/AdamW
without L2 decay or Adagrad without decay in any dtype, are bit for bit on the CPU; on CUDA, where torch's
elementwise kernels apply one formula to body and tail, every case is expected bit for bit (GPU tests).

A stateful optimizer that was not attached is refused at its first step (:class:`~ibpcache.errors.OptimizerStateError`,
raised by a global optimizer step pre-hook installed with the first cache), as are sparse gradients with SGD momentum
or weight decay (torch keeps a sparse momentum buffer, which cannot follow rows).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.optim.sgd import sgd

from ..errors import InvalidArgumentError, OptimizerStateError
from .._validation import as_row_bytes
from .host_store import HostStore
from .plan_transfer import Transfer

__all__ = ["RowOptimizer", "RowCache", "watch_unattached", "SUPPORTED"]

_HOST_CHUNK_BYTES = 64 << 20
"""Device bytes of rows (and their state) one host catch-up pass moves at a time."""


class RowCache(Protocol):
    """What an optimizer attachment needs of the row cache (``row_cache.CachedRowManager`` has it): the cached
    parameter, the table's size, the host store its rows are read from and written back to, the id -> slot map, and
    the attached optimizer."""

    cached_weight: torch.nn.Parameter
    num_embeddings: int
    embedding_dim: int
    capacity: int
    store: Any  # HostStore: raw_rows, write_rows, row_bytes, dtype
    slot_of: torch.Tensor
    optim: "Optional[RowOptimizer]"


def _sgd_update(rows: torch.Tensor, state: dict[str, torch.Tensor], h: dict, step: Optional[torch.Tensor],
                first: bool) -> None:
    """One zero-gradient SGD update of ``rows`` (as ``SGD.step`` calls it); the first update creates the buffer."""
    buf = state.get("momentum_buffer")
    bufs: list[Optional[torch.Tensor]] = [None if first else buf]
    sgd([rows], [torch.zeros_like(rows)], bufs, foreach=h["foreach"], fused=h["fused"],
        weight_decay=h["weight_decay"], momentum=h["momentum"], lr=h["lr"], dampening=h["dampening"],
        nesterov=h["nesterov"], maximize=h["maximize"])
    if first and buf is not None and bufs[0] is not None:
        buf.copy_(bufs[0])


def _adam_update(rows: torch.Tensor, state: dict[str, torch.Tensor], h: dict, step: Optional[torch.Tensor],
                 first: bool) -> None:
    """One zero-gradient Adam/AdamW update (as ``Adam.step`` calls it; ``step`` is the count before it)."""
    extra = {"decoupled_weight_decay": h["decoupled_weight_decay"]} if "decoupled_weight_decay" in h else {}
    adam([rows], [torch.zeros_like(rows)], [state["exp_avg"]], [state["exp_avg_sq"]],
         [state["max_exp_avg_sq"]] if h["amsgrad"] else [], [step], amsgrad=h["amsgrad"], beta1=h["betas"][0],
         beta2=h["betas"][1], lr=h["lr"], weight_decay=h["weight_decay"], eps=h["eps"], maximize=h["maximize"],
         foreach=h["foreach"], capturable=h["capturable"], differentiable=h["differentiable"], fused=h["fused"],
         **extra)


def _adagrad_update(rows: torch.Tensor, state: dict[str, torch.Tensor], h: dict, step: Optional[torch.Tensor],
                    first: bool) -> None:
    """One zero-gradient Adagrad update (as ``Adagrad.step`` calls it)."""
    adagrad([rows], [torch.zeros_like(rows)], [state["sum"]], [step], lr=h["lr"], weight_decay=h["weight_decay"],
            lr_decay=h["lr_decay"], eps=h["eps"], foreach=h["foreach"], maximize=h["maximize"],
            differentiable=h["differentiable"], fused=h["fused"])


def _decays(h: dict) -> bool:
    """Weight decay or maximize: a zero gradient still moves (or re-signs) a row that has no state yet."""
    return h["weight_decay"] != 0 or bool(h["maximize"])


@dataclass(frozen=True)
class _Family:
    """How one kind of torch optimizer treats a row: its per-row state, whether an update with a zero gradient moves
    a row with state (``moves_idle``) or one whose state is still fresh (``moves_fresh``), the zero-gradient update
    itself, and whether its step counter is state (``counts_steps``)."""

    states: tuple[str, ...]
    moves_idle: Callable[[dict], bool]
    moves_fresh: Callable[[dict], bool]
    update: Optional[Callable[..., None]]
    counts_steps: bool
    init: Callable[[dict], dict[str, float]] = lambda h: {}


_SGD = _Family(("momentum_buffer",), lambda h: h["momentum"] != 0 or _decays(h), _decays, _sgd_update, False)
_ADAM = _Family(("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), lambda h: True, _decays, _adam_update, True)
_ADAGRAD = _Family(("sum",), _decays, _decays, _adagrad_update, True,
                   lambda h: {"sum": float(h["initial_accumulator_value"])})
_SPARSE_ADAM = _Family(("exp_avg", "exp_avg_sq"), lambda h: False, lambda h: False, None, True)

_FAMILIES: dict[type, _Family] = {
    torch.optim.SGD: _SGD,
    torch.optim.Adam: _ADAM,
    torch.optim.AdamW: _ADAM,
    torch.optim.Adagrad: _ADAGRAD,
    torch.optim.SparseAdam: _SPARSE_ADAM,
}

SUPPORTED = tuple(sorted(cls.__name__ for cls in _FAMILIES))
"""Optimizers :meth:`CachedRowManager.attach_optimizer` takes (exact types: a subclass may change the update)."""


def _group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Optional[dict]:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    return None


def _snapshot(group: dict, param: torch.Tensor) -> dict:
    """The group's hyperparameters as one update ran with them. Where neither ``foreach`` nor ``fused`` was set,
    torch picks foreach only when every parameter with a gradient sits on a device type that supports it; a
    replay over the cache's rows alone would see only the cache's device, so a mixed group is recorded as not
    foreach (what torch chose)."""
    snap = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}
    if snap.get("foreach") is None and snap.get("fused") is None:
        if any(p.grad is not None and p.device.type != param.device.type for p in group["params"]):
            snap["foreach"] = False
    return snap


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) or isinstance(w, torch.Tensor):
            if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and torch.equal(v, w)):
                return False
        elif v != w:
            return False
    return True


_COALESCED_MARK = "_ibpcache_coalesced_grad"


def mark_coalesced(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Remember that ``grad``, a sparse gradient built for ``param`` with ``is_coalesced=True``, is coalesced.

    Why: autograd's accumulation re-wraps a sparse gradient's indices and values in a new tensor without the flag
    (torch 2.11-2.13), so torch's Adagrad and SparseAdam coalesce it again: a sort and, on CUDA, a host sync per
    step, for nothing. :func:`restore_coalesced` puts the flag back on exactly that gradient (the same index and
    value memory, the same length), never on one that was accumulated with another."""
    param.__dict__[_COALESCED_MARK] = (grad._indices().data_ptr(), grad._values().data_ptr(), grad._nnz())


def restore_coalesced(param: torch.Tensor) -> None:
    """Flag ``param.grad`` coalesced again if it is the gradient :func:`mark_coalesced` saw (bit-exact: coalescing a
    coalesced gradient sums each row once, from +0, which its values already went through)."""
    mark = param.__dict__.pop(_COALESCED_MARK, None)
    grad = param.grad
    if mark is None or grad is None or not grad.is_sparse or grad.is_coalesced():
        return
    if mark == (grad._indices().data_ptr(), grad._values().data_ptr(), grad._nnz()):
        param.grad = torch.sparse_coo_tensor(grad._indices(), grad._values(), grad.shape, is_coalesced=True)


class RowOptimizer:
    """An optimizer attached to a :class:`~ibpcache.cache.row_cache.CachedRowManager` (see the module docstring).

    ``updates`` counts the optimizer steps that updated the cached rows (steps where they had a gradient), and
    ``last_update[id]`` (CPU int64 per table row) the update a row's host copy -- weights and state -- is current
    as of; a cached row is always current.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mgr: "RowCache") -> None:
        param = mgr.cached_weight
        group = _group_of(optimizer, param)
        if group is None:
            raise InvalidArgumentError("attach_optimizer: the optimizer does not hold this module's cached parameter")
        family = _FAMILIES.get(type(optimizer))
        if family is None:
            raise OptimizerStateError(
                f"attach_optimizer: {type(optimizer).__name__} is not supported (its per-row state cannot follow the "
                f"cache's rows exactly); use one of {', '.join(SUPPORTED)}")
        if type(optimizer) is torch.optim.AdamW and "decoupled_weight_decay" not in group:
            raise OptimizerStateError("attach_optimizer: this torch's AdamW is not Adam with decoupled_weight_decay, "
                                      "the update the catch-up replays; use a newer torch")
        state = optimizer.state.get(param, {})
        stepped = state.get("momentum_buffer") is not None or float(state.get("step", 0)) > 0
        if stepped:
            raise OptimizerStateError("attach_optimizer: this optimizer already stepped the cached rows, so its state "
                                      "belongs to cache slots, not rows; attach it before its first step")
        self.optimizer = optimizer
        self.family = family
        self.param = param  # the same Parameter object however the cache resizes it
        self.n_rows = mgr.num_embeddings
        self.dim = mgr.embedding_dim
        self.updates = 0
        self.last_update = torch.zeros(self.n_rows, dtype=torch.int64, device=param.device)
        self.host: dict[str, HostStore] = {}
        self.init = family.init(group)
        self.log: list[tuple[dict, bool]] = []  # per update: hyperparameters, and whether it created the state
        self.idle_moves = False  # some update moved rows with state although their gradient was zero
        self.fresh_moves = False  # ... or rows with fresh state
        self._pending: Optional[tuple[dict, bool]] = None
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step)]
        self.resize(int(param.shape[0]))  # state made at construction (Adagrad's) for a cache since grown

    # -- the update log ---------------------------------------------------------------------------
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        param = self.param
        self._pending = None
        if param.grad is None:
            return  # torch skips a parameter without a gradient: not an update
        restore_coalesced(param)
        group = _group_of(optimizer, param)
        if group is None:
            return
        if param.grad.is_sparse and self.family.moves_idle(group):
            raise OptimizerStateError(
                f"{type(optimizer).__name__} with momentum or weight decay keeps a sparse momentum buffer over sparse "
                "gradients, which cannot follow the cache's rows: use sparse=False, or Adagrad / SparseAdam")
        first = optimizer.state.get(param, {}).get("momentum_buffer") is None
        self._pending = (_snapshot(group, param), first)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._pending is None:
            return
        snap, first = self._pending
        self._pending = None
        if self.log and _same(self.log[-1][0], snap):
            snap = self.log[-1][0]  # one dict for a run of equal updates
        self.log.append((snap, first))
        self.updates += 1
        self.idle_moves = self.idle_moves or self.family.moves_idle(snap)
        self.fresh_moves = self.fresh_moves or self.family.moves_fresh(snap)

    # -- state that follows its rows ----------------------------------------------------------------
    def row_states(self) -> list[tuple[str, torch.Tensor]]:
        """(key, tensor) of the optimizer's per-row state for the cached rows (none before its first step)."""
        state = self.optimizer.state.get(self.param, {})
        return [(k, state[k]) for k in self.family.states if isinstance(state.get(k), torch.Tensor)]

    def _host_state(self, key: str, like: torch.Tensor) -> HostStore:
        """The host copy of state ``key`` for every table row: a raw :class:`HostStore` (pinned on CUDA), so rows
        move through the device's zero-copy reads and writes, never a pageable copy or a host-side index."""
        if key not in self.host:
            with torch.inference_mode(False):  # written again outside inference mode, which would refuse it
                pin = like.device.type == "cuda"
                rows = torch.empty((self.n_rows, self.dim), dtype=like.dtype, pin_memory=pin)
                rows.fill_(self.init.get(key, 0.0))
                self.host[key] = HostStore(rows, compress=False, device=like.device, transfer=Transfer.ZERO_COPY,
                                           share_rows=True)
        return self.host[key]

    def _read_state(self, key: str, like: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Host state ``key`` of rows ``ids`` as rows on ``like``'s device."""
        return self._host_state(key, like).raw_rows(ids).view(like.dtype).view(ids.numel(), self.dim)

    def _write_state(self, key: str, like: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._host_state(key, like).write_rows(ids, as_row_bytes(rows.contiguous()))

    def save(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Rows ``ids`` leave ``slots``: their state goes to host memory, current as of now (no host sync)."""
        ids = ids.to(self.last_update.device)
        for key, st in self.row_states():
            self._write_state(key, st, ids, st.index_select(0, slots))
        self.last_update.index_fill_(0, ids, self.updates)

    def restore(self, weight: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Rows ``ids`` entered ``slots`` of ``weight`` (their host weights already read): bring their state back and
        catch them up on the updates they missed."""
        ids = ids.to(self.last_update.device)
        states = self.row_states()
        for key, st in states:
            st.index_copy_(0, slots, self._read_state(key, st, ids))
        self.catch_up(weight, slots, dict(states), ids)
        self.last_update.index_fill_(0, ids, self.updates)

    def resize(self, rows: int) -> None:
        """Follow the cached parameter to ``rows`` slots (new slots hold fresh state)."""
        state = self.optimizer.state.get(self.param, {})
        with torch.inference_mode(False):  # the optimizer updates its state in place later, outside inference mode
            for key, st in self.row_states():
                have = st.shape[0]
                if rows > have:
                    grown = st.new_full((rows, *st.shape[1:]), self.init.get(key, 0.0))
                    grown[:have] = st
                    state[key] = grown
                else:
                    state[key] = st[:rows].clone()

    # -- catch-up -------------------------------------------------------------------------------------
    def stale(self, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """Which of ``ids`` missed updates that moved them; None when no update moves a row without a gradient
        (then nothing is ever replayed, and nothing here reads the device)."""
        if not self.idle_moves:
            return None
        last = self.last_update[ids]
        need = last < self.updates
        if not self.fresh_moves:  # rows never updated still have fresh state: nothing moved them
            need &= last > 0
        return need

    def catch_up(self, weight: torch.Tensor, slots: torch.Tensor, states: dict[str, torch.Tensor],
                 ids: torch.Tensor) -> int:
        """Replay on rows ``weight[slots]`` (and ``states[k][slots]``), which hold table rows ``ids`` as of their
        ``last_update``, the zero-gradient updates each missed, in order. Returns the rows replayed."""
        need = self.stale(ids)
        if need is None:
            return 0
        pos = torch.nonzero(need).squeeze(1)
        if pos.numel() == 0:
            return 0
        last = self.last_update[ids[pos]]
        order = torch.argsort(last, stable=True)
        lo = last[order]  # ascending: the rows that missed update t are a prefix
        at = slots.index_select(0, pos[order])
        rows = weight.index_select(0, at)
        st = {k: v.index_select(0, at) for k, v in states.items()}
        first_t = int(lo[0]) + 1
        counts = torch.searchsorted(lo, torch.arange(first_t, self.updates + 1, device=lo.device)).tolist()
        step_like = self.optimizer.state.get(self.param, {}).get("step")
        update = self.family.update
        assert update is not None  # families without one never move idle rows
        for t, n in zip(range(first_t, self.updates + 1), counts):
            hyper, first = self.log[t - 1]
            step = None
            if self.family.counts_steps:
                assert step_like is not None
                step = torch.full_like(step_like, t - 1)
            update(rows[:n], {k: v[:n] for k, v in st.items()}, hyper, step, first)
        weight.index_copy_(0, at, rows)
        for k, v in st.items():
            states[k].index_copy_(0, at, v)
        return int(pos.numel())

    def catch_up_host(self, mgr: "RowCache") -> int:
        """Bring every host row that is not cached up to date (weights written back to the store, state to host
        memory), e.g. before the whole table is read. Returns the rows replayed."""
        need = self.stale(torch.arange(self.n_rows, device=self.last_update.device))
        if need is None:
            return 0
        ids = torch.nonzero(need).squeeze(1)
        if ids.numel():
            ids = ids[mgr.slot_of.to(ids.device).index_select(0, ids) < 0]
        if ids.numel() == 0:
            return 0
        states = self.row_states()
        store = mgr.store
        chunk = max(1, _HOST_CHUNK_BYTES // (store.row_bytes * (1 + len(states))))
        for part in ids.split(chunk):
            u8 = store.raw_rows(part)
            rows = u8.view(store.dtype).view(part.numel(), self.dim)
            st = {k: self._read_state(k, v, part) for k, v in states}
            self.catch_up(rows, torch.arange(part.numel(), device=rows.device), st, part)
            store.write_rows(part, u8)
            for k, v in st.items():
                self._write_state(k, v, part, v)
            self.last_update.index_fill_(0, part, self.updates)
        return int(ids.numel())


# ---- stateful optimizers that were not attached: refused at their first step ----------------------------------

_WATCHED: "weakref.WeakValueDictionary[int, RowCache]" = weakref.WeakValueDictionary()
_HOOK: Any = None


def watch_unattached(mgr: "RowCache") -> None:
    """Refuse optimizer steps over ``mgr``'s cached rows that would not be exact without ``attach_optimizer``."""
    global _HOOK
    _WATCHED[id(mgr.cached_weight)] = mgr
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_check_step)


def _harmless(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Would a step of ``optimizer`` over the cached rows be exact unattached? Only a stateless update that moves
    nothing without a gradient: SGD without momentum and weight decay."""
    return type(optimizer) is torch.optim.SGD and not _SGD.moves_idle(group)


def _check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _WATCHED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            mgr = _WATCHED.get(id(p))
            if mgr is None or mgr.cached_weight is not p or p.grad is None:
                continue
            attached = mgr.optim is not None and mgr.optim.optimizer is optimizer
            if not attached and not _harmless(optimizer, group):
                raise OptimizerStateError(
                    f"{type(optimizer).__name__} keeps per-row state (or moves rows absent from the batch) over the "
                    f"cached embedding rows, whose {mgr.capacity} cache rows take turns holding {mgr.num_embeddings} "
                    "table rows: call module.attach_optimizer(optimizer) once after creating the optimizer and "
                    "before its first step, so the state follows its rows and evicted rows catch up (supported: "
                    f"{', '.join(SUPPORTED)}); plain SGD needs nothing")
