from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from bench.serving.arrivals import arrival_offsets


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(4, math.inf, seed=0) == [0.0, 0.0, 0.0, 0.0]


def test_poisson_offsets_are_seeded() -> None:
    first = arrival_offsets(50, 10.0, seed=1)
    assert arrival_offsets(50, 10.0, seed=1) == first
    assert arrival_offsets(50, 10.0, seed=2) != first


def test_offsets_start_at_zero_and_never_decrease() -> None:
    offsets = arrival_offsets(100, 5.0, seed=0)
    assert len(offsets) == 100
    assert offsets[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(offsets))


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_gaps_have_the_requested_rate_and_burstiness(burstiness: float, cv: float) -> None:
    gaps = np.diff(arrival_offsets(20001, 8.0, seed=0, burstiness=burstiness))
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    # gamma gaps of shape k have coefficient of variation 1/sqrt(k); k=1 is exponential
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_short_runs() -> None:
    assert arrival_offsets(0, 2.0, seed=0) == []
    assert arrival_offsets(1, 2.0, seed=0) == [0.0]


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_invalid_rates_are_rejected(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, seed=0, burstiness=burstiness)
