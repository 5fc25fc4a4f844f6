"""Constants shared by the kernels and the layers above them, defined here so the kernels import nothing else.

The import arrows run kernels <- codec <- cache <- loaders: a kernel module may not reach up into
``ibpcache.format`` or ``ibpcache.cache.entry`` for a constant, so the constants a kernel needs live in this
module and ``format.py`` / ``cache/entry.py`` re-export them (one definition, imported both ways down).
The CUDA sources mirror them ("keep in sync"); ``tests/cache/test_entry.py`` parses ``hashmap.cu`` and checks
the entry layout against ``cache/entry.py``, which takes its values from here.
"""

from __future__ import annotations

__all__ = [
    "GROUP_CHUNKS",
    "OFFSET_SHIFT",
    "OFFSET_BITS",
    "SLAB_SHIFT",
    "SLAB_BITS",
    "COMPRESSED_SHIFT",
    "LENGTH_SHIFT",
    "LENGTH_BITS",
    "EMPTY_ENTRY",
    "EMPTY_KEY",
    "TOMBSTONE_KEY",
]

GROUP_CHUNKS = 32
"""Chunks per group: one warp decodes one group per iteration, its participation bits lead the group."""

# The 64-bit hashmap value (the paper's packed pointer); docs and checks live in ibpcache/cache/entry.py.
OFFSET_SHIFT = 0
OFFSET_BITS = 40
SLAB_SHIFT = 40
SLAB_BITS = 3
COMPRESSED_SHIFT = 43
LENGTH_SHIFT = 44
LENGTH_BITS = 20

EMPTY_ENTRY = -1
"""Value meaning "id not cached" (all 64 bits set)."""

EMPTY_KEY = -1
"""Hash table key of a never-used bucket (row ids are >= 0)."""

TOMBSTONE_KEY = -2
"""Hash table key of a bucket whose id was erased: lookups probe past it, inserts may reuse it."""
