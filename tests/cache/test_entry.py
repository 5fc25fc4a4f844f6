"""The 64-bit cache entry: every field round-trips at its limits, in Python ints and torch tensors, and the
constants in hashmap.cu match entry.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ibpcache.cache import entry as E
from ibpcache.errors import CapacityError

LIMITS = [
    # offset, slab, compressed, length
    (0, 0, False, 1),
    (0, 0, True, E.MAX_ROW_LENGTH),
    (E.MAX_SLAB_BYTES - 1, E.MAX_SLABS - 1, True, 1),
    (E.MAX_SLAB_BYTES - E.MAX_ROW_LENGTH, E.MAX_SLABS - 1, True, E.MAX_ROW_LENGTH),
    (E.MAX_SLAB_BYTES - (1 << 19), 5, False, 1 << 19),  # length in the sign bit
    (123456789, 3, True, (1 << 19) - 1),
    (1 << 39, 1, False, 5732),
]


def test_layout_is_the_papers() -> None:
    assert (E.OFFSET_SHIFT, E.OFFSET_BITS) == (0, 40)
    assert (E.SLAB_SHIFT, E.SLAB_BITS, E.MAX_SLABS) == (40, 3, 8)
    assert E.COMPRESSED_SHIFT == 43
    assert (E.LENGTH_SHIFT, E.LENGTH_BITS, E.MAX_ROW_LENGTH) == (44, 20, 2**20 - 1)
    assert E.LENGTH_SHIFT + E.LENGTH_BITS == 64


@pytest.mark.parametrize("fields", LIMITS)
def test_python_round_trip_at_limits(fields: tuple[int, int, bool, int]) -> None:
    value = E.pack_entry(*fields)
    assert -(2**63) <= value < 2**63
    assert value != E.EMPTY_ENTRY
    assert tuple(E.unpack_entry(value)) == fields


def test_tensor_round_trip_matches_python() -> None:
    off = torch.tensor([f[0] for f in LIMITS], dtype=torch.int64)
    slab = torch.tensor([f[1] for f in LIMITS], dtype=torch.int64)
    comp = torch.tensor([f[2] for f in LIMITS], dtype=torch.bool)
    length = torch.tensor([f[3] for f in LIMITS], dtype=torch.int32)
    packed = E.pack_entries(off, length, comp, slab)
    assert packed.tolist() == [E.pack_entry(*f) for f in LIMITS]
    assert torch.equal(E.entry_offsets(packed), off)
    assert torch.equal(E.entry_slab_ids(packed), slab)
    assert torch.equal(E.entry_compressed(packed), comp.to(torch.uint8))
    assert torch.equal(E.entry_lengths(packed), length)


def test_round_trip_property() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.given(st.integers(1, E.MAX_ROW_LENGTH), st.integers(0, 7), st.booleans(), st.data())
    @hypothesis.settings(max_examples=300)
    def check(length: int, slab: int, comp: bool, data: object) -> None:
        off = data.draw(st.integers(0, E.MAX_SLAB_BYTES - length))  # type: ignore[attr-defined]
        v = E.pack_entry(off, slab, comp, length)
        assert tuple(E.unpack_entry(v)) == (off, slab, comp, length)
        t = E.pack_entries(torch.tensor([off]), torch.tensor([length]), torch.tensor([comp]), slab)
        assert int(t) == v

    check()


@pytest.mark.parametrize("fields, match", [
    ((0, 0, False, E.MAX_ROW_LENGTH + 1), "2\\*\\*20 - 1"),
    ((0, 0, False, 0), ">= 1"),
    ((0, 8, False, 1), "slab id"),
    ((-1, 0, False, 1), "40-bit"),
    ((E.MAX_SLAB_BYTES - 1, 0, False, 2), "40-bit"),
])
def test_out_of_range_fields_raise(fields: tuple[int, int, bool, int], match: str) -> None:
    with pytest.raises(CapacityError, match=match):
        E.pack_entry(*fields)


def test_tensor_out_of_range_raises() -> None:
    with pytest.raises(CapacityError, match="2\\*\\*20 - 1"):
        E.pack_entries(torch.tensor([0]), torch.tensor([2**20]), torch.tensor([True]))
    with pytest.raises(CapacityError, match="40-bit"):
        E.pack_entries(torch.tensor([E.MAX_SLAB_BYTES - 4]), torch.tensor([8]), torch.tensor([False]))
    with pytest.raises(CapacityError, match="slab ids"):
        E.pack_entries(torch.tensor([0]), torch.tensor([8]), torch.tensor([False]), 9)


def test_empty_sentinel_cannot_be_unpacked() -> None:
    with pytest.raises(ValueError, match="EMPTY_ENTRY"):
        E.unpack_entry(E.EMPTY_ENTRY)
    # all-ones would be a 1 MiB row at the very end of the 1 TB address space: pack_entry refuses it
    with pytest.raises(CapacityError):
        E.pack_entry(E.OFFSET_MASK, 7, True, E.MAX_ROW_LENGTH)


def _cu_defines() -> dict[str, int]:
    text = (Path(__file__).resolve().parents[2] / "ibpcache" / "kernels" / "hashmap.cu").read_text()
    out = {}
    for name, value in re.findall(r"^#define\s+(IBP_\w+)\s+\(?(-?\d+)(?:LL)?\)?\s*$", text, flags=re.M):
        out[name] = int(value)
    return out


def test_cuda_constants_match_python() -> None:
    from ibpcache.cache.stats import Counter
    from ibpcache.kernels.hashmap import IndexMode, Status

    d = _cu_defines()
    assert d["IBP_ENTRY_OFFSET_BITS"] == E.OFFSET_BITS
    assert d["IBP_ENTRY_SLAB_SHIFT"] == E.SLAB_SHIFT
    assert d["IBP_ENTRY_SLAB_BITS"] == E.SLAB_BITS
    assert d["IBP_ENTRY_COMPRESSED_SHIFT"] == E.COMPRESSED_SHIFT
    assert d["IBP_ENTRY_LENGTH_SHIFT"] == E.LENGTH_SHIFT
    assert d["IBP_ENTRY_LENGTH_BITS"] == E.LENGTH_BITS
    assert d["IBP_EMPTY_ENTRY"] == E.EMPTY_ENTRY
    assert d["IBP_EMPTY_KEY"] == E.EMPTY_KEY
    assert d["IBP_TOMBSTONE_KEY"] == E.TOMBSTONE_KEY
    for c in Counter:
        assert d[f"IBP_COUNTER_{c.name}"] == int(c)
    assert d["IBP_N_COUNTERS"] == len(Counter)
    for s in Status:
        assert d[f"IBP_STATUS_{s.name}"] == int(s)
    for m in IndexMode:
        assert d[f"IBP_INDEX_{m.name}"] == int(m)
