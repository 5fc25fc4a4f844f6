"""Argument checks shared by every public entry point; messages read "expected ..., got ..."."""

from __future__ import annotations

import math

import numpy as np
import torch

from .errors import CapacityError, DeviceError, InvalidArgumentError, InvalidIdsError, InvalidTypeError

__all__ = ["check_rows", "check_ids", "as_row_bytes", "resolve_device", "OUT_CONTIGUOUS_WHY", "check_fraction",
           "check_budget", "resolve_budget"]

OUT_CONTIGUOUS_WHY = ("kernels write rows straight into out, and a strided out would need a hidden full copy "
                      "back after every fetch; pass a contiguous tensor, e.g. torch.empty(...)")


def check_rows(x: object, name: str = "x") -> torch.Tensor:
    """A row tensor: a torch.Tensor with at least one dimension (rows first), returned contiguous.

    A non-contiguous tensor (a column slice, a transposed matrix) is copied once with ``.contiguous()``. Every
    caller is a construction path (fit, compress, building a store) that reads all rows into new buffers anyway,
    so the copy is transient (freed when construction ends) and never happens on a fetch.
    """
    if not isinstance(x, torch.Tensor):
        raise InvalidTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise InvalidArgumentError(f"{name}: expected a tensor of shape [N, ...], got a 0-d tensor")
    if x.is_complex():
        raise InvalidTypeError(f"{name}: dtype {x.dtype} is not supported")
    return x if x.is_contiguous() else x.contiguous()


def as_row_bytes(x: torch.Tensor) -> torch.Tensor:
    """View [N, ...] rows as uint8 [N, row_bytes] without copying."""
    n = x.shape[0]
    if x.numel() == 0 and n > 0:
        raise InvalidArgumentError(f"rows of zero bytes cannot be stored (shape {tuple(x.shape)})")
    flat = x.reshape(n, -1) if x.dim() > 1 else x.reshape(n, 1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).reshape(n, -1)


