"""The cache index on CPU (Numba twins of hashmap.cu): build, lookup, insert/erase with tombstones, the probe
bound, the direct/hash choice; plus a compile check of hashmap.cu with nvcc."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ibpcache.cache.entry import EMPTY_ENTRY
from ibpcache.cache.hashmap import DirectIndex, HashIndex, NoIndex, hash_capacity, make_index
from ibpcache.errors import CapacityError, InvalidIdsError
from ibpcache.kernels.hashmap import IndexMode

CPU = torch.device("cpu")
_CU = Path(__file__).resolve().parents[2] / "ibpcache" / "kernels" / "hashmap.cu"


def _fmix64(key: int) -> int:
    """Reference murmur3 fmix64 in Python ints."""
    m = (1 << 64) - 1
    h = key & m
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & m
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & m
    h ^= h >> 33
    return h


def test_hash_twin_matches_reference_and_cuda_source() -> None:
    from ibpcache.kernels.hashmap_cpu import hash_key_cpu

    for key in (0, 1, 2, 12345, 2**31 - 1, 2**40 + 7, 2**63 - 1):
        assert int(hash_key_cpu(key)) == _fmix64(key)
    text = _CU.read_text().lower()
    assert "0xff51afd7ed558ccd" in text and "0xc4ceb9fe1a85ec53" in text


@pytest.mark.parametrize("n, cap", [(0, 2), (1, 2), (3, 8), (4, 8), (5, 16), (1000, 2048), (1024, 2048)])
def test_capacity_is_next_pow2_at_half_load(n: int, cap: int) -> None:
    assert hash_capacity(n) == cap


def _entries(ids: torch.Tensor) -> torch.Tensor:
    return ids * 3 + 11  # any distinct non-EMPTY values


def test_build_and_lookup() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(10**6, generator=gen)[:5000]
    idx = HashIndex(5000, CPU)
    idx.build(ids, _entries(ids))
    assert torch.equal(idx.lookup(ids), _entries(ids))
    absent = torch.arange(10**6, 10**6 + 3000)
    assert bool((idx.lookup(absent) == EMPTY_ENTRY).all())
    st = idx.status()
    assert st["kind"] == "hash" and st["capacity"] == 16384 and 1 <= st["longest_probe"] <= idx.max_probes
    # rebuild forgets the old keys
    idx.build(ids[:10], _entries(ids[:10]))
    assert bool((idx.lookup(ids[10:]) == EMPTY_ENTRY).all())


def test_build_rejects_duplicates_negative_keys_and_overflow() -> None:
    idx = HashIndex(8, CPU)
    with pytest.raises(ValueError, match="duplicate"):
        idx.build(torch.tensor([1, 2, 1]), torch.tensor([5, 6, 7]))
    with pytest.raises(InvalidIdsError, match="negative"):
        idx.build(torch.tensor([1, -5]), torch.tensor([5, 6]))
    with pytest.raises(CapacityError, match="cannot hold"):
        idx.build(torch.arange(9), torch.arange(9))


def test_probe_bound_reports_full() -> None:
    """Keys that all hash to one bucket overflow a 1-probe table: the build raises, never loops."""
    idx = HashIndex(8, CPU, max_probes=1)
    mask = idx.capacity - 1
    home = [k for k in range(100000) if _fmix64(k) & mask == 3][:2]
    with pytest.raises(CapacityError, match="max_probes=1"):
        idx.build(torch.tensor(home), torch.tensor([1, 2]))
    idx2 = HashIndex(8, CPU, max_probes=2)
    idx2.build(torch.tensor(home), torch.tensor([1, 2]))  # two probes are enough
    assert idx2.lookup(torch.tensor(home)).tolist() == [1, 2]


def test_insert_erase_tombstones_and_rebuild_signal() -> None:
    idx = HashIndex(64, CPU)
    ids = torch.arange(0, 640, 10)
    idx.build(ids, _entries(ids))
    idx.erase(ids[::2])
    got = idx.lookup(ids)
    assert bool((got[::2] == EMPTY_ENTRY).all()) and torch.equal(got[1::2], _entries(ids[1::2]))
    new = torch.arange(1, 321, 10)  # 32 new keys reuse tombstones or empty buckets
    idx.insert(new, _entries(new))
    assert torch.equal(idx.lookup(new), _entries(new))
    assert torch.equal(idx.lookup(ids[1::2]), _entries(ids[1::2]))
    with pytest.raises(ValueError, match="duplicate"):
        idx.insert(new[:1], _entries(new[:1]))
    # churn until live + tombstones may pass 75% of the buckets
    for r in range(8):
        idx.erase(new)
        new = new + 1000
        idx.insert(new, _entries(new))
    assert idx.wants_rebuild
    idx.build(new, _entries(new))
    assert not idx.wants_rebuild and torch.equal(idx.lookup(new), _entries(new))


def test_erase_of_absent_key_is_tolerated() -> None:
    idx = HashIndex(4, CPU)
    idx.build(torch.tensor([1]), torch.tensor([9]))
    idx.erase(torch.tensor([2]))
    assert idx.lookup(torch.tensor([1])).tolist() == [9]


def test_direct_index() -> None:
    idx = DirectIndex(100, CPU)
    ids = torch.tensor([5, 99, 0])
    idx.build(ids, _entries(ids))
    assert torch.equal(idx.lookup(torch.tensor([0, 5, 99, 7])),
                       torch.tensor([11, 26, 308, EMPTY_ENTRY]))
    idx.erase(torch.tensor([5]))
    assert int(idx.lookup(torch.tensor([5]))) == EMPTY_ENTRY
    assert idx.nbytes == 800 and idx.kernel_args().mode == IndexMode.DIRECT


def test_no_index() -> None:
    idx = NoIndex(CPU)
    assert bool((idx.lookup(torch.arange(5)) == EMPTY_ENTRY).all())
    with pytest.raises(CapacityError, match="capacity zero"):
        idx.build(torch.tensor([1]), torch.tensor([1]))


def test_cpu_twin_lookup_handles_every_mode() -> None:
    from ibpcache.kernels.hashmap_cpu import hashmap_lookup_cpu

    values = np.arange(10, dtype=np.int64) * 7
    out = np.empty(3, dtype=np.int64)
    hashmap_lookup_cpu(np.array([0, 9, 10]), int(IndexMode.DIRECT), np.zeros(0, np.int64), values, 0, out)
    assert out.tolist() == [0, 63, EMPTY_ENTRY]
    hashmap_lookup_cpu(np.array([0, 9, 10]), int(IndexMode.NONE), np.zeros(0, np.int64), values, 0, out)
    assert out.tolist() == [EMPTY_ENTRY] * 3


@pytest.mark.parametrize("n_rows, max_entries, kind", [
    (1000, 0, "none"),
    (1000, 300, "direct"),      # 8 KB dense vs 16 KB hash
    (10**6, 1000, "hash"),      # 8 MB dense vs 32 KB hash
    (10**6, 300_000, "direct"),
])
def test_make_index_picks_the_smaller(n_rows: int, max_entries: int, kind: str) -> None:
    assert make_index(n_rows, max_entries, CPU).status()["kind"] == kind


def test_make_index_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="index kind"):
        make_index(10, 5, CPU, kind="tree")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_hashmap_cu_compiles(arch: str, tmp_path: Path) -> None:
    out = tmp_path / f"hashmap_{arch}.cubin"
    res = subprocess.run(["nvcc", "-std=c++17", "--cubin", f"-arch={arch}", "-o", str(out), str(_CU)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr.lower(), res.stderr
