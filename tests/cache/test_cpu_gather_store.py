"""InfiniGen's CPU-gather baseline store (ibpcache/cache/cpu_gather_store.py): raw K/V rows in pinned slots.

It shares the append store's bookkeeping interface; these tests check that its rows come back bit for bit through
each read (bulk range, CPU gather, gather into chosen rows), across growth, and that its byte accounting is the raw
size. Real data: SmolLM2 KV rows from the shared folder.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def _raw(dtype: torch.dtype) -> Any:
    from ibpcache.codec import Codec

    return Codec.raw(dtype, (64,))


def test_refuses_cpu_device_and_coded_rows(shared_data_dir: Any) -> None:
    from ibpcache.cache.cpu_gather_store import CpuGatherStore
    from ibpcache.codec import Codec
    from ibpcache.datasets import load_kv

    with pytest.raises(ValueError, match="CUDA"):
        CpuGatherStore(_raw(torch.float16), _raw(torch.float16), torch.device("cpu"))
    rows = load_kv("code", "k", "fp16", shared_data_dir)[:4096]
    ibp = Codec.fit(rows)
    with pytest.raises(ValueError, match="raw"):  # checked before anything touches the device
        CpuGatherStore(ibp, _raw(torch.float16), torch.device("cuda", 0))
    with pytest.raises(ValueError, match="differ"):
        CpuGatherStore(_raw(torch.float16), _raw(torch.float32), torch.device("cuda", 0))


@pytest.mark.gpu
def test_rows_round_trip_through_every_read(shared_data_dir: Any) -> None:
    from ibpcache.cache.cpu_gather_store import CpuGatherStore
    from ibpcache.datasets import load_kv

    k = load_kv("code", "k", "bf16", shared_data_dir, flat=False)[3][:, :300]  # [3, 300, 64] real keys
    v = load_kv("code", "v", "bf16", shared_data_dir, flat=False)[3][:, :300]
    keys, values = k[None].cuda(), v[None].cuda()  # [1, 3, 300, 64]: B = 1, H = 3
    dev = torch.device("cuda", torch.cuda.current_device())
    store = CpuGatherStore(_raw(torch.bfloat16), _raw(torch.bfloat16), dev)
    store.reserve(100 * 3)
    assert store.append(keys[:, :, :100], values[:, :, :100], 0) == 2 * 300 * 128
    store.reserve(300 * 3)  # growth keeps the rows written so far
    store.append(keys[:, :, 100:], values[:, :, 100:], 300)
    torch.cuda.synchronize()
    # token-major slots: slot (t, h) = 3 t + h
    want = [x[0].permute(1, 0, 2).reshape(-1, 64).contiguous().view(torch.uint8) for x in (keys, values)]
    for side in (0, 1):
        out = torch.empty((900, 128), dtype=torch.uint8, device="cuda")
        assert store.read_range(side, 900, out) == 900 * 128
        torch.cuda.synchronize()
        assert torch.equal(out, want[side])
        slots = torch.tensor([899, 0, 5, 5, 451], device="cuda")
        got = torch.empty((5, 128), dtype=torch.uint8, device="cuda")
        assert store.read(side, slots, got, None) == 5 * 128
        torch.cuda.synchronize()
        assert torch.equal(got, want[side][slots])
        into = torch.zeros((8, 128), dtype=torch.uint8, device="cuda")
        store.read(side, slots, into, torch.tensor([7, 1, 2, 3, 4], device="cuda"))
        torch.cuda.synchronize()
        assert torch.equal(into[[7, 1, 2, 3, 4]], want[side][slots]) and not bool(into[[0, 5, 6]].any())
    assert store.stored_bytes(900) == 2 * 900 * 128
    assert store.host_nbytes >= 2 * 900 * 128 and store.device_nbytes == 0
    store.release()
