"""AdmissionPace: when a fused inference lookup may skip its admission pass (decisions on counter readings; the
caches' hit rates under it are in test_convergence.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ibpcache.cache.admission import SETTLED_ADMIT_EVERY, AdmissionPace
from ibpcache.errors import InvalidArgumentError

CPU = torch.device("cpu")


def _drive(pace: AdmissionPace, rates: list[float], n: int = 100_000, full: bool = True) -> list[bool]:
    """One step per rate: the decision asked first, then counters that grew by ``n`` requests at that hit rate."""
    counters = torch.zeros(2, dtype=torch.int64)
    admitted = []
    for r in rates:
        admitted.append(pace.admit())
        counters += torch.tensor([n, round(r * n)])
        pace.observe(counters, full, n)
    return admitted


def test_a_flat_hit_rate_settles_a_full_cache_and_a_drop_unsettles_it() -> None:
    pace = AdmissionPace(4, CPU, window=4, span=2, min_requests=0)
    admitted = _drive(pace, [0.5 + 0.01 * i for i in range(20)])  # rising: every step admits
    assert all(admitted) and not pace.settled
    _drive(pace, [0.7] * 24)  # flat over two windows (span): settled
    assert pace.settled and pace.settles == 1
    tail = _drive(pace, [0.7] * 40)  # one step in 4 admits
    assert sum(tail) == 10 and pace.skipped >= 30
    _drive(pace, [0.6] * 8)  # the hot set moved: 10 points below the best settled window
    assert not pace.settled and pace.unsettles == 1
    assert all(_drive(pace, [0.62, 0.64, 0.66, 0.68]))  # every step admits while it recovers
    assert pace.stats()["skipped_steps"] == pace.skipped and pace.stats()["settled"] is False


def test_a_filling_cache_never_settles_and_every_1_never_skips() -> None:
    pace = AdmissionPace(4, CPU, window=4, span=2, min_requests=0)
    assert all(_drive(pace, [0.7] * 64, full=False)) and not pace.settled
    once = AdmissionPace(1, CPU, window=4, span=2, min_requests=0)
    assert all(_drive(once, [0.7] * 64)) and once.skipped == 0


def test_noise_decides_what_a_rise_is() -> None:
    """The same 1-point rise per window is noise over 1,000 ids (settles) and a trend over 10^6 ids (does not)."""
    rates = [0.5 + 0.01 * (i // 4) for i in range(48)]
    small, large = (AdmissionPace(4, CPU, window=4, span=2, min_requests=0) for _ in range(2))
    _drive(small, rates, n=250)
    _drive(large, rates, n=250_000)
    assert small.settled and not large.settled


def test_windows_hold_at_least_min_requests() -> None:
    """Small steps: a window spans enough steps to hold ``min_requests`` ids, so readings come less often."""
    pace = AdmissionPace(4, CPU, window=4, span=2, min_requests=4_000)
    _drive(pace, [0.7] * 40, n=100)  # a window is 40 steps here: one reading, nothing to compare it with
    assert not pace.settled and pace.last_rate is None
    _drive(pace, [0.7] * 200, n=100)
    assert pace.settled


def test_reset_and_bad_settings() -> None:
    pace = AdmissionPace(SETTLED_ADMIT_EVERY, CPU, window=4, span=2, min_requests=0)
    _drive(pace, [0.7] * 32)
    assert pace.settled
    pace.reset()
    assert not pace.settled and all(_drive(pace, [0.7] * 8))
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(InvalidArgumentError, match="settled_admit_every"):
            AdmissionPace(bad, CPU)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.booleans()), min_size=1, max_size=300),
       st.integers(1, 6), st.integers(1, 5_000))
def test_any_trace_skips_only_when_settled_and_never_more_than_the_pace_allows(
        steps: list[tuple[float, bool]], every: int, n: int) -> None:
    """Whatever the hit rates and fill states: a step is skipped only while settled, only a filling-free cache
    settles, and at most ``every - 1`` of any ``every`` consecutive decisions are skips."""
    pace = AdmissionPace(every, CPU, window=2, span=2, min_requests=0)
    counters = torch.zeros(2, dtype=torch.int64)
    decisions = []
    for rate, full in steps:
        settled_before = pace.settled
        admitted = pace.admit()
        assert admitted or settled_before
        decisions.append(admitted)
        counters += torch.tensor([n, round(rate * n)])
        was = pace.settles
        pace.observe(counters, full, n)
        assert pace.settles == was or full  # a cache still filling never settles
    assert pace.skipped == decisions.count(False) and pace.steps == len(decisions)
    for i in range(len(decisions) - every + 1):
        assert any(decisions[i: i + every]), decisions


def test_a_falling_hit_rate_never_settles_the_cache() -> None:
    """After the hot set moved the rate falls, then climbs back: a fall is not "stopped rising" (settling in the
    middle of it would follow the new hot set with a quarter of the admissions)."""
    pace = AdmissionPace(4, CPU, window=4, span=2, min_requests=0)
    assert all(_drive(pace, [0.8 - 0.02 * i for i in range(24)]))  # falling for 24 steps: every step admits
    assert not pace.settled and pace.settles == 0


def test_span_set_after_construction_is_the_span_compared() -> None:
    """Experiments and tests set ``span`` on a built pace: a flat rate must settle after ``span`` + 1 readings of it,
    whatever span the pace was built with."""
    for steps, settled in ((36, False), (40, True)):  # a reading every 4 steps, the first a baseline: 8, 9 rates
        pace = AdmissionPace(4, CPU, window=4, span=2, min_requests=0)
        pace.span = 8
        _drive(pace, [0.7] * steps)
        assert pace.settled is settled, steps
