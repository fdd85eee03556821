"""When each request is sent: all at once, or a seeded Poisson (or gamma) process."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times in seconds after the start, non-decreasing, the first at 0.0.

    Gaps are gamma-distributed with mean 1 / request_rate and shape `burstiness`; shape 1
    is a Poisson process, smaller is burstier. An infinite rate sends everything at 0.0.
    """
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng([seed, 1])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(num_requests - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:num_requests]
