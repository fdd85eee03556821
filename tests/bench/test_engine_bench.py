"""The offline engine benchmarks end to end on the real model, at toy sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import engine, kv_reservation

TINY = ["--dtype", "float32", "--min-prompt-len", "32", "--max-prompt-len", "64", "--min-output-len", "4",
        "--max-output-len", "8"]


@pytest.mark.slow
def test_engine_bench_runs_continuous_and_static_batching(tmp_path: Path) -> None:
    result = tmp_path / "engine.json"
    engine.main([*TINY, "--num-requests", "3", "--hf-batch-size", "2", "--skip-hf", "--kv-memory-gib", "0.01",
                 "--result-json", str(result)])
    report = json.loads(result.read_text())
    assert report["workload"] == {"num_requests": 3, "seed": 0, "prompt_lens": [32, 64], "output_lens": [4, 8]}
    ours, static = report["engine"], report["engine_static"]
    assert ours["output_tokens"] == static["output_tokens"] > 0
    assert ours["peak_running"] == 3 and static["peak_running"] == static["batch_size"] == 2
    assert report["continuous_over_static"] == pytest.approx(ours["tokens_per_s"] / static["tokens_per_s"])
    assert "transformers_static" not in report


@pytest.mark.slow
def test_kv_reservation_bench_compares_both_policies(tmp_path: Path) -> None:
    result = tmp_path / "kv.json"
    # a pool of 160 tokens, less than the 4 prompts together
    kv_reservation.main([*TINY, "--num-requests", "4", "--kv-tokens", "160", "--result-json", str(result)])
    report = json.loads(result.read_text())
    assert report["kv_pool"]["tokens"] == 160
    paged, reserving = report["policies"]["paged"], report["policies"]["max_length"]
    for figures in (paged, reserving):
        assert figures["output_tokens"] > 0 and 0 < figures["kv_utilization"] <= 1
        assert len(figures["running_per_step"]) == figures["steps"]
        assert figures["peak_running"] == max(figures["running_per_step"])
    assert paged["output_tokens"] == reserving["output_tokens"]
    assert paged["peak_running"] >= reserving["peak_running"]
    assert result.with_suffix(".png").stat().st_size > 0
