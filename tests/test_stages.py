"""ibpcache.testing.stages: device activity, copies and blocking calls go to the stage window they start in; busy
time is a union (overlapping kernels count once); a real profile finds the windows (CPU here, kernels on a GPU)."""

from __future__ import annotations

import time
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpcache.errors import StateError
from ibpcache.testing.stages import WINDOW_PREFIX, StageProfile, stage_busy, union_length

def _ev(name: str, start: float, end: float, device: bool = False, activity: str = "") -> tuple:
    return (name, device, float(start), float(end), activity)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), max_size=12))
def test_union_length_counts_every_covered_point_once(spans: list[tuple[int, int]]) -> None:
    intervals = [(a, a + n) for a, n in spans]
    covered = {t for a, b in intervals for t in range(a, b)}
    assert union_length(intervals) == len(covered)


def test_activity_goes_to_the_window_it_starts_in() -> None:
    events = [
        _ev(WINDOW_PREFIX + "sample", 0, 1000, activity="user_annotation"), _ev(WINDOW_PREFIX + "train", 2000, 5000),
        _ev(WINDOW_PREFIX + "sample", 6000, 7000),
        _ev(WINDOW_PREFIX + "sample", 10, 990, True, "gpu_user_annotation"),  # the range's GPU span: not work
        _ev("void hop_kernel", 100, 400, True, "kernel"), _ev("void floyd", 300, 600, True),  # overlap: 500 us busy
        _ev("Memcpy HtoD (Pinned -> Device)", 700, 800, True, "gpu_memcpy"),
        _ev("cudaStreamSynchronize", 600, 900), _ev("cudaLaunchKernel", 90, 95),
        _ev("sgemm", 2100, 4100, True, "kernel"), _ev("cudaDeviceSynchronize", 4000, 4990),
        _ev("Memset (Device)", 4100, 4150, True, "gpu_memset"), _ev("sync marker", 4150, 4900, True, "cuda_sync"),
        _ev("void gather", 6100, 6200, True, "kernel"), _ev("cudaMemcpyAsync", 6200, 6300),
        _ev("void stray", 1500, 1600, True, "kernel"),  # outside every window: nobody's
    ]
    got = stage_busy(events)
    assert set(got) == {"sample", "train"}
    s, t = got["sample"], got["train"]
    assert (s.windows, t.windows) == (2, 1)
    assert s.wall_ms == pytest.approx(2.0) and t.wall_ms == pytest.approx(3.0)
    assert s.kernel_ms == pytest.approx(0.6) and s.copy_ms == pytest.approx(0.1)
    assert s.wait_ms == pytest.approx(0.4) and t.wait_ms == pytest.approx(0.99)
    assert t.kernel_ms == pytest.approx(2.05) and t.copy_ms == 0.0
    assert t.host_ms(10.0) == pytest.approx(9.01) and t.host_ms(0.5) == 0.0


def test_a_real_profile_finds_the_windows() -> None:
    with pytest.raises(StateError):
        with StageProfile("cpu").stage("x"):
            pass
    prof = StageProfile("cpu")
    with prof:
        for _ in range(2):
            with prof.stage("work"):
                torch.randn(64, 64) @ torch.randn(64, 64)
            with prof.stage("idle"):
                time.sleep(0.005)
    got = prof.result()
    assert got["work"].windows == 2 and got["idle"].windows == 2
    assert got["idle"].wall_ms >= 10.0 * 0.9
    assert got["work"].kernel_ms == 0.0 and got["work"].wait_ms == 0.0  # no GPU here


@pytest.mark.gpu
def test_gpu_kernels_and_syncs_are_seen() -> None:
    a = torch.randn(2048, 2048, device="cuda")
    prof = StageProfile("cuda")
    with prof:
        with prof.stage("matmul"):
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
        with prof.stage("host"):
            time.sleep(0.01)
            float(a.sum())
    got = prof.result()
    assert got["matmul"].kernel_ms > 0.1 and got["matmul"].wait_ms > 0.0
    assert got["host"].kernel_ms < 0.5 * got["host"].wall_ms  # mostly sleep


def test_spans_come_from_raw_events_or_from_the_public_list() -> None:
    from torch.profiler import ProfilerActivity, profile

    from ibpcache.testing.stages import profile_spans

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(WINDOW_PREFIX + "x"):
            torch.randn(8) + 1
    raw = profile_spans(prof)
    public = profile_spans(type("P", (), {"events": prof.events})())  # no kineto_results: the public list
    for spans in (raw, public):
        window = [s for s in spans if s[0] == WINDOW_PREFIX + "x"]
        assert len(window) == 1 and window[0][3] > window[0][2] and not window[0][1]
        assert any(s[0] == "aten::randn" for s in spans)
    assert stage_busy(raw)["x"].windows == stage_busy(public)["x"].windows == 1


def test_all_threads_profile_and_thread_summary_count_each_threads_ops() -> None:
    """A thread started before the profile is recorded too (a loader's sampler and fetch threads are), its host
    time and top ops apart from the starting thread's; nested ops are not counted twice in host_ms."""
    import threading

    from ibpcache.testing.stages import all_threads_profile, thread_summary

    x = torch.randn(64, 64)
    go, done = threading.Event(), threading.Event()

    def other() -> None:
        go.wait()
        for _ in range(20):
            torch.mm(x, x)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with all_threads_profile(cuda=False) as prof:
        go.set()
        for _ in range(30):
            torch.add(x, x)
        done.wait(30)
    t.join()
    s = thread_summary(prof.events())
    tops = {tid: {op["name"]: op["count"] for op in th["top_ops"]} for tid, th in s["threads"].items()}
    mine = [tid for tid, ops in tops.items() if ops.get("aten::add") == 30]
    theirs = [tid for tid, ops in tops.items() if ops.get("aten::mm") == 20]
    assert len(mine) == 1 and len(theirs) == 1 and mine != theirs
    for th in s["threads"].values():
        assert th["host_ms"] > 0 and th["launches"] == 0 and th["wait_ms"] == 0
    assert s["threads"][theirs[0]]["ops"] == 20  # mm's nested calls are inside its one top-level op
    counts = {op["name"]: op["count"] for op in s["top_ops"]}
    assert counts["aten::mm"] == 20 and counts["aten::add"] == 30
