"""bench/interference.py: its options, and one tiny real run of both modes (stacks of real
processes on the real model, requests through the gateway)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import interference, result_files

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "colocated,fused"], "unknown ['fused']"),
        (["--prefill-cpus", "0", "--decode-cpus", "0-1"], "must be non-empty and disjoint"),
        (["--short-min-tokens", "8", "--short-max-tokens", "4"], "--short-min-tokens 8 must be in 1.."),
        (["--rate", "inf"], "--rate inf must be a finite number"),
    ],
)
def test_invalid_options_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        interference.check_args(interference.build_parser().parse_args(argv))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_run_of_both_modes_reports_itl_around_the_burst(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(result_files, "RESULTS_DIR", tmp_path)
    argv = ["--num-short", "3", "--rate", "4", "--short-input-len", "16", "--short-min-tokens", "4",
            "--short-max-tokens", "6", "--num-long", "1", "--long-input-len", "256", "--burst-at", "0.3",
            "--num-warmups", "0", "--kv-memory-mib", "32", "--max-num-batched-tokens", "64", "--dtype", "float32",
            "--progress-interval", "0"]  # fmt: skip
    assert interference.main(argv) == 0
    printed = capsys.readouterr().out
    document = json.loads((tmp_path / "interference.json").read_text())
    assert (tmp_path / "interference.png").read_bytes().startswith(PNG_MAGIC)

    assert "| mode |" in printed and "short ITL p99 during the burst / without it (all gaps)" in printed
    assert document["config"]["burst_at"] == 0.3
    assert list(document["modes"]) == ["disaggregated", "colocated"]
    for result in document["modes"].values():
        short, long = result["short"], result["long"]
        assert (short["num_completed"], short["num_failed"], long["num_completed"], long["num_failed"]) == (3, 0, 1, 0)
        assert result["failures"] == {}
        start, end = result["burst_window_s"]
        assert 0 < start < end
        num_gaps = {
            key: sum(d["count"] for d in (short[key]["no_burst"], short[key]["during_burst"]) if d is not None)
            for key in ("itl_ms", "itl_after_first_gap_ms")
        }
        # one gap per pair of chunks (a streamed token may share a chunk with the next), the first of each request
        assert num_gaps["itl_ms"] == len(result["gaps"]) > 0
        num_first = sum(first for _, _, first in result["gaps"])
        assert num_gaps["itl_ms"] - num_gaps["itl_after_first_gap_ms"] == num_first and 0 < num_first <= 3
        assert set(short["itl_ms"]["ratio"]) == {"p50", "p99"}
        assert long["ttft_ms"]["count"] == 1 and long["ttft_ms"]["percentiles"]["p100"] > 0
