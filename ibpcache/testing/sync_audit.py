"""Find, on the CPU, the operations of a step that would make the host wait for a CUDA device.

``torch.cuda.set_sync_debug_mode("error")`` names only the first synchronizing call and needs a GPU. This audit runs
the same step on the CPU under a ``TorchDispatchMode`` and records every aten op that synchronizes when its tensors
live on a CUDA device (a read of a device value on the host, an op whose output size depends on device data, a
boolean-mask index, a coalesce, a ``repeat_interleave`` without ``output_size``), plus the Python-level host reads
that never reach the dispatcher on the CPU (``tolist``, ``numpy``, ``cpu``) and tensors built from Python data (on
CUDA a copy from pageable host memory). Each finding names the innermost ``ibpcache`` frame that caused it, so a
report reads ``op @ file:line``.

CPU-only branches (a Numba twin reading ``.numpy()``) are reported too: callers filter them by location.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncAudit", "sync_audit", "host_reads_recorded"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SELF = os.path.abspath(__file__)

# aten ops that synchronize whenever their inputs are on a CUDA device (host read, or an output sized by device data);
# lift_fresh is torch.tensor / as_tensor of Python data: where the step moves such a tensor to the device, a copy from
# pageable host memory (the CPU cannot tell whether it does, so every one is reported)
_ALWAYS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_static_fallback", "_unique", "_unique2", "unique_consecutive",
    "unique_dim", "unique_dim_consecutive", "masked_select", "_coalesce", "coalesce", "equal", "is_nonzero",
    "allclose", "bincount", "histc", "lift_fresh",
})


# torch's own wrappers between a caller and the dispatcher: never the place to report
_TORCH_MACHINERY = tuple(os.sep + p for p in ("utils", "_dynamo", "_compile.py", "_tensor.py", "overrides.py"))


def _op_name(func: Any) -> str:
    return func._schema.name.split("::")[-1]


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _flag(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The name a synchronizing op is reported under, or None when this call does not synchronize."""
    name = _op_name(func)
    if name in _ALWAYS:
        return name
    if name in ("index", "_index_put_impl_", "index_put", "index_put_") and _has_bool_index(args):
        return f"{name}[bool mask]"
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor") \
            and kwargs.get("output_size") is None:  # the output's length is the sum of device repeats
        return "repeat_interleave[no output_size]"
    return None


def _where() -> str:
    """The innermost frame inside ibpcache (outside this file), as ``relative/path.py:line``; failing that, the
    innermost frame of torch's Python code outside the dispatch machinery (e.g. an optimizer's step)."""
    fallback = "<outside ibpcache>"
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == _SELF:
            continue
        if path.startswith(_PACKAGE + os.sep):
            return f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{frame.lineno}"
        inner = path[len(torch_dir):]
        if (fallback == "<outside ibpcache>" and path.startswith(torch_dir + os.sep)
                and not inner.startswith(_TORCH_MACHINERY)):
            fallback = f"torch/{os.path.relpath(path, torch_dir)}:{frame.lineno}"
    return fallback


class SyncAudit(TorchDispatchMode):
    """Counts sync-prone ops by ``(op, location)`` while active; read ``found`` afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.found: Counter[tuple[str, str]] = Counter()

    def record(self, name: str) -> None:
        self.found[(name, _where())] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _flag(func, args, kwargs)
        if name is not None:
            self.record(name)
        return func(*args, **kwargs)

    def sites(self) -> set[tuple[str, str]]:
        """``(op, file)`` of every finding: what a test pins without depending on line numbers."""
        return {(name, where.rsplit(":", 1)[0]) for name, where in self.found}

    def table(self) -> str:
        """One line per finding, ``count  op  file:line``, for reports and assertion messages."""
        return "\n".join(f"{count:4d}  {name:36s} {where}" for (name, where), count in sorted(self.found.items()))


@contextlib.contextmanager
def host_reads_recorded(methods: Sequence[str], record: Callable[[str], None]) -> Iterator[None]:
    """Inside the block, each call of a ``torch.Tensor`` method named in ``methods`` (host reads of tensor values,
    e.g. ``tolist``: on the CPU they never reach the dispatcher) first calls ``record(name)``."""
    saved = {attr: getattr(torch.Tensor, attr) for attr in methods}

    def recorded(name: str, original: Any) -> Any:
        def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            record(name)
            return original(self, *args, **kwargs)
        return wrapped

    try:
        for attr, original in saved.items():
            setattr(torch.Tensor, attr, recorded(attr, original))
        yield
    finally:
        for attr, original in saved.items():
            setattr(torch.Tensor, attr, original)


@contextlib.contextmanager
def sync_audit() -> Iterator[SyncAudit]:
    """Record the sync-prone ops run inside the block (dispatch-level ops and host reads of tensor values)."""
    audit = SyncAudit()
    with host_reads_recorded(("tolist", "numpy", "cpu"), audit.record), audit:
        yield audit
