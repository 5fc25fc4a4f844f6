"""Numba twins of the hash table kernels in ``hashmap.cu`` (same probing, same status codes).

The CPU cache (``device="cpu"``) uses these directly, and tests compare them with the CUDA kernels on the
same inputs. All arrays are NumPy int64 (keys/values) or uint8 (valid masks); ``status`` is int32 [2]:
``[worst status code, longest probe sequence used by an insert]``.
"""

from __future__ import annotations

import numba
import numpy as np

from .layout import EMPTY_ENTRY, EMPTY_KEY, TOMBSTONE_KEY
from .hashmap import IndexMode, Status

__all__ = ["hash_key_cpu", "hashmap_insert_cpu", "hashmap_erase_cpu", "hashmap_lookup_cpu"]

INDEX_HASH = int(IndexMode.HASH)
INDEX_DIRECT = int(IndexMode.DIRECT)
_OK = int(Status.OK)
_FULL = int(Status.FULL)
_DUPLICATE = int(Status.DUPLICATE)
_BAD_KEY = int(Status.BAD_KEY)
_NOT_FOUND = int(Status.NOT_FOUND)
_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


@numba.njit(cache=True, inline="always")
def hash_key_cpu(key: int) -> np.uint64:
    """murmur3 fmix64 of a non-negative key, identical to ``ibp_hash_key`` in hashmap.cu."""
    h = np.uint64(key)
    h ^= h >> _S33
    h *= _C1
    h ^= h >> _S33
    h *= _C2
    h ^= h >> _S33
    return h


@numba.njit(cache=True)
def hashmap_insert_cpu(keys, values, valid, table_keys, table_values, max_probes, status):
    """Insert ``keys[i] -> values[i]`` where ``valid`` is empty or ``valid[i] != 0``; reuses tombstones."""
    mask = np.uint64(table_keys.shape[0] - 1)
    use_valid = valid.shape[0] > 0
    for i in range(keys.shape[0]):
        if use_valid and valid[i] == 0:
            continue
        key = keys[i]
        if key < 0:
            status[0] = max(status[0], _BAD_KEY)
            continue
        slot = hash_key_cpu(key) & mask
        code = _FULL
        for p in range(max_probes):
            cur = table_keys[slot]
            if cur == key:
                code = _DUPLICATE
                break
            if cur == EMPTY_KEY or cur == TOMBSTONE_KEY:
                table_keys[slot] = key
                table_values[slot] = values[i]
                status[1] = max(status[1], p + 1)
                code = _OK
                break
            slot = (slot + np.uint64(1)) & mask
        if code != _OK:
            status[0] = max(status[0], code)


@numba.njit(cache=True)
def hashmap_erase_cpu(keys, valid, table_keys, table_values, max_probes, status):
    """Turn the buckets of ``keys`` into tombstones; report NOT_FOUND for keys that are absent."""
    mask = np.uint64(table_keys.shape[0] - 1)
    use_valid = valid.shape[0] > 0
    for i in range(keys.shape[0]):
        if use_valid and valid[i] == 0:
            continue
        key = keys[i]
        code = _NOT_FOUND
        if key < 0:
            code = _BAD_KEY
        else:
            slot = hash_key_cpu(key) & mask
            for _ in range(max_probes):
                cur = table_keys[slot]
                if cur == key:
                    table_values[slot] = EMPTY_ENTRY
                    table_keys[slot] = TOMBSTONE_KEY
                    code = _OK
                    break
                if cur == EMPTY_KEY:
                    break
                slot = (slot + np.uint64(1)) & mask
        if code != _OK:
            status[0] = max(status[0], code)


@numba.njit(cache=True)
def hashmap_lookup_cpu(ids, mode, table_keys, table_values, max_probes, entries_out):
    """``entries_out[i]`` = entry of ``ids[i]`` or EMPTY_ENTRY; ``mode`` is an IndexMode value."""
    n_values = table_values.shape[0]
    if mode == INDEX_HASH:
        mask = np.uint64(table_keys.shape[0] - 1)
    for i in range(ids.shape[0]):
        key = ids[i]
        found = EMPTY_ENTRY
        if mode == INDEX_DIRECT:
            if 0 <= key < n_values:
                found = table_values[key]
        elif mode == INDEX_HASH:
            slot = hash_key_cpu(key) & mask
            for _ in range(max_probes):
                cur = table_keys[slot]
                if cur == key:
                    found = table_values[slot]
                    break
                if cur == EMPTY_KEY:
                    break
                slot = (slot + np.uint64(1)) & mask
        entries_out[i] = found