def check_ids(ids: object, n_rows: int, device: torch.device, name: str = "ids", check_range: bool = True
              ) -> torch.Tensor:
    """Validate row ids: an integer tensor (int64, or int32 widened), 1-D, all in [0, n_rows).

    The range check is one min/max reduction, never a host loop: on the CPU when the ids are there (before they
    move, so CPU ids bound for a GPU cost no device sync: a loader's fetch stage keeps running ahead), else on the
    ids' device (one sync on CUDA). Returns contiguous int64 ids on ``device``. ``check_range=False`` skips the range
    check (and so the sync): for callers whose kernels check ids themselves and report bad ones lazily.
    """
    if not isinstance(ids, torch.Tensor):
        raise InvalidTypeError(f"{name}: expected an int64 torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise InvalidIdsError(f"{name}: expected dtype int64 (or int32), got {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidIdsError(f"{name}: expected a 1-D tensor, got shape {tuple(ids.shape)}")
    if check_range and ids.device.type == "cpu" and ids.numel():
        _check_range(ids, n_rows, name)
        check_range = False
    ids = ids.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    if check_range and ids.numel():
        _check_range(ids, n_rows, name)
    return ids


def _check_range(ids: torch.Tensor, n_rows: int, name: str) -> None:
    """Raise unless every id is in ``[0, n_rows)`` (one min/max reduction where the ids are)."""
    lo, hi = torch.aminmax(ids)
    lo_v, hi_v = int(lo), int(hi)
    if lo_v < 0:
        raise InvalidIdsError(f"{name}: negative id {lo_v} (ids must be in [0, {n_rows}))")
    if hi_v >= n_rows:
        raise InvalidIdsError(f"{name}: id {hi_v} is out of range for {n_rows} rows")


def resolve_device(device: "str | torch.device | None") -> torch.device:
    """'cuda' needs a visible GPU; say so instead of failing deep inside a kernel."""
    try:
        dev = torch.device(device) if device is not None else torch.device("cpu")
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"device must be 'cpu' or 'cuda', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device='cuda' was requested but no CUDA GPU is available (use device='cpu')")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dev


# ------------------------------------------------------------------------------------------------------------
# Budgets and fractions. A cache size is either a fraction of the table (a float) or a byte count (an int); the
# two never overlap, so ``1`` (one byte) and ``1.0`` (the whole table) cannot be confused silently.


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_float(value: object) -> bool:
    return isinstance(value, (float, np.floating))


def _plain(value: object) -> object:
    """A NumPy scalar as the Python number it holds (messages show ``0`` rather than ``np.int64(0)``)."""
    return value.item() if isinstance(value, np.generic) else value


def check_fraction(value: object, name: str) -> float:
    """A ratio in (0, 1] (a float, or the int 1): what ``cache_ratio``-style arguments take. NaN, bools, strings
    and values outside (0, 1] raise, naming ``name`` and the value."""
    if not (_is_int(value) or _is_float(value)):
        raise InvalidTypeError(f"{name}: expected a number in (0, 1], got {type(value).__name__} {value!r}")
    if not 0.0 < float(value) <= 1.0:  # NaN fails this too
        raise InvalidArgumentError(f"{name}={_plain(value)!r}: must be in (0, 1]")
    return float(value)


def check_budget(budget: object, name: str = "budget_bytes") -> "int | float":
    """A cache budget checked for its own sake, before any data is seen: a float in (0, 1] is a fraction of the
    table's raw bytes (``1.0`` = the whole table); an int >= 1 is a byte count. Returned as a Python float or int.

    Anything else raises, naming ``name`` and the value: a bool or a non-number (:class:`InvalidTypeError`), a float
    that is NaN or outside (0, 1], an int below 1 (:class:`InvalidArgumentError`).
    """
    if _is_float(budget):
        if not 0.0 < float(budget) <= 1.0:  # NaN fails this too
            raise InvalidArgumentError(
                f"{name}={_plain(budget)!r}: a float budget is a fraction of the table's raw bytes and must be in (0, 1] "
                "(1.0 = the whole table); for a byte count pass an int")
        return float(budget)
    if _is_int(budget):
        if budget < 1:
            raise InvalidArgumentError(
                f"{name}={_plain(budget)!r}: an int budget is a byte count and must be >= 1; for a fraction of the table's "
                "raw bytes pass a float in (0, 1]")
        return int(budget)
    raise InvalidTypeError(f"{name}: expected a float fraction in (0, 1] of the table's raw bytes or an int byte "
                           f"count >= 1, got {type(budget).__name__} {budget!r}")


def resolve_budget(budget: object, total_bytes: int, min_row_bytes: int = 1, name: str = "budget_bytes",
                   align: int = 1) -> int:
    """Bytes of a cache budget (see :func:`check_budget`) for a table of ``total_bytes`` raw bytes.

    The budget must hold at least one row: ``min_row_bytes`` is the smallest row the cache would store (its stored,
    possibly compressed, length; 1 when not known yet, which still refuses budgets that hold nothing at all), and
    the cache uses the budget in whole ``align``-byte units. A smaller budget raises :class:`CapacityError` naming the
    value and the smallest valid budget, as bytes and as a fraction, instead of building a cache of 0 rows.
    """
    value = check_budget(budget, name)
    nbytes = int(value * total_bytes) if isinstance(value, float) else value
    min_bytes = -(-max(int(min_row_bytes), 1) // align) * align
    if nbytes < min_bytes:
        given = f"{name}={_plain(budget)!r}" + (f" ({nbytes} bytes of {total_bytes})" if isinstance(value, float)
                                         else " (an int budget is a byte count)")
        raise CapacityError(f"{given}: too small to cache one row; the smallest valid budget is {min_bytes} bytes "
                            f"(an int){_min_fraction_hint(min_bytes, total_bytes)}")
    return nbytes


def _min_fraction_hint(min_bytes: int, total_bytes: int) -> str:
    """``" or a fraction >= f"`` with the smallest f (rounded up to 3 significant digits) whose bytes suffice."""
    if min_bytes > total_bytes:
        return f"; no fraction of this {total_bytes}-byte table holds a row"
    frac = min_bytes / total_bytes
    digits = 2 - math.floor(math.log10(frac))
    shown = math.ceil(frac * 10**digits) / 10**digits
    while int(shown * total_bytes) < min_bytes:  # float rounding at the boundary
        shown = math.nextafter(shown, 2.0)
    return f" or a fraction >= {shown!r} (a float) of the table's {total_bytes} raw bytes"
