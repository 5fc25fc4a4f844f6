"""Split a GPU's multiprocessors between the feature fetch and the training step (CUDA green contexts).

Why: a pipelined GNN epoch whose fetch and training step both run on the GPU is bounded by the two stages' GPU time
summed, not by the slower one, because their kernels do not run at the same time: a training kernel's blocks fill
the SMs, and the fetch's blocks (or the step's) wait for them to leave; a bounded fetch grid does not change that.
Giving each stage its own SMs does. Measured on one H200 (132 SMs) with ``scripts/experiments/fetch_sm_partition.py``
(docs/results/2026-11-28-h200-s46): the fetch on 32 SMs kept its full throughput (68.6-73.4 vs 71.0-73.1 GB/s of
rows out on the whole GPU), a stand-in matmul step on the other 100 ran 1.46x slower alone, and the two together
took 10.7-11.7 ms against 12.6-12.8 ms in turn on the whole GPU. Whether a real epoch gains depends on which stage
holds the GPU: in ``train_gnn.py`` (GraphSAGE, same results folder) ``fetch_sms`` 32 or 48 shortened MiniLM-SU's
epochs (dense rows, the fetch 46 of 69 GPU ms: 59-70 vs 71-76 ms) and lengthened Cora-SU's (the step 41 of 64 GPU
ms, now on fewer SMs: 74-77 vs 65-71 ms); 24 SMs was slower on both. Measure before setting it.

A green context is a context of the device restricted to a set of SMs; kernels launched on a stream of it run only
there, whatever library launches them (CuPy's raw kernels, torch, cuBLAS). The driver's API splits the SMs once into
disjoint sets (rounded up to its granularity: 8 SMs on Hopper), so the two contexts never share one. Kernels launched
on the primary context's streams still use every SM, so both stages must run on the split's streams. A captured
kernel node keeps the context it was captured in (``CUDA_KERNEL_NODE_PARAMS.ctx``), so capture a step on
:attr:`SmSplit.capture_stream` for its replays to run on the step's SMs.

Memory is the primary context's: tensors move freely between the split's streams and any other, with the usual
stream semantics (events, ``wait_stream``, ``record_stream``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from ..errors import DeviceError, InvalidArgumentError, UnsupportedError

__all__ = ["SmSplit", "split_sms"]

#: stream priority of the fetch side: its kernels are short and the step waits for them (the driver clamps it into
#: the device's range)
_FETCH_PRIORITY = -1


@dataclasses.dataclass(frozen=True)
class SmSplit:
    """Streams on two disjoint sets of one GPU's SMs.

    Attributes:
        device: the GPU.
        fetch_sms / step_sms: the SMs each side was granted.
        sample_stream / fetch_stream: two streams (high priority) on the fetch side's SMs: the sampler's kernels and
            the feature fetch.
        step_stream: a stream on the other SMs, for the training step.
        capture_stream: a second stream there, to capture CUDA graphs that replay on ``step_stream``.
    """

    device: torch.device
    fetch_sms: int
    step_sms: int
    sample_stream: Any
    fetch_stream: Any
    step_stream: Any
    capture_stream: Any
    handles: tuple = dataclasses.field(repr=False, compare=False, default=())  # contexts and streams, kept alive


_SPLITS: "dict[tuple[int, int], SmSplit]" = {}
_LOCK = threading.Lock()


def split_sms(device: "str | torch.device | int", fetch_sms: int) -> SmSplit:
    """The SMs of ``device`` split into ``fetch_sms`` (rounded up by the driver) for the fetch side and the rest for
    the step. Made once per (device, ``fetch_sms``) and kept for the process: the caching allocator keeps blocks
    tagged with the streams, so they must outlive every tensor used on them.

    Raises:
        InvalidArgumentError: ``device`` is not a CUDA device, or ``fetch_sms`` is not an int in [1, SMs - 1] or
            leaves no SM for the step once rounded.
        UnsupportedError: cuda-python (``cuda-bindings``), which the split is made with, is not installed.
        DeviceError: the driver refused the split (e.g. a GPU or driver without green contexts: CUDA 12.4+).
    """
    dev = _cuda_device(device)
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    if not isinstance(fetch_sms, int) or isinstance(fetch_sms, bool) or not 1 <= fetch_sms < total:
        raise InvalidArgumentError(f"split_sms: fetch_sms must be an int in [1, {total - 1}] ({dev} has {total} SMs), "
                                   f"got {fetch_sms!r}")
    key = (dev.index, fetch_sms)
    with _LOCK:
        if key not in _SPLITS:
            _SPLITS[key] = _make(dev, fetch_sms)
        return _SPLITS[key]


def _cuda_device(device: "str | torch.device | int") -> torch.device:
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"split_sms: not a device: {device!r}") from exc
    if dev.type != "cuda":
        raise InvalidArgumentError(f"split_sms: SMs are split on a CUDA device, got {dev}")
    if not torch.cuda.is_available():
        raise InvalidArgumentError(f"split_sms: {dev}: CUDA is not available here")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise UnsupportedError("split_sms: needs cuda-python's driver bindings (pip install cuda-bindings, the "
                               "version matching torch's CUDA major)") from exc
    return driver


def _make(dev: torch.device, fetch_sms: int) -> SmSplit:
    drv = _driver()

    def ok(call: str, ret: Any) -> Any:
        err, *out = ret if isinstance(ret, tuple) else (ret,)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise DeviceError(f"split_sms: {call} failed on {dev}: {err}")
        return out[0] if len(out) == 1 else out

    torch.cuda.init()  # the primary context exists before green contexts are made from its device
    ok("cuInit", drv.cuInit(0))
    cu_dev = ok("cuDeviceGet", drv.cuDeviceGet(dev.index))
    whole = ok("cuDeviceGetDevResource",
               drv.cuDeviceGetDevResource(cu_dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, rest = ok("cuDevSmResourceSplitByCount", drv.cuDevSmResourceSplitByCount(1, whole, 0, fetch_sms))
    granted = (int(groups[0].sm.smCount), int(rest.sm.smCount))
    if granted[1] < 1:
        raise InvalidArgumentError(f"split_sms: fetch_sms={fetch_sms} was rounded to {granted[0]} SMs, leaving none "
                                   f"of {dev}'s for the step")
    handles: list[Any] = []
    streams: list[Any] = []
    for res, priorities in ((groups[0], (_FETCH_PRIORITY, _FETCH_PRIORITY)), (rest, (0, 0))):
        desc = ok("cuDevResourceGenerateDesc", drv.cuDevResourceGenerateDesc([res], 1))
        ctx = ok("cuGreenCtxCreate",
                 drv.cuGreenCtxCreate(desc, cu_dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        handles.append(ctx)
        for priority in priorities:
            raw = ok("cuGreenCtxStreamCreate",
                     drv.cuGreenCtxStreamCreate(ctx, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, priority))
            handles.append(raw)
            streams.append(torch.cuda.ExternalStream(int(raw), device=dev))
    return SmSplit(dev, granted[0], granted[1], *streams, handles=tuple(handles))
