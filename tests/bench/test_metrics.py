from __future__ import annotations

import pytest

from bench.serving.client import RequestResult
from bench.serving.metrics import (
    GoodputSLO,
    compute_metrics,
    parse_goodput,
    parse_percentiles,
    summarize,
)


def synthetic_results() -> list[RequestResult]:
    # chunk times are binary-exact so the millisecond values below are exact too
    return [
        RequestResult(start_s=0.0, num_prompt_tokens=10, num_output_tokens=4, chunk_times_s=[0.25, 0.5, 0.75, 1.25]),
        RequestResult(start_s=0.5, num_prompt_tokens=20, num_output_tokens=2, chunk_times_s=[0.5, 1.0]),
        RequestResult(start_s=1.0, num_prompt_tokens=30, num_output_tokens=1, chunk_times_s=[1.0]),
        RequestResult(start_s=1.0, num_prompt_tokens=40, error="HTTP 429: busy"),
        RequestResult(
            start_s=1.5, num_prompt_tokens=40, num_output_tokens=1, chunk_times_s=[0.5], error="timed out after 5 s"
        ),
        RequestResult(start_s=2.0, num_prompt_tokens=40, error="HTTP 429: busy"),
    ]


def test_request_level_definitions() -> None:
    first = synthetic_results()[0]
    assert first.ttft_s == 0.25
    assert first.itl_s == [0.25, 0.25, 0.5]
    assert first.latency_s == 1.25
    assert first.tpot_s == (1.25 - 0.25) / 3


def test_tpot_uses_the_token_count_not_the_chunk_count() -> None:
    # two tokens per chunk: 2 chunks, 4 tokens, so TPOT spreads the decode time over 3 tokens
    result = RequestResult(start_s=0.0, num_prompt_tokens=1, num_output_tokens=4, chunk_times_s=[0.5, 2.0])
    assert result.tpot_s == 1.5 / 3


def test_throughputs_count_successes_over_the_whole_duration() -> None:
    metrics = compute_metrics(synthetic_results(), duration_s=4.0, percentiles=[99])
    assert (metrics.num_completed, metrics.num_failed) == (3, 3)
    assert (metrics.total_input_tokens, metrics.total_output_tokens) == (60, 7)
    assert metrics.request_throughput == 0.75
    assert metrics.output_throughput == 1.75
    assert metrics.total_token_throughput == 16.75
    assert metrics.goodput is None


def test_latency_distributions() -> None:
    metrics = compute_metrics(synthetic_results(), duration_s=4.0, percentiles=[50, 99])
    assert metrics.ttft_ms is not None and metrics.itl_ms is not None
    assert metrics.tpot_ms is not None and metrics.e2el_ms is not None
    assert metrics.ttft_ms.mean == pytest.approx(1750 / 3)
    assert metrics.ttft_ms.median == 500.0
    assert metrics.ttft_ms.percentiles == {"p50": 500.0, "p99": pytest.approx(990.0)}
    assert metrics.ttft_ms.std == pytest.approx(311.8047822311618)
    # ITL pools the gaps of all requests; the one-chunk request adds none
    assert (metrics.itl_ms.mean, metrics.itl_ms.median, metrics.itl_ms.percentiles["p99"]) == (375.0, 375.0, 500.0)
    # TPOT skips the one-token output
    assert metrics.tpot_ms.mean == pytest.approx((1000 / 3 + 500) / 2)
    assert metrics.e2el_ms.median == 1000.0
    assert metrics.e2el_ms.percentiles["p99"] == pytest.approx(1245.0)


def test_failures_are_counted_by_message() -> None:
    metrics = compute_metrics(synthetic_results(), duration_s=4.0, percentiles=[99])
    assert metrics.failures == {"HTTP 429: busy": 2, "timed out after 5 s": 1}
    assert list(metrics.failures) == ["HTTP 429: busy", "timed out after 5 s"]


@pytest.mark.parametrize(
    ("slo", "goodput"),
    [
        (GoodputSLO(ttft_ms=500, tpot_ms=400), 0.25),
        (GoodputSLO(tpot_ms=400), 0.5),  # the one-token output meets any TPOT limit
        (GoodputSLO(e2el_ms=1000), 0.5),
        (GoodputSLO(), 0.75),
    ],
)
def test_goodput_counts_requests_meeting_every_limit(slo: GoodputSLO, goodput: float) -> None:
    assert compute_metrics(synthetic_results(), duration_s=4.0, percentiles=[99], slo=slo).goodput == goodput


def test_all_failed_gives_no_distributions() -> None:
    metrics = compute_metrics(synthetic_results()[3:], duration_s=1.0, percentiles=[99])
    assert metrics.num_completed == 0
    assert (metrics.ttft_ms, metrics.tpot_ms, metrics.itl_ms, metrics.e2el_ms) == (None, None, None, None)
    assert metrics.output_throughput == 0.0


def test_summarize_converts_to_milliseconds() -> None:
    dist = summarize([0.001, 0.003], percentiles=[50, 99.9])
    assert dist is not None
    assert (dist.mean, dist.median, dist.std) == (2.0, 2.0, 1.0)
    assert list(dist.percentiles) == ["p50", "p99.9"]
    assert summarize([], percentiles=[99]) is None


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:200", "tpot:12.5"]) == GoodputSLO(ttft_ms=200.0, tpot_ms=12.5)
    assert parse_goodput(["e2el:1000"]) == GoodputSLO(e2el_ms=1000.0)


@pytest.mark.parametrize("item", ["ttft", "itl:5", "tpot:-1", "ttft:fast"])
def test_parse_goodput_rejects_bad_items(item: str) -> None:
    with pytest.raises(ValueError):
        parse_goodput([item])


def test_parse_percentiles() -> None:
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "0", "101", "x"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)
