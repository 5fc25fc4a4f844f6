"""Argument checks shared by every public entry point; messages read "expected ..., got ..."."""

from __future__ import annotations

import torch

from .errors import InvalidIdsError

__all__ = ["check_rows", "check_ids", "as_row_bytes", "resolve_device", "OUT_CONTIGUOUS_WHY"]

OUT_CONTIGUOUS_WHY = ("kernels write rows straight into out, and a strided out would need a hidden full copy "
                      "back after every fetch; pass a contiguous tensor, e.g. torch.empty(...)")


def check_rows(x: object, name: str = "x") -> torch.Tensor:
    """A row tensor: a torch.Tensor with at least one dimension (rows first), returned contiguous.

    A non-contiguous tensor (a column slice, a transposed matrix) is copied once with ``.contiguous()``. Every
    caller is a construction path (fit, compress, building a store) that reads all rows into new buffers anyway,
    so the copy is transient (freed when construction ends) and never happens on a fetch.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name}: expected a tensor of shape [N, ...], got a 0-d tensor")
    if x.is_complex():
        raise TypeError(f"{name}: dtype {x.dtype} is not supported")
    return x if x.is_contiguous() else x.contiguous()


def as_row_bytes(x: torch.Tensor) -> torch.Tensor:
    """View [N, ...] rows as uint8 [N, row_bytes] without copying."""
    n = x.shape[0]
    if x.numel() == 0 and n > 0:
        raise ValueError(f"rows of zero bytes cannot be stored (shape {tuple(x.shape)})")
    flat = x.reshape(n, -1) if x.dim() > 1 else x.reshape(n, 1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).reshape(n, -1)


def check_ids(ids: object, n_rows: int, device: torch.device, name: str = "ids", check_range: bool = True
              ) -> torch.Tensor:
    """Validate row ids: an integer tensor (int64, or int32 widened), 1-D, all in [0, n_rows).

    The range check is one min/max reduction on the ids' device (a single device sync on CUDA), never a
    host loop. Returns contiguous int64 ids on ``device``. ``check_range=False`` skips the range check (and so the
    sync): for callers whose kernels check ids themselves and report bad ones lazily.
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name}: expected an int64 torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise InvalidIdsError(f"{name}: expected dtype int64 (or int32), got {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidIdsError(f"{name}: expected a 1-D tensor, got shape {tuple(ids.shape)}")
    ids = ids.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    if check_range and ids.numel():
        lo, hi = torch.aminmax(ids)
        lo_v, hi_v = int(lo), int(hi)
        if lo_v < 0:
            raise InvalidIdsError(f"{name}: negative id {lo_v} (ids must be in [0, {n_rows}))")
        if hi_v >= n_rows:
            raise InvalidIdsError(f"{name}: id {hi_v} is out of range for {n_rows} rows")
    return ids


def resolve_device(device: "str | torch.device | None") -> torch.device:
    """'cuda' needs a visible GPU; say so instead of failing deep inside a kernel."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was requested but no CUDA GPU is available (use device='cpu')")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dev
