"""The compressed GPU cache (paper section 5): slab + hashmap on the GPU, every row in a pinned host store.

``FeatureCache`` is the public entry point; the other modules are its parts, each usable alone:
``entry`` (64-bit hashmap value), ``hashmap`` (index), ``slab`` (data store), ``host_store``, ``policy``,
``stats``. Importing this package touches no CUDA and compiles nothing.
"""

from __future__ import annotations

from .feature_cache import FeatureCache, mode_name
from .policy import POLICIES, PolicyKind, make_policy

__all__ = ["FeatureCache", "mode_name", "PolicyKind", "POLICIES", "make_policy"]
