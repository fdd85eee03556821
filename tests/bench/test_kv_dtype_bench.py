"""bench.kv_dtype's quality figures, on hand-made runs."""

from __future__ import annotations

import pytest

from bench.kv_dtype import agreement


def test_agreement_counts_tokens_before_the_first_divergence_and_position_by_position() -> None:
    base = ([[1, 2, 3, 4], [5, 6]], [[-0.1, -0.2, -0.3, -0.4], [-1.0, -2.0]])
    other = ([[1, 2, 9, 4], [5, 6]], [[-0.1, -0.25, -0.7, -0.4], [-1.5, -2.0]])

    figures = agreement(base, other)

    assert figures["prefix_agreement"] == pytest.approx(4 / 6)  # 2 of the first prompt's, both of the second's
    assert figures["overall_agreement"] == pytest.approx(5 / 6)  # the fourth token agrees again
    # logprobs compared only before each divergence, where both saw the same tokens
    assert figures["logprob_mean_abs_diff"] == pytest.approx((0 + 0.05 + 0.5 + 0) / 4)
