"""Codec on the GPU: same bytes as the CPU golden vectors, same fit, lossless fused gather.

Skipped (with a reason) where no GPU exists; scripts/gpu_check.sh runs them with IBPCACHE_REQUIRE_GPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ibpcache import Codec, InvalidIdsError
from test_codec import SPECIAL_F32, assert_bit_equal, golden_files, load_golden, raw, row_tensors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", golden_files(), ids=lambda p: p.stem)
def test_gpu_encoder_matches_golden_bytes(path) -> None:
    codec, x, g = load_golden(path)
    layout = "packed" if path.stem.endswith("packed") else "inplace"
    p = codec.compress(x.cuda(), layout=layout)
    assert np.array_equal(p.lengths.numpy(), g["lengths"])
    assert np.array_equal(p.data.numpy(), g["data"])
    # host rows streamed through the GPU give the same bytes
    q = codec.compress(x, layout=layout, device="cuda")
    assert np.array_equal(q.data.numpy(), g["data"])
    assert_bit_equal(p.decompress(device="cuda").cpu(), x)
    ids = torch.randint(0, x.shape[0], (333,), device="cuda")
    assert_bit_equal(p.gather(ids, device="cuda").cpu(), x[ids.cpu()])


@pytest.mark.parametrize("name", ["cora", "pubmed", "minilm", "kv_chat_k_bf16", "kv_code_v_fp16"])
def test_gpu_fit_equals_cpu_fit_and_round_trips(real_rows, name: str) -> None:
    x = real_rows(name)
    cpu_codec = Codec.fit(x)
    gpu_codec = Codec.fit(x.cuda())
    assert gpu_codec.same_tables(cpu_codec) and gpu_codec.threshold == cpu_codec.threshold
    assert gpu_codec.scores == cpu_codec.scores
    both = Codec.fit_many([x.cuda(), x[: x.shape[0] // 2].cuda()])  # batched: two syncs for both codecs
    assert both[0].same_tables(cpu_codec) and both[0].scores == cpu_codec.scores
    assert both[1].same_tables(Codec.fit(x[: x.shape[0] // 2]))
    p = gpu_codec.compress(x.cuda())
    assert np.array_equal(p.data.numpy(), cpu_codec.compress(x, pin=False).data.numpy())
    ids = torch.randint(0, x.shape[0], (100_000,), device="cuda")
    y = p.gather(ids, device="cuda")
    assert_bit_equal(y, x.cuda()[ids])
    assert_bit_equal(p.decompress(device="cuda"), x.cuda())


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(x=row_tensors(), c=st.sampled_from([1, 2, 4, 8]), layout=st.sampled_from(["inplace", "packed"]))
def test_gpu_round_trip_property(x: torch.Tensor, c: int, layout: str) -> None:
    codec = Codec.fit(x, chunk_bytes=c)
    gpu = codec.compress(x.cuda(), layout=layout)
    cpu = codec.compress(x, layout=layout, pin=False)
    assert torch.equal(gpu.data, cpu.data) and torch.equal(gpu.lengths, cpu.lengths)
    ids = torch.randint(0, x.shape[0], (50,), device="cuda")
    assert_bit_equal(gpu.gather(ids, device="cuda").cpu(), x[ids.cpu()])


def test_descriptor_decode_mixes_device_and_host_sources(real_rows) -> None:
    from ibpcache.kernels.bitpack import decode_descriptors

    x = real_rows("cora")[:500]
    codec = Codec.fit(x)
    host = codec.compress(x, layout="packed")
    dev_data = host.data.cuda()
    ids = torch.randint(0, 500, (2000,))
    on_dev = torch.rand(2000) < 0.5
    base = torch.where(on_dev, torch.full((2000,), dev_data.data_ptr()), torch.full((2000,), host.data.data_ptr()))
    src = (base + host.offsets[ids]).cuda()
    out = torch.full((2000, codec.row_bytes), 0xAB, dtype=torch.uint8, device="cuda")
    perm = torch.randperm(2000).cuda()
    decode_descriptors(out, src, host.lengths[ids].cuda(), host.is_compressed()[ids].cuda(), perm,
                       codec.kernel_tables("cuda"))
    expect = torch.empty_like(out)
    expect[perm] = raw(x)[ids].reshape(2000, -1).cuda()
    assert torch.equal(out, expect)


def test_encode_into_pinned_host_without_sync(real_rows) -> None:
    from ibpcache.kernels.bitpack import encode_into

    x = real_rows("kv_chat_v_bf16")[:4096]
    codec = Codec.fit(x)
    rows = raw(x).reshape(4096, -1).cuda()
    slots = torch.zeros(4096 * codec.row_bytes, dtype=torch.uint8, pin_memory=True)
    ptrs = torch.arange(4096, device="cuda") * codec.row_bytes + slots.data_ptr()
    lengths = torch.empty(4096, dtype=torch.int32, device="cuda")
    encode_into(rows, ptrs, lengths, codec.kernel_tables("cuda"))
    torch.cuda.synchronize()
    ref = codec.compress(x, pin=False)
    assert torch.equal(lengths.cpu(), ref.lengths)
    assert torch.equal(slots, ref.data)


def test_gpu_bad_ids_and_edge_cases() -> None:
    x = torch.randn(64, 10)
    p = Codec.fit(x).compress(x)
    with pytest.raises(InvalidIdsError):
        p.gather(torch.tensor([0, 64], device="cuda"), device="cuda")
    with pytest.raises(InvalidIdsError):
        p.gather(torch.tensor([-3], device="cuda"), device="cuda")
    assert p.gather(torch.tensor([], dtype=torch.int64, device="cuda"), device="cuda").shape == (0, 10)
    out = torch.empty(3, 10, device="cuda")
    assert p.gather(torch.tensor([5, 5, 1], device="cuda"), device="cuda", out=out) is out
    assert_bit_equal(out.cpu(), x[[5, 5, 1]])


def test_gather_raw_baseline_is_exact(real_rows) -> None:
    from ibpcache.kernels.bitpack import gather_raw

    x = real_rows("pubmed")
    flat = raw(x).reshape(-1).pin_memory()
    ids = torch.randint(0, x.shape[0], (5000,), device="cuda")
    out = torch.empty(5000, x.shape[1] * 4, dtype=torch.uint8, device="cuda")
    gather_raw(flat, ids, out, x.shape[0])
    assert torch.equal(out, raw(x).reshape(x.shape[0], -1).cuda()[ids])
