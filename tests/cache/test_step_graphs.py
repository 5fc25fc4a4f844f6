"""StepGraphs: a step captured on its key's second sight and replayed with new inputs; least recently used graphs
dropped past ``max_graphs``; a capture that fails turns graphs off with the reason, and the caller runs eagerly.
(The embedding bags' use of it is tested in tests/loaders/test_embedding_bag.py.)"""

from __future__ import annotations

import pytest
import torch

from ibpcache.cache.step_graphs import StepGraphs


def test_off_without_cuda() -> None:
    g = StepGraphs(torch.device("cpu"))
    x, out = torch.ones(4), torch.empty(4)
    assert not g.enabled
    assert not g.run(("k",), (x,), out, lambda s, o: o.copy_(s[0]))
    assert g.stats() == {"graphs": 0, "graph_captures": 0, "graph_replays": 0, "graphs_enabled": False,
                         "graph_error": None}


def _double(static: tuple, out: torch.Tensor) -> None:
    torch.mul(static[0], 2, out=out)


@pytest.mark.gpu
def test_capture_on_second_sight_replay_and_eviction() -> None:
    g = StepGraphs(torch.device("cuda"), max_graphs=2)
    out = torch.empty(8, device="cuda")
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    assert not g.run(("a",), (x,), out, _double)  # first sight: the caller runs it
    for k in range(3):
        y = x + k
        assert g.run(("a",), (y,), out, _double)
        assert torch.equal(out, y * 2)
    assert g.captures == 1 and g.replays == 3
    for key in ("b", "c"):  # two more keys: "a" is dropped (max_graphs=2)
        g.run((key,), (x,), out, _double)
        assert g.run((key,), (x,), out, _double)
    assert g.stats()["graphs"] == 2 and g.captures == 3
    assert g.run(("a",), (x + 5,), out, _double)  # "a" was seen: captured again, replayed
    assert torch.equal(out, (x + 5) * 2) and g.captures == 4


@pytest.mark.gpu
def test_a_failed_capture_turns_graphs_off() -> None:
    g = StepGraphs(torch.device("cuda"))
    out = torch.empty(4, device="cuda")
    x = torch.ones(4, device="cuda")

    def fails(static: tuple, o: torch.Tensor) -> None:
        o.copy_(static[0])
        raise KeyError("a step that cannot be captured")

    assert not g.run(("s",), (x,), out, fails)
    assert not g.run(("s",), (x,), out, fails)
    assert not g.enabled and "cannot be captured" in g.error and g.stats()["graphs"] == 0
    assert not g.run(("s",), (x,), out, _double)  # off from now on: the caller runs every step
    torch.cuda.synchronize()  # the device is usable afterwards


@pytest.mark.gpu
def test_a_capture_cuda_invalidates_leaves_torch_random_usable() -> None:
    """A step that syncs cannot be captured: CUDA invalidates the capture and torch raises before it takes its
    default generator out of capture mode. Graphs go off, and the user's CUDA random stream goes on unchanged."""
    g = StepGraphs(torch.device("cuda"))
    out = torch.empty(4, device="cuda")
    x = torch.ones(4, device="cuda")

    def syncs(static: tuple, o: torch.Tensor) -> None:
        o.copy_(static[0] * float(static[0].sum()))  # .item() under capture: the capture is invalidated

    torch.cuda.manual_seed(123)
    expected = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(123)
    assert not g.run(("s",), (x,), out, syncs)
    assert not g.run(("s",), (x,), out, syncs)
    assert not g.enabled and g.error
    assert torch.equal(torch.rand(8, device="cuda"), expected)  # usable, and the same draws as without the capture
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_by_reference_replays_write_each_callers_output() -> None:
    """``by_ref``: the captured kernel reads its output address from ``ref`` when it runs, so every replay writes
    the output tensor passed to it (earlier outputs stay as they were) and no static output exists."""
    import cupy

    kern = cupy.RawKernel(r'''
    extern "C" __global__ void twice(const long long* ref, const float* x, int n) {
        float* out = reinterpret_cast<float*>(ref[0]);
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) out[i] = 2.0f * x[i];
    }''', "twice")

    def body(static: tuple, out: torch.Tensor, ref: torch.Tensor) -> None:
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            kern((1,), (32,), (ref.data_ptr(), static[0].data_ptr(), out.numel()))

    g = StepGraphs(torch.device("cuda"))
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    first = torch.empty(8, device="cuda")
    assert not g.run(("r",), (x,), first, body, by_ref=True)  # first sight: the caller runs it
    outs = []
    for k in range(4):
        out = torch.full((8,), -1.0, device="cuda")
        assert g.run(("r",), (x + k,), out, body, by_ref=True)
        outs.append(out)
    for k, out in enumerate(outs):
        assert torch.equal(out, (x + k) * 2)
    cap = next(iter(g._graphs.values()))
    assert cap.out is None and cap.ref is not None and g.captures == 1 and g.replays == 4
