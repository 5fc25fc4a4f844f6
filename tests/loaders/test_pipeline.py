"""PipelinedLoader: the loader's batches in the loader's order, stages overlapped, errors where they happened, threads
gone when the caller stops; on a GPU, batches fetched on a side stream are complete and stay intact while in use.

(The DGL and PyG adapters' pipelined loaders on real Cora are tested in test_dgl.py and test_pyg.py.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ibpcache.errors import InvalidArgumentError


class _Epochs:
    """A re-iterable loader that records the thread each iter() and next() ran in."""

    def __init__(self, n: int, sleep: float = 0.0, fail_at: int | None = None) -> None:
        self.n, self.sleep, self.fail_at = n, sleep, fail_at
        self.iter_threads: list[int] = []
        self.next_threads: set[int] = set()

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        self.iter_threads.append(threading.get_ident())
        return self._items()

    def _items(self) -> Any:
        for i in range(self.n):
            self.next_threads.add(threading.get_ident())
            if self.sleep:
                time.sleep(self.sleep)
            if i == self.fail_at:
                raise KeyError(f"sample {i}")
            yield i


def _stage_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ibpcache-")]


@pytest.mark.parametrize("fetch_thread", [True, False])
def test_order_content_and_threads(fetch_thread: bool) -> None:
    from ibpcache.loaders.pipeline import PipelinedLoader

    src = _Epochs(25)
    fetched_in: set[int] = set()

    def fetch(i: int) -> tuple[int, int]:
        fetched_in.add(threading.get_ident())
        return i, i * i

    loader = PipelinedLoader(src, fetch, prefetch=1, sample_ahead=1, fetch_thread=fetch_thread)
    assert len(loader) == 25
    for _epoch in range(2):  # re-iterable: one pass per epoch
        assert list(loader) == [(i, i * i) for i in range(25)]
    me = threading.get_ident()
    assert src.iter_threads == [me, me]  # iter() in the caller's thread (where a loader forks its workers)
    assert me not in src.next_threads  # next() in the sampler thread
    assert (me in fetched_in) == (not fetch_thread)
    assert _stage_threads() == []


def test_stages_overlap_in_threads() -> None:
    """Sampling, fetching and the caller's step each take 30 ms (sleeping releases the GIL, as torch ops and the
    cache's Numba passes do): 12 batches take about 12 x 30 ms pipelined instead of 12 x 90 ms."""
    from ibpcache.loaders.pipeline import PipelinedLoader

    def fetch(i: int) -> int:
        time.sleep(0.03)
        return i

    def run(loader: Any) -> float:
        t0 = time.perf_counter()
        for _ in loader:
            time.sleep(0.03)
        return time.perf_counter() - t0

    serial = run(fetch(i) for i in _Epochs(12, sleep=0.03))
    piped = run(PipelinedLoader(_Epochs(12, sleep=0.03), fetch))
    assert serial > 12 * 0.09
    assert piped < 0.6 * serial, (piped, serial)


@pytest.mark.parametrize("fetch_thread", [True, False])
@pytest.mark.parametrize("slow", ["sample", "fetch", "caller"])
def test_stage_clock_names_the_stage_that_holds_the_pipeline_back(fetch_thread: bool, slow: str) -> None:
    """One stage sleeps 20 ms a batch, the others nothing: the clock puts that time in the slow stage's busy field,
    makes the stages after it starved and the stages before it blocked."""
    from ibpcache.loaders.pipeline import PipelinedLoader, StageClock

    n, nap = 10, 0.02

    def fetch(i: int) -> int:
        if slow == "fetch":
            time.sleep(nap)
        return i

    loader = PipelinedLoader(_Epochs(n, sleep=nap if slow == "sample" else 0.0), fetch, fetch_thread=fetch_thread)
    assert loader.clock == StageClock()
    list(loader)  # an epoch before the span read below: the clock sums over iterations
    before = loader.clock.snapshot()
    for _ in loader:
        if slow == "caller":
            time.sleep(nap)
    c = loader.clock.since(before)
    total = n * nap
    assert min(c.sample_busy, c.sample_blocked, c.fetch_starved, c.fetch_busy, c.fetch_blocked) >= 0.0
    if slow == "sample":
        assert c.sample_busy >= 0.9 * total and c.fetch_starved >= 0.6 * total
        assert c.sample_blocked < 0.3 * total and c.fetch_busy < 0.3 * total
    elif slow == "fetch":
        assert c.fetch_busy >= 0.9 * total and c.sample_blocked >= 0.6 * total
        assert c.sample_busy < 0.3 * total and c.fetch_starved < 0.3 * total
    else:
        assert c.sample_busy < 0.3 * total and c.fetch_busy < 0.3 * total
        if fetch_thread:  # the fetch thread waits for the caller; without it the caller fetches for itself
            assert c.fetch_blocked >= 0.6 * total
        else:
            assert c.sample_blocked >= 0.6 * total
    if not fetch_thread:
        assert c.fetch_blocked == 0.0


