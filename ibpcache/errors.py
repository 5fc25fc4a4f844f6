"""Exception types: every bad input raises one of these, with a message naming the problem."""

from __future__ import annotations

__all__ = [
    "IbpcacheError",
    "FormatError",
    "CapacityError",
    "KernelBuildError",
    "InvalidIdsError",
    "RowDtypeError",
    "RowShapeError",
    "CodecKindError",
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


class RowDtypeError(IbpcacheError, TypeError):
    """Rows of a dtype the codec cannot store: not the dtype it was fitted on, or one its method cannot code."""


class RowShapeError(IbpcacheError, ValueError):
    """Rows whose shape (or byte width) does not fit the codec's tables."""


class CodecKindError(IbpcacheError, TypeError):
    """A codec of a kind this path cannot serve (e.g. the IBP kernels given an exponent codec's tables)."""
