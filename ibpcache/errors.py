"""Exception types: every bad input raises one of these, with a message naming the problem."""

from __future__ import annotations

__all__ = [
    "IbpcacheError",
    "FormatError",
    "CapacityError",
    "KernelBuildError",
    "InvalidIdsError",
    "OptimizerStateError",
]


class IbpcacheError(Exception):
    """Base class of every error ibpcache raises on purpose."""


class FormatError(IbpcacheError, ValueError):
    """A stored file or buffer is corrupt, truncated, or of an unknown version; or an input is malformed."""


class CapacityError(IbpcacheError, ValueError):
    """A budget or buffer is too small for what was asked."""


class KernelBuildError(IbpcacheError, RuntimeError):
    """A CUDA source failed to compile or load."""


class InvalidIdsError(IbpcacheError, IndexError):
    """Row ids that are negative, out of range, or of the wrong dtype."""


class OptimizerStateError(IbpcacheError, RuntimeError):
    """An optimizer step the row cache cannot keep exact: per-row state or updates of rows outside the cache that
    would stay with a cache slot instead of following its row (the message says what to do)."""
