"""Attainment and goodput as DistServe defines them, on hand-made request records, and one small
real sweep of bench.goodput against a real stack."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import goodput as goodput_bench
from bench import result_files
from bench.serving.attainment import Attainment, LatencyTargets, Miss, attainment, goodput
from bench.serving.client import RequestResult
from bench.serving.runner import LoadSpec
from bench.serving.workload import BenchRequest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def result(chunk_times_s: list[float], error: str | None = None) -> RequestResult:
    return RequestResult(start_s=0.0, num_prompt_tokens=8, num_output_tokens=len(chunk_times_s),
                         chunk_times_s=chunk_times_s, error=error)


def point(rate: float, both: float) -> Attainment:
    return Attainment(rate, 10, 0, both, both, both)


def test_a_request_meets_the_inter_token_target_by_the_p90_of_its_own_gaps() -> None:
    # 19 gaps of 100 ms and one stall of 2 s: the p90 is 100 ms, the mean 195 ms
    stalls_once_in_twenty = result([0.5 + 0.1 * i for i in range(20)] + [0.5 + 1.9 + 2.0])
    p90, mean = LatencyTargets(1000, 200, "p90"), LatencyTargets(1000, 150, "mean")
    assert p90.request_itl_ms(stalls_once_in_twenty) == pytest.approx(100)
    assert p90.meets_itl(stalls_once_in_twenty)
    assert mean.request_itl_ms(stalls_once_in_twenty) == pytest.approx(1000 * (1.9 + 2.0) / 20)
    assert not mean.meets_itl(stalls_once_in_twenty)


def test_failed_requests_meet_nothing_and_one_chunk_answers_have_no_gap_to_miss() -> None:
    targets = LatencyTargets(ttft_ms=300, itl_ms=50)
    assert targets.meets_itl(result([0.2])) and targets.meets_ttft(result([0.2]))
    assert not targets.meets_ttft(result([0.4, 0.41]))
    failed = result([0.1, 0.11], error="HTTP 500: boom")
    assert not targets.meets_ttft(failed) and not targets.meets_itl(failed)


def test_attainment_counts_each_target_and_both() -> None:
    targets = LatencyTargets(ttft_ms=300, itl_ms=50)
    results = [result([0.1, 0.12]), result([0.5, 0.52]), result([0.1, 0.3]), result([0.1], error="timed out")]
    got = attainment(2.0, results, targets)
    misses = (Miss(0.0, 8, 2, pytest.approx(500), pytest.approx(20)), Miss(0.0, 8, 2, pytest.approx(100), pytest.approx(200)),
              Miss(0.0, 8, 1, pytest.approx(100), None, "timed out"))
    assert got == Attainment(request_rate=2.0, num_requests=4, num_failed=1, ttft=0.5, itl=0.5, both=0.25,
                             ttft_p50_ms=pytest.approx(100), itl_p99_ms=pytest.approx(np.percentile([20, 20, 200], 99)),
                             misses=misses)
    assert goodput_bench.describe_misses(got, targets) == (
        "; TTFT missed by prompts of 8 tokens; inter-token missed by prompts of 8 tokens; 1 failed")
    with pytest.raises(ValueError, match="at least one request"):
        attainment(1.0, [], targets)


def test_goodput_is_the_highest_rate_before_the_first_miss() -> None:
    assert goodput([point(0.5, 1.0), point(1.0, 0.95), point(2.0, 0.6), point(3.0, 0.92)]) == 1.0
    assert goodput([point(1.0, 0.9), point(0.5, 1.0)]) == 1.0  # order of the sweep does not matter
    assert goodput([point(0.5, 0.89)]) is None
    assert goodput([point(0.5, 0.8)], share=0.75) == 0.5


def test_targets_and_rates_are_checked() -> None:
    with pytest.raises(ValueError, match="must be > 0 ms"):
        LatencyTargets(0, 10)
    with pytest.raises(ValueError, match="ascending"):
        goodput_bench.parse_rates("2,1")
    with pytest.raises(SystemExit):
        goodput_bench.main(["--ttft-ms", "100"])


def test_pauses_need_the_p90_measure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        goodput_bench.main(["--pauses", "--itl-measure", "mean"])
    assert "--pauses" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_small_sweep_calibrates_targets_and_reports_goodput(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(result_files, "RESULTS_DIR", tmp_path)
    argv = ["--servers", "disaggregated", "--rates", "2,4", "--min-requests", "2", "--duration-s", "1",
            "--input-len", "16", "--output-len", "4", "--calibration-requests", "1", "--warmup-requests", "2",
            "--stop-below", "0"]
    assert goodput_bench.main(argv) == 0
    printed = capsys.readouterr().out
    document = json.loads((tmp_path / "goodput.json").read_text())
    assert (tmp_path / "goodput.png").read_bytes().startswith(PNG_MAGIC)

    assert "| req/s | disaggregated |" in printed and "**goodput**" in printed
    assert "TTFT p50 / inter-token p99" in printed
    calibration, targets = document["calibration"], document["targets"]
    assert targets["ttft_ms"] == pytest.approx(5 * calibration["ttft_ms"])
    assert targets["itl_ms"] == pytest.approx(5 * calibration["itl_ms"])
    points = document["runs"]["disaggregated"]
    assert [p["request_rate"] for p in points] == [2.0, 4.0]
    assert [p["num_requests"] for p in points] == [2, 4] and all(p["num_failed"] == 0 for p in points)
    expected = goodput([Attainment(**{**p, "misses": ()}) for p in points])
    assert document["goodput"]["disaggregated"] == expected
    # the decode worker's planned steps at each rate, read from its /metrics (how many depends on
    # how often the prompts overlapped its streams)
    pacing = document["pacing"]["disaggregated"]
    assert [p["request_rate"] for p in pacing] == [2.0, 4.0]
    assert all(0 <= p["late_paced_steps"] <= p["paced_steps"] for p in pacing)


def test_every_rate_sends_the_first_shapes_of_one_sample_as_new_prompts_at_one_draw_of_gaps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[tuple[list[BenchRequest], LoadSpec]] = []

    def record(base_url: str, requests: list[BenchRequest], load: LoadSpec) -> tuple:
        sent.append((requests, load))
        return None, [result([0.1, 0.11]) for _ in requests]

    monkeypatch.setattr(goodput_bench, "run_load", record)
    args = goodput_bench.build_parser().parse_args(["--rates", "0.5,1,2", "--duration-s", "8", "--min-requests", "6"])
    points, pacing = goodput_bench.sweep("server", "http://unused", args, np.arange(1000), LatencyTargets(1000, 100))
    assert pacing == []  # no decode workers to read
    assert [p.num_requests for p in points] == [6, 8, 16]
    largest = sent[-1][0]
    assert all(shapes(requests) == shapes(largest[: len(requests)]) for requests, _ in sent)
    # no prompt is sent twice: a repeated one would be a prefix-cache hit on every server
    prompts = [tuple(req.prompt) for requests, _ in sent for req in requests]
    assert len(set(prompts)) == len(prompts)
    assert {load.seed for _, load in sent} == {args.seed}
    assert [load.request_rate for _, load in sent] == [0.5, 1, 2]


def shapes(requests: list[BenchRequest]) -> list[tuple[int, int]]:
    return [(req.num_prompt_tokens, req.max_tokens) for req in requests]
