"""Exception types: every bad input raises one of these, with a message naming the problem."""

from __future__ import annotations

__all__ = [
    "IbpcacheError",
    "FormatError",
    "CapacityError",
    "KernelBuildError",
    "InvalidIdsError",
    "UnsupportedModelError",
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


class UnsupportedModelError(IbpcacheError, ValueError):
    """A model or model config that an adapter cannot serve (e.g. an encoder-decoder given to the KV cache)."""
