"""Exception types: every bad input raises one of these, with a message naming the problem.

One family, so a caller can catch "anything ibpcache refused" as :class:`IbpcacheError`; each class also derives
from the built-in a caller would catch without knowing ibpcache (NumPy's ``AxisError(ValueError, IndexError)`` is
the model), so ``except ValueError`` around a call keeps working:

- :class:`InvalidArgumentError` (``ValueError``): an argument has the right type but a bad value;
- :class:`InvalidTypeError` (``TypeError``): an argument is of the wrong type;
- :class:`InvalidIdsError` (``IndexError``): row ids or indices are out of range or of a bad dtype;
- :class:`CapacityError` (``ValueError``): a budget or buffer is too small for what was asked;
- :class:`FormatError` (``ValueError``): stored bytes (a file, buffer or segment) are malformed;
- :class:`ConfigError` (``ValueError``): a setting of the main job (``python -m ibpcache``) is invalid;
- :class:`StateError` (``RuntimeError``): a call comes in the wrong state or order;
- :class:`UnsupportedError` (``NotImplementedError``): a valid request this object or build does not do;
- :class:`DeviceError` (``RuntimeError``): the device asked for is missing or lacks a capability;
- :class:`KernelBuildError` (``RuntimeError``): a CUDA source failed to compile or load;
- :class:`InternalError` (``RuntimeError``): an invariant of ibpcache itself broke (a bug to report).
"""

from __future__ import annotations

__all__ = [
    "IbpcacheError",
    "FormatError",
    "CapacityError",
    "KernelBuildError",
    "InvalidIdsError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "ConfigError",
    "StateError",
    "UnsupportedError",
    "DeviceError",
    "InternalError",
    "UnsupportedModelError",
    "RowDtypeError",
    "RowShapeError",
    "CodecKindError",
    "OptimizerStateError",
]


class IbpcacheError(Exception):
    """Base class of every error ibpcache raises on purpose."""


class FormatError(IbpcacheError, ValueError):
    """Stored bytes are malformed: a file or buffer that is corrupt, truncated or of an unknown version, or an
    input whose layout (header, lengths, offsets) contradicts itself."""


class CapacityError(IbpcacheError, ValueError):
    """A budget or buffer is too small for what was asked (e.g. a cache budget that holds no row)."""


class KernelBuildError(IbpcacheError, RuntimeError):
    """A CUDA source failed to compile or load."""


class InvalidIdsError(IbpcacheError, IndexError):
    """Row ids that are negative, out of range, or of the wrong dtype or shape (an ``IndexError``, as torch's
    indexing raises for the same inputs)."""


# ------------------------------------------------------------------------------------------------------------
# Argument, state and environment errors: the natural home of every check a public entry point makes.


class InvalidArgumentError(IbpcacheError, ValueError):
    """An argument has an accepted type but a value outside what the call takes (a non-positive size, an unknown
    option name, mismatched shapes). The message names the argument and the value it got."""


class InvalidTypeError(IbpcacheError, TypeError):
    """An argument is of a type the call does not take (a list where a tensor is needed, a float tensor where
    integers are, a bool where a number is). The message names the argument and the type it got."""


class ConfigError(InvalidArgumentError):
    """A setting of the main job (``python -m ibpcache``) is invalid. The message starts with the setting as a user
    would type it (``task.batch_size=0: ...``); the job prints it and exits with status 2, before doing any work."""


class StateError(IbpcacheError, RuntimeError):
    """The call is valid in general but not in the object's current state or at this point of a sequence: a
    read-only store asked to write, a step before its prerequisite, a capture that is out of date."""


class UnsupportedError(IbpcacheError, NotImplementedError):
    """A well-formed request that this object, mode or build does not implement (an option combination, an
    operation of a framework interface the adapter leaves out). The message says what to use instead."""


class DeviceError(IbpcacheError, RuntimeError):
    """The device asked for is not there or lacks a capability the call needs (``device='cuda'`` without a visible
    GPU, no unified addressing, a failed host-memory registration)."""


class InternalError(IbpcacheError, RuntimeError):
    """An invariant of ibpcache itself broke (a kernel status or a length that cannot happen for valid input):
    a bug to report, never a user mistake."""


class UnsupportedModelError(IbpcacheError, ValueError):
    """A model or model config that an adapter cannot serve (e.g. an encoder-decoder given to the KV cache); the
    message names what is missing and which models are supported."""


class RowDtypeError(InvalidTypeError):
    """Rows of a dtype the codec cannot store: not the dtype it was fitted on, or one its method cannot code."""


class RowShapeError(InvalidArgumentError):
    """Rows whose shape (or byte width) does not fit the codec's tables."""


class CodecKindError(InvalidTypeError):
    """A codec of a kind this path cannot serve (e.g. the IBP kernels given an exponent codec's tables)."""


class OptimizerStateError(StateError):
    """An optimizer step the row cache cannot keep exact: per-row state or updates of rows outside the cache that
    would stay with a cache slot instead of following its row (the message says what to do)."""
