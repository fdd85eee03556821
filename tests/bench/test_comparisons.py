"""The stack comparisons, each one small real run: stacks of real processes on the real model,
requests through the gateway, counters from the workers' /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from bench import handoff, prefix_cache, result_files, servers, side_by_side, stack_harness
from bench.serving.runner import LoadSpec
from bench.serving.workload import BenchRequest
from tests.bench.conftest import StartStub
from tests.bench.stub_server import StubScript

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def results_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(result_files, "RESULTS_DIR", tmp_path)
    return tmp_path


def test_prefix_cache_hits_only_with_caching_on(results_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # one group, one request at a time: every request after the first finds the 32-token prefix cached
    argv = ["--num-prompts", "3", "--num-groups", "1", "--prefix-len", "32", "--suffix-len", "16", "--output-len", "2",
            "--request-rate", "inf", "--max-concurrency", "1"]  # fmt: skip
    assert prefix_cache.main(argv) == 0
    printed = capsys.readouterr().out
    document = json.loads((results_dir / "prefix_cache.json").read_text())
    assert (results_dir / "prefix_cache.png").read_bytes().startswith(PNG_MAGIC)

    assert "| prefix caching |" in printed and "TTFT off/on: mean" in printed
    off, on = document["summary"]
    assert (off["prefix_caching"], on["prefix_caching"]) == ("off", "on")
    assert off["completed"] == on["completed"] == 3 and off["failed"] == on["failed"] == 0
    assert off["prefix_cache_hit_rate"] == 0
    # two of three requests hit two of their three blocks (the warm-up has fresh tokens, so hits nothing)
    assert on["prefix_cache_hit_rate"] == pytest.approx(2 * 32 / (3 * 48))
    assert document["runs"]["on"]["prefill_counter_deltas"]["vllm:prefix_cache_queries_total"] == 3 * 48
    assert document["ttft_ratio_off_on"]["mean"] > 0
    assert [r["error"] for r in document["runs"]["off"]["requests"]] == [None] * 3


def test_handoff_bytes_grow_with_prompt_length(results_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--lengths", "16,64", "--requests-per-length", "2", "--output-len", "2", "--warmups", "0"]
    assert handoff.main(argv) == 0
    printed = capsys.readouterr().out
    document = json.loads((results_dir / "handoff.json").read_text())
    assert (results_dir / "handoff.png").read_bytes().startswith(PNG_MAGIC)

    assert "| prompt tokens |" in printed
    short, long = document["summary"]
    assert (short["prompt_tokens"], long["prompt_tokens"]) == (16, 64)
    assert short["handoffs"] == long["handoffs"] == 2
    # whole blocks of 16 tokens move, so the bytes per prompt token are the same at both lengths
    assert long["kv_bytes_per_request"] == 4 * short["kv_bytes_per_request"] > 0
    for row in (short, long):
        assert row["failed"] == 0 and row["handoff_mean_s"] > 0 and row["handoff_mib_s"] > 0
        assert 0 < row["handoff_share_of_second_token"] < row["handoff_share_of_itl0"]
        assert row["ttft_worker_mean_s"] > 0


def test_side_by_side_baseline_runs_transformers_on_the_same_prompts(capsys: pytest.CaptureFixture[str]) -> None:
    args = side_by_side.build_parser().parse_args(
        ["--workload", "chat-mix", "--input-len", "12", "--output-len", "3", "--transformers", "--hf-batch-size", "2",
         "--hf-dtype", "float32"]
    )
    requests = [BenchRequest([5, 6, 7], 3, 2), BenchRequest([8, 9, 10, 11, 12], 5, 4), BenchRequest([13], 1, 1)]
    served = {"this stack (1P+1D)": {"metrics": {"output_throughput": 5.0}}}
    baseline = side_by_side._transformers_static(args, requests, served)
    printed = capsys.readouterr().out

    # each request's max_tokens counts, as a server's run counts every token it generated
    assert baseline["output_tokens"] == 2 + 4 + 1 and baseline["batch_size"] == 2
    assert baseline["dtype"] == "torch.float32"
    assert baseline["output_throughput"] == pytest.approx(baseline["output_tokens"] / baseline["seconds"])
    ratio = 5.0 / baseline["output_throughput"]
    assert "transformers generate (torch.float32), static batches of 2" in printed
    assert f"this stack (1P+1D) / transformers: {ratio:.2f}x" in printed


async def test_side_by_side_keeps_each_servers_run_of_median_throughput(start_stub: StartStub) -> None:
    stub, base_url = await start_stub(StubScript())
    runs = [[BenchRequest([5, 6], 2, 4)] * n for n in (2, 3, 4)]
    warmup = BenchRequest([7], 1, 1)

    document = await asyncio.to_thread(side_by_side._measure, "stub", base_url, runs, [warmup], LoadSpec(), "random")

    # the warm-up goes before the first run only, and every run's requests reach the server
    assert [p["max_tokens"] for p in stub.payloads] == [1] + [4] * (2 + 3 + 4)
    throughputs = document["output_throughput_runs"]
    assert len(throughputs) == 3 and document["metrics"]["output_throughput"] == sorted(throughputs)[1]
    assert document["config"]["num_prompts"] in (2, 3, 4) and document["metrics"]["num_failed"] == 0


def test_vllm_runs_on_every_core_with_its_preloads(tmp_path: Path) -> None:
    python = tmp_path / "env" / "bin" / "python"
    (tmp_path / "env" / "lib").mkdir(parents=True)
    (tmp_path / "env" / "lib" / "libiomp5.so").write_bytes(b"")
    env = servers.vllm_environment(python, 2.5, {0, 1, 3}, {"PATH": "/bin", "LD_PRELOAD": "/x.so"})

    # vLLM leaves a core to its server process unless told not to: half of a 2-core machine
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,3" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2.5" and env["PATH"] == "/bin"
    preloads = env["LD_PRELOAD"].split(":")
    assert str(tmp_path / "env" / "lib" / "libiomp5.so") in preloads and preloads[-1] == "/x.so"
    assert all(Path(p).exists() for p in preloads[:-1])

    command = servers.vllm_command(python, tmp_path / "ckpt", torch.bfloat16, 8001)
    assert command[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--dtype") + 1] == "bfloat16" and command[command.index("--port") + 1] == "8001"


def test_a_server_that_exits_early_fails_with_its_log() -> None:
    command = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    with pytest.raises(SystemExit, match="vLLM exited with 3: no such model"):
        with servers.server_process("vLLM", command, dict(os.environ), 9):
            pass
