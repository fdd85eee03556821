from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.serve import main
from bench.serving import compare
from bench.serving.plots import PLOT_NAMES
from tests.bench.conftest import StartStub
from tests.bench.stub_server import StubScript

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def argv(base_url: str, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--base-url", base_url,
        "--num-prompts", "5",
        "--input-len", "16",
        "--output-len", "6",
        "--vocab-size", "100",
        "--progress-interval", "0",
        "--result-json", str(tmp_path / "run.json"),
        *extra,
    ]  # fmt: skip


async def test_end_to_end_run_writes_summary_json_and_plots(
    start_stub: StartStub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stub, base_url = await start_stub(StubScript())
    extra = ("--plot-dir", str(tmp_path / "plots"), "--goodput", "ttft:60000", "--percentiles", "50,99")
    assert await asyncio.to_thread(main, argv(base_url, tmp_path, *extra)) == 0

    assert len(stub.payloads) == 6  # one warm-up, five timed
    assert {p["model"] for p in stub.payloads} == {"stub-model"}
    summary = capsys.readouterr().out
    assert "Successful requests:                             5" in summary
    assert "Total generated tokens:                         30" in summary
    assert "P50 TTFT (ms):" in summary and "P99 ITL (ms):" in summary

    document = json.loads((tmp_path / "run.json").read_text())
    metrics = document["metrics"]
    assert (metrics["num_completed"], metrics["num_failed"]) == (5, 0)
    assert (metrics["total_input_tokens"], metrics["total_output_tokens"]) == (80, 30)
    assert metrics["goodput"] == metrics["request_throughput"]
    assert [len(r["itl_s"]) for r in document["requests"]] == [5] * 5
    assert document["config"]["workload"] == "random" and "api_key" not in document["config"]
    for name in PLOT_NAMES:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG_MAGIC


async def test_same_seed_sends_the_same_prompts(start_stub: StartStub, tmp_path: Path) -> None:
    stub, base_url = await start_stub(StubScript())
    for seed in ("1", "1", "2"):
        assert await asyncio.to_thread(main, argv(base_url, tmp_path, "--seed", seed, "--num-warmups", "0")) == 0
    prompts = [p["prompt"] for p in stub.payloads]
    assert prompts[0:5] == prompts[5:10]
    assert prompts[0:5] != prompts[10:15]


async def test_all_failed_run_exits_nonzero(start_stub: StartStub, tmp_path: Path) -> None:
    _, base_url = await start_stub(StubScript(status=400))
    extra = ("--num-warmups", "0", "--model", "m", "--plot-dir", str(tmp_path / "plots"))
    assert await asyncio.to_thread(main, argv(base_url, tmp_path, *extra)) == 1
    failures = json.loads((tmp_path / "run.json").read_text())["metrics"]["failures"]
    assert failures == {"HTTP 400: prompt is too long": 5}
    assert sorted(path.name for path in (tmp_path / "plots").iterdir()) == sorted(PLOT_NAMES)


async def test_failed_warmup_exits_nonzero_with_the_reason(
    start_stub: StartStub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, base_url = await start_stub(StubScript(status=400))
    assert await asyncio.to_thread(main, argv(base_url, tmp_path)) == 1
    assert "error: warm-up request failed: HTTP 400: prompt is too long" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad",
    [["--prompt-format", "text"], ["--max-concurrency", "0"], ["--goodput", "itl:5"], ["--extra-body", "[1]"]],
)
def test_invalid_options_exit_with_usage_error(bad: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(argv("http://127.0.0.1:9", tmp_path, *bad))
    assert exc_info.value.code == 2


def test_compare_prints_runs_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def document(throughput: float) -> dict[str, object]:
        dist = {"mean": 1.0, "median": 2.0, "std": 0.5, "percentiles": {"p99": 3.0}}
        metrics = {
            "num_completed": 4, "num_failed": 0, "duration_s": 2.0, "total_input_tokens": 8,
            "total_output_tokens": 12, "request_throughput": 2.0, "output_throughput": throughput,
            "total_token_throughput": 10.0, "goodput": None,
            "ttft_ms": dist, "tpot_ms": dist, "itl_ms": None, "e2el_ms": dist, "failures": {},
        }  # fmt: skip
        return {"config": {"workload": "random", "request_rate": 4.0}, "metrics": metrics}

    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, throughput in zip(paths, (6.0, 7.5), strict=True):
        path.write_text(json.dumps(document(throughput)))
    assert compare.main([str(p) for p in paths] + ["--labels", "ours,vllm", "--format", "markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| metric | ours | vllm |"
    assert "| workload | random | random |" in lines
    assert "| Output token throughput (tok/s) | 6.00 | 7.50 |" in lines
    assert "| P99 TTFT (ms) | 3.00 | 3.00 |" in lines
    assert "| ITL (ms) | n/a | n/a |" in lines


def test_compare_text_table_aligns_columns() -> None:
    table = [["metric", "a", "bb"], ["x", "1.00", "22.00"]]
    assert compare.format_text(table) == "metric     a     bb\nx       1.00  22.00"