@pytest.mark.parametrize("fetch_thread", [True, False])
@pytest.mark.parametrize("where", ["sample", "fetch"])
def test_errors_reach_the_caller_at_their_batch(fetch_thread: bool, where: str) -> None:
    from ibpcache.loaders.pipeline import PipelinedLoader

    def fetch(i: int) -> int:
        if where == "fetch" and i == 4:
            raise ValueError("fetch 4")
        return i

    loader = PipelinedLoader(_Epochs(10, fail_at=4 if where == "sample" else None), fetch,
                             fetch_thread=fetch_thread)
    got = []
    with pytest.raises((KeyError, ValueError), match=f"{where} 4"):
        for i in loader:
            got.append(i)
    assert got == [0, 1, 2, 3]  # every batch before the failing one, also when the caller fetches one ahead
    assert _stage_threads() == []


def test_stopping_early_ends_the_stages() -> None:
    from ibpcache.loaders.pipeline import PipelinedLoader

    loader = PipelinedLoader(_Epochs(1000), lambda i: i, prefetch=2, sample_ahead=2)
    for i in loader:
        if i == 3:
            break
    deadline = time.time() + 5
    while _stage_threads() and time.time() < deadline:
        time.sleep(0.01)
    assert _stage_threads() == []
    assert list(loader)[:5] == [0, 1, 2, 3, 4]  # and the next epoch starts from the beginning


