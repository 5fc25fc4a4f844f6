"""The slab: allocations never exceed the budget, rows pack back to back, slots tile it."""

from __future__ import annotations

import pytest
import torch

from ibpcache.cache.slab import SLAB_ALIGN, Slab, usable_bytes
from ibpcache.errors import CapacityError

CPU = torch.device("cpu")


@pytest.mark.parametrize("budget", [0, 1, 15, 16, 17, 1000, 5733])
def test_allocation_never_exceeds_budget(budget: int) -> None:
    slab = Slab(usable_bytes(budget), budget, CPU)
    assert slab.nbytes <= budget and slab.nbytes % SLAB_ALIGN == 0


def test_pack_is_back_to_back_and_bounded() -> None:
    slab = Slab(96, 100, CPU)
    offsets = slab.pack(torch.tensor([10, 1, 30, 7], dtype=torch.int32))
    assert offsets.tolist() == [0, 10, 11, 41] and slab.used_bytes == 48
    with pytest.raises(CapacityError, match="do not fit"):
        slab.pack(torch.tensor([60, 37], dtype=torch.int32))
    slab.write(10, torch.arange(5, dtype=torch.uint8))
    assert slab.data[10:15].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(CapacityError, match="outside"):
        slab.write(90, torch.zeros(10, dtype=torch.uint8))


def test_slots_tile_the_usable_bytes() -> None:
    slab = Slab(96, 100, CPU)
    view = slab.slots(30)
    assert tuple(view.shape) == (3, 30) and slab.used_bytes == 90 and slab.nbytes == 96


def test_bad_slabs_raise() -> None:
    with pytest.raises(CapacityError, match="budget"):
        Slab(101, 100, CPU)
    with pytest.raises(CapacityError, match="slab id"):
        Slab(0, 0, CPU, slab_id=8)
