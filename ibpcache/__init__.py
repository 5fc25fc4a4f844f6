"""ibpcache: a lossless Invariant Bit Packing (IBP) offload cache for ML data bigger than GPU memory.

Importing the package touches no CUDA and compiles nothing; kernels build on first use.
"""

from __future__ import annotations

from .codec import Codec, IBPCodec, RawCodec
from .compressed import CompressedRows  # installs Codec.compress
from .errors import (CapacityError, CodecKindError, ConfigError, DeviceError, FormatError, IbpcacheError,
                     InternalError, InvalidArgumentError, InvalidIdsError, InvalidTypeError, KernelBuildError,
                     OptimizerStateError, RowDtypeError, RowShapeError, StateError, UnsupportedError,
                     UnsupportedModelError)
from .exponent import ExponentCodec  # registers the "exponent" method with Codec.fit / Codec.load
from .format import FORMAT_VERSION, Layout

__all__ = [
    "Codec",
    "IBPCodec",
    "ExponentCodec",
    "RawCodec",
    "CompressedRows",
    "FeatureCache",
    "Layout",
    "FORMAT_VERSION",
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

__version__ = "0.1.0"


def __getattr__(name: str):
    """``FeatureCache`` is imported on first use so the codec imports stay light."""
    if name == "FeatureCache":
        from .cache.feature_cache import FeatureCache

        return FeatureCache
    raise AttributeError(f"module 'ibpcache' has no attribute {name!r}")