def test_arguments_are_checked() -> None:
    from ibpcache.loaders.pipeline import PipelinedLoader

    with pytest.raises(InvalidArgumentError, match="prefetch"):
        PipelinedLoader([1], prefetch=0)
    with pytest.raises(InvalidArgumentError, match="sample_ahead"):
        PipelinedLoader([1], sample_ahead=True)
    with pytest.raises(InvalidArgumentError, match="iterable"):
        PipelinedLoader(3)  # type: ignore[arg-type]
    for bad in (0, -1e-3, 2.0, True, "0.001"):
        with pytest.raises(InvalidArgumentError, match="switch_interval"):
            PipelinedLoader([1], switch_interval=bad)  # type: ignore[arg-type]
    for bad in (1, None, "yes"):
        with pytest.raises(InvalidArgumentError, match="freeze_gc"):
            PipelinedLoader([1], freeze_gc=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("stop_early", [False, True])
def test_switch_interval_holds_while_iterating_and_is_restored(stop_early: bool) -> None:
    import sys

    from ibpcache.loaders.pipeline import PipelinedLoader

    before = sys.getswitchinterval()
    seen: list[float] = []
    loader = PipelinedLoader(_Epochs(6), lambda i: (i, sys.getswitchinterval()), switch_interval=2e-4)
    for i, in_fetch in loader:
        seen += [in_fetch, sys.getswitchinterval()]
        if stop_early and i == 2:
            break
    assert seen and all(abs(v - 2e-4) < 1e-9 for v in seen)
    assert sys.getswitchinterval() == before
    assert [i for i, _ in PipelinedLoader(_Epochs(4), lambda i: (i, 0))] == [0, 1, 2, 3]
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("stop_early", [False, True])
def test_freeze_gc_freezes_while_iterating_and_leaves_a_process_s_own_freeze(stop_early: bool) -> None:
    """The objects alive at the start are frozen during the iteration (the sampler and fetch threads see it too)
    and thawed after, also when the loop stops early; a process that froze objects itself keeps its freeze."""
    import gc

    from ibpcache.loaders.pipeline import PipelinedLoader

    assert gc.get_freeze_count() == 0
    seen: list[int] = []
    for i, in_fetch in PipelinedLoader(_Epochs(6), lambda i: (i, gc.get_freeze_count()), freeze_gc=True):
        seen += [in_fetch, gc.get_freeze_count()]
        if stop_early and i == 2:
            break
    assert seen and all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0
    assert all(n == 0 for _, n in PipelinedLoader(_Epochs(3), lambda i: (i, gc.get_freeze_count())))
    gc.freeze()
    try:
        mine = gc.get_freeze_count()  # frozen objects that die leave the count: it may only fall
        for _ in PipelinedLoader(_Epochs(3), freeze_gc=True):
            assert 0 < gc.get_freeze_count() <= mine  # nothing frozen on top (the loader is newer than the freeze)
        assert 0 < gc.get_freeze_count() <= mine  # and nothing thawed
    finally:
        gc.unfreeze()


def test_gc_pauses_counts_collections_by_generation_from_any_thread() -> None:
    """Full and younger collections are told apart, counted from the thread that ran them, timed, and nothing is
    counted once the block is left (its callback is gone)."""
    import gc

    from ibpcache.loaders.pipeline import GcPauses

    before = list(gc.callbacks)
    with GcPauses() as pauses:
        gc.collect()
        gc.collect(0)
        worker = threading.Thread(target=gc.collect, args=(1,))
        worker.start()
        worker.join()
    assert (pauses.full, pauses.young) == (1, 2) and pauses.seconds > 0.0
    gc.collect()
    assert pauses.full == 1 and gc.callbacks == before


def test_record_stream_walks_batches() -> None:
    from ibpcache.loaders.pipeline import record_stream

    seen: list[Any] = []

    class Own:
        def record_stream(self, stream: Any) -> None:
            seen.append(("own", stream))

    @dataclass
    class Batch:
        x: torch.Tensor
        parts: list[Any]

    batch = {"a": Batch(torch.zeros(2), [Own(), (torch.ones(1), Own())]), "b": 3}
    record_stream(batch, "s")  # CPU tensors are skipped (torch refuses them)
    assert seen == [("own", "s"), ("own", "s")]
    seen.clear()
    record_stream(batch, "s", leaf=lambda obj, s: isinstance(obj, Batch) and not seen.append(("leaf", s)))
    assert seen == [("leaf", "s")]


@pytest.mark.gpu
@pytest.mark.parametrize("fetch_thread,fetch_sms", [(True, None), (False, None), (True, 32)])
def test_gpu_side_stream_batches_are_complete_and_stay_intact(fetch_thread: bool, fetch_sms: "int | None") -> None:
    """The sampler and the fetch each write their batch on their own stream after a GPU delay; the caller reads it
    on its stream without any host sync, while later batches are being made (and the allocator would hand their
    blocks to new tensors if record_stream were missing). With ``fetch_sms`` the stages run on a green context's
    SMs and the caller on the loader's step stream (the other SMs): events order them across the contexts."""
    from ibpcache.loaders.pipeline import PipelinedLoader

    dev = torch.device("cuda")
    n = 1 << 20

    class Sampled:
        def __len__(self) -> int:
            return 40

        def __iter__(self) -> Any:
            for i in range(40):
                torch.cuda._sleep(200_000)
                yield torch.full((n,), i, dtype=torch.int64, device=dev)

    def fetch(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.cuda._sleep(200_000)
        return ids, ids * 2 + 1

    sums = []
    loader = PipelinedLoader(Sampled(), fetch, device=dev, fetch_thread=fetch_thread, fetch_sms=fetch_sms)
    assert (loader.step_stream is None) == (fetch_sms is None)
    with torch.cuda.stream(loader.step_stream):  # None without fetch_sms: a no-op
        for ids, x in loader:
            torch.cuda._sleep(400_000)  # the step outlives the stages' next allocations
            sums.append(torch.stack([ids.sum(), x.sum()]))
        got = torch.stack(sums).cpu()
    want = torch.tensor([[i * n, (2 * i + 1) * n] for i in range(40)])
    assert torch.equal(got, want)


def test_steps_in_flight_checks_its_limit() -> None:
    from ibpcache.loaders.pipeline import StepsInFlight

    with pytest.raises(InvalidArgumentError, match="limit"):
        StepsInFlight("cpu", limit=0)
    cpu = StepsInFlight("cpu", limit=1)
    for _ in range(3):
        cpu.step_done()  # nothing to wait for on the CPU


@pytest.mark.gpu
def test_gpu_steps_in_flight_waits_for_the_step_limit_back() -> None:
    from ibpcache.loaders.pipeline import StepsInFlight

    limit = StepsInFlight("cuda", limit=2)
    mine = []
    for _ in range(6):
        torch.cuda._sleep(5_000_000)  # a few ms per "step"
        mine.append(torch.cuda.current_stream().record_event())
        limit.step_done()
    assert mine[3].query()  # step_done after step 5 waited for step 3
    torch.cuda.synchronize()
