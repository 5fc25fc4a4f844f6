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

# ---- The packed KV append store (ibpcache/cache/append_store.py, kernels/kv_packed.cu; keep in sync) -------------
# Rows are placed at *virtual* byte offsets (a running sum of stored lengths); every chunk of a store holds
# 2**chunk_shift bytes of that space, so the row at virtual offset v lives in chunk v >> chunk_shift and may run past
# the chunk's end into its margin (row_bytes + 16 bytes allocated after every chunk). A stored row's position is one
# int64: chunk index << KVP_POS_SHIFT | byte offset inside that chunk (what a fetch reads).
KVP_POS_SHIFT = 40
KVP_OFF_MASK = (1 << KVP_POS_SHIFT) - 1

# Codec methods a side (K or V) of the store can use.
KVP_RAW, KVP_IBP, KVP_EXPONENT = 0, 1, 2

# The store descriptor: an int64 tensor on the device the kernels read their pointers and codecs from, so that
# growing a table rewrites descriptor entries (stream-ordered) instead of invalidating captured CUDA graphs.
KVP_D_TABLE = 0  # int64 [max_chunks]: base address of each pinned chunk (0: not allocated)
KVP_D_CHUNK_SHIFT = 1  # log2 of the virtual bytes every chunk holds
KVP_D_MAX_CHUNKS = 2  # entries of the chunk table
KVP_D_POS = 3  # int64 [2, slot_cap]: position of the row of (side, slot)
KVP_D_LEN = 4  # int32 [2, slot_cap]: stored bytes of the row of (side, slot)
KVP_D_SLOT_CAP = 5
KVP_D_STATE = 6  # int64 [KVP_STATE_WORDS] on the device
KVP_D_MIRROR = 7  # int64 [KVP_MIRROR_WORDS] in pinned host memory: what the host may read without a sync
KVP_D_SCRATCH = 8  # int64 [scratch_cap]: offsets of one append's rows relative to its base
KVP_D_SCRATCH_CAP = 9
KVP_D_ROW_BYTES = 10
KVP_D_SIDE0 = 16  # the K side's codec fields; the V side's start at KVP_D_SIDE0 + KVP_D_SIDE_WORDS
KVP_D_SIDE_WORDS = 16
KVP_D_WORDS = KVP_D_SIDE0 + 2 * KVP_D_SIDE_WORDS
# codec fields of one side, relative to its start
KVP_S_METHOD, KVP_S_MASK, KVP_S_BITVAL, KVP_S_CHUNK, KVP_S_NCHUNKS = 0, 1, 2, 3, 4
KVP_S_CODE_LEN, KVP_S_CODE_REV, KVP_S_LUT, KVP_S_MAX_BITS = 5, 6, 7, 8
KVP_S_ESHIFT, KVP_S_EMASK, KVP_S_RAW_BITS, KVP_S_ELEMS = 9, 10, 11, 12

# The device state words.
KVP_ST_CURSOR = 0  # virtual offset where the next append starts
KVP_ST_SEQ = 1  # appends placed so far
KVP_ST_BASE = 2  # virtual offset of the last append's first row
KVP_ST_TOTAL = 3  # stored bytes of the last append
KVP_ST_DONE = 4  # blocks of the size kernel finished (the last one places the append and resets it)
KVP_ST_STATUS = 5  # KVP_STATUS_* bits, sticky
KVP_ST_TOKENS = 6  # tokens stored (graph-captured steps read their token position here)
KVP_ST_SLOT0 = 7  # first slot of the last append
KVP_ST_T0 = 8  # first token of the last append
KVP_STATE_WORDS = 16
# The pinned mirror words (written by the size kernel's last block: cursor, then seq after a system fence).
KVP_MR_CURSOR, KVP_MR_SEQ, KVP_MR_STATUS = 0, 1, 2
KVP_MIRROR_WORDS = 4

KVP_STATUS_NO_CHUNK = 1  # a row fell in a chunk the host had not allocated (that row was not written)
KVP_STATUS_CORRUPT = 2  # a fetched exponent-coded row ran past its stored length

__all__ += [name for name in list(globals()) if name.startswith("KVP_")]
