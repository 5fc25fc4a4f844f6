"""The SM split (CUDA green contexts) the pipelined loader can run its fetch on: bad input, and on a GPU the split's
sets, its streams' kernels and the caller's step on the other SMs."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch

from ibpcache.errors import InvalidArgumentError, UnsupportedError


def test_split_needs_a_cuda_device() -> None:
    from ibpcache.loaders.pipeline import PipelinedLoader
    from ibpcache.loaders.sm_split import split_sms

    with pytest.raises(InvalidArgumentError, match="CUDA device"):
        split_sms("cpu", 8)
    with pytest.raises(InvalidArgumentError, match="not a device"):
        split_sms("gpu:zero", 8)
    with pytest.raises(InvalidArgumentError, match="fetch_sms splits a GPU's SMs"):
        PipelinedLoader([1, 2], device="cpu", fetch_sms=8)
    assert PipelinedLoader([1, 2], device="cpu").step_stream is None


def test_split_without_cuda_python_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from ibpcache.loaders import sm_split

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails as where cuda-python is missing
    with pytest.raises(UnsupportedError, match="cuda-bindings"):
        sm_split._driver()


@pytest.mark.gpu
def test_gpu_split_is_disjoint_cached_and_checked() -> None:
    from ibpcache.loaders.sm_split import split_sms

    total = torch.cuda.get_device_properties(0).multi_processor_count
    split = split_sms(0, 20)
    assert split.fetch_sms >= 20 and split.step_sms >= 1 and split.fetch_sms + split.step_sms <= total
    assert split_sms(torch.device("cuda", 0), 20) is split  # one split per (device, count), kept
    streams = {split.sample_stream.cuda_stream, split.fetch_stream.cuda_stream, split.step_stream.cuda_stream,
               split.capture_stream.cuda_stream}
    assert len(streams) == 4
    for bad in (0, total, True, 2.5):
        with pytest.raises(InvalidArgumentError, match="fetch_sms"):
            split_sms(0, bad)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_gpu_kernels_on_either_side_give_the_bytes_of_the_whole_gpu(cora: Any) -> None:
    """The cache's CuPy kernels (IBP rows, zero-copy misses) and torch's launched on the split's streams compute
    what they compute on the primary context's stream, and an event orders work across the two contexts."""
    from ibpcache.cache import FeatureCache
    from ibpcache.loaders.sm_split import split_sms

    split = split_sms(0, 32)
    rows = cora.features
    fc = FeatureCache(rows, 0.05, device="cuda", codec="auto", compress_cache=True, compress_host=True)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, rows.shape[0], 5000)).cuda()
    want = fc.fetch(ids).clone()
    with torch.cuda.stream(split.fetch_stream):
        got = fc.fetch(ids)
        done = split.fetch_stream.record_event()
    with torch.cuda.stream(split.step_stream):
        split.step_stream.wait_event(done)
        twice = got.view(torch.int32) * 2  # reads the fetch's output on the other SMs
    split.step_stream.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(twice, want.view(torch.int32) * 2)
    assert torch.equal(got.cpu().view(torch.int32), rows[ids.cpu()].view(torch.int32))
