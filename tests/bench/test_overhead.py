"""bench.overhead's parts: the tiny model in the engine, the CPU-time and phase-counter readings,
and a small real engine-alone run. The served runs start a stack; `make bench-overhead` runs them."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from bench import overhead, overhead_runs, proc_cpu
from bench.overhead_runs import Run
from bench.phase_counters import PhaseCounters, engine_phases, phase_rows, read_phases
from bench.serving.workload import WorkloadSpec, build_workload, warmup_requests
from bench.stack_harness import parse_metrics, vocab_ids
from bench.tiny_model import shape_from, tiny_model
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_phases import PHASES

# a real /proc/<pid>/stat line, its command name given a space and a ')' as a process may choose
STAT = ("4242 (web) (x) S 4200 4242 23613 0 -1 4194304 103 0 0 0 250 70 9 1 20 0 1 0 119462 3133440 389 "
        "18446744073709551615 94002600325120 94002600345001 140735575778784 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0")


@pytest.fixture(scope="module")
def model() -> str:
    # the benchmark's own default shape
    return str(tiny_model(shape_from(overhead.build_parser().parse_args([]))))


def test_the_tiny_model_loads_in_the_engine_and_generates(model: str) -> None:
    llm = LLM(model, dtype="float32")
    outputs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [4, 4]
    assert all(0 <= t < llm.engine.config.vocab_size for o in outputs for t in o.token_ids)
    assert llm.engine.config.hidden_size == 64 and llm.engine.config.num_layers == 2


def test_stat_lines_give_parent_and_cpu_time_past_an_odd_command_name() -> None:
    stat = proc_cpu.parse_stat(STAT)
    assert (stat.pid, stat.ppid) == (4242, 4200)
    # utime 250 + stime 70 + waited-for children's 9 + 1, in clock ticks
    assert stat.cpu_s == pytest.approx(330 / proc_cpu.CLOCK_TICKS)


def test_a_tree_counts_its_descendants_only() -> None:
    stats = {pid: proc_cpu.ProcStat(pid, ppid, cpu) for pid, ppid, cpu in
             [(10, 1, 1.0), (11, 10, 2.0), (12, 11, 4.0), (20, 1, 8.0)]}  # fmt: skip
    assert proc_cpu.tree_cpu_seconds(10, stats) == 7.0
    assert proc_cpu.tree_cpu_seconds(11, stats) == 6.0
    with pytest.raises(ProcessLookupError, match="process 99 is not running"):
        proc_cpu.tree_cpu_seconds(99, stats)


def test_a_busy_child_shows_in_its_parents_tree() -> None:
    # a parent waiting on a child that spins 0.3 s of CPU: the parent's tree holds the child's time
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ninput()"
    waiter = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"
    parent = subprocess.Popen([sys.executable, "-c", waiter], stdin=subprocess.PIPE)
    try:
        for _ in range(100):
            if proc_cpu.sample_trees({"parent": parent.pid})["parent"] >= 0.3:
                break
            time.sleep(0.1)
        own = proc_cpu.read_stats([parent.pid])[parent.pid].cpu_s
        assert proc_cpu.sample_trees({"parent": parent.pid})["parent"] >= 0.3 > own
    finally:
        parent.communicate(b"\n", timeout=30)
    with pytest.raises(ValueError, match=r"\['b'\] in only one"):
        proc_cpu.cpu_delta({"a": 1.0, "b": 2.0}, {"a": 3.0})


def test_phase_counters_read_from_a_metrics_page() -> None:
    registry = CollectorRegistry()
    phases = Counter("llmd_engine_phase_seconds", "", ["model_name", "worker_id", "phase"], registry=registry)
    steps = Gauge("llmd_engine_steps", "", ["model_name", "worker_id"], registry=registry)
    paced = Counter("llmd_paced_steps", "", ["model_name", "worker_id"], registry=registry)  # not the step count
    for worker in ("decode-0", "decode-1"):
        phases.labels("m", worker, "forward").inc(0.5)
        phases.labels("m", worker, "sample").inc(0.25)
        steps.labels("m", worker).inc(100)
        paced.labels("m", worker).inc(7)
    before = read_phases(parse_metrics(generate_latest(registry).decode()))
    assert before == PhaseCounters({"forward": 1.0, "sample": 0.5}, 200.0)

    phases.labels("m", "decode-0", "forward").inc(2.0)
    steps.labels("m", "decode-0").inc(1000)
    spent = read_phases(parse_metrics(generate_latest(registry).decode())) - before
    assert spent == PhaseCounters({"forward": 2.0, "sample": 0.0}, 1000.0)
    forward, sample = phase_rows("decode", spent, output_tokens=4000)
    assert forward == {"process": "decode", "phase": "forward", "seconds": 2.0, "us_per_token": 500.0,
                       "ms_per_step": 2.0, "share": 1.0}  # fmt: skip
    assert sample["us_per_token"] == sample["ms_per_step"] == sample["share"] == 0.0


def test_a_gateway_page_without_steps_has_phases_per_token_only() -> None:
    page = (
        "# HELP llmd_gateway_phase_seconds_total Gateway time by phase.\n"
        "# TYPE llmd_gateway_phase_seconds_total counter\n"
        'llmd_gateway_phase_seconds_total{phase="redis_read"} 1.5\n'
        'llmd_gateway_phase_seconds_total{phase="sse_write"} 0.5\n'
        "# HELP vllm:prompt_tokens_total Prompt tokens.\n"
        "# TYPE vllm:prompt_tokens_total counter\n"
        "vllm:prompt_tokens_total 12.0\n"
    )
    spent = read_phases(parse_metrics(page))
    assert spent == PhaseCounters({"redis_read": 1.5, "sse_write": 0.5}, None)
    rows = phase_rows("gateway", spent, output_tokens=1000)
    assert [(r["phase"], r["us_per_token"], r["ms_per_step"], r["share"]) for r in rows] == [
        ("redis_read", 1500.0, None, 0.75), ("sse_write", 500.0, None, 0.25)]
    assert read_phases(parse_metrics("")) == PhaseCounters({}, None)


def test_an_engine_object_gives_its_counters() -> None:
    kept = SimpleNamespace(phases=SimpleNamespace(seconds={"schedule": 0.5}), num_steps=2)
    assert engine_phases(kept) == PhaseCounters({"schedule": 0.5}, 2.0)  # type: ignore[arg-type]


def test_the_engine_alone_runs_count_every_token_and_their_cpu_time(model: str) -> None:
    requests = build_workload(WorkloadSpec("random", 8, input_len=8, output_len=8), vocab_ids(model), 0)
    shorter = build_workload(WorkloadSpec("random", 4, input_len=8, output_len=5), vocab_ids(model), 1)
    runs = overhead_runs.this_engine(model, "float32", [requests, shorter],
                                     warmup_requests(requests, vocab_ids(model), 0, 1))
    assert [(run.system, run.concurrency, run.output_tokens, run.failed) for run in runs] == [
        ("this engine alone", None, 64, 0), ("this engine alone", None, 20, 0)]
    for run, max_tokens in zip(runs, (8, 5), strict=True):
        assert run.cpu_s["engine (this process)"] > 0 and run.seconds > 0
        # the engine's phase counters where it keeps them, and then every step of that run and no other
        for spent in run.phases.values():
            assert set(spent.seconds) == set(PHASES)
            assert spent.steps is not None and max_tokens <= spent.steps <= 2 * max_tokens


def stack_run(seconds: float, gateway_cpu_s: float = 0.25, concurrency: int | None = None) -> Run:
    return Run("this stack", concurrency, seconds, 1000, 0, {"gateway": gateway_cpu_s, "decode-0": 0.75},
               client_cpu_s=0.1, phases={"decode-0": PhaseCounters({"forward": 0.5}, 100.0)})


def test_the_tables_compare_each_row_with_its_counterparts() -> None:
    runs = {
        "this engine alone": [Run("this engine alone", None, 1.0, 1000, 0, {"engine (this process)": 0.5})],
        "vLLM engine alone": [Run("vLLM engine alone", None, 1.0, 2000, 0, {"vLLM engine (process tree)": 0.5})],
        "this stack": [stack_run(2.0)],
    }
    stack = overhead.main_table(runs)[2]
    assert stack["output_tok_s"] == 500.0 and stack["share_of_own_engine"] == 0.5 and stack["vs_vllm"] is None
    assert stack["cpu_us_per_token"] == 1000.0 and stack["cpu_us_per_token.gateway"] == 250.0
    assert stack["client_cpu_us_per_token"] == pytest.approx(100.0)
    engine = overhead.main_table(runs)[0]
    assert engine["vs_vllm"] == 0.5 and engine["cpu_vs_vllm"] == 2.0
    sweep = overhead.sweep_table([run for group in runs.values() for run in group], num_prompts=8)
    assert [(row["row"], row["concurrency"]) for row in sweep] == [("this stack", 8)]
    printed = overhead.render(overhead.main_table(runs), sweep, [])
    assert "| this stack | 500 | 500-500 | 0.50x | - | 1000 | - | gateway 250, decode-0 750 | 100 |" in printed
    assert printed.endswith("no phase counters")


def test_each_row_shows_its_run_of_median_throughput_and_the_runs_range() -> None:
    # three bursts of 1,000 tokens in 2.0, 4.0 and 2.5 s: the median is the 2.5 s run, CPU and all
    bursts = [stack_run(2.0, 0.1), stack_run(4.0, 0.9), stack_run(2.5, 0.4)]
    capped = [stack_run(1.0, concurrency=16), stack_run(0.5, concurrency=16)]
    row = overhead.main_table({"this stack": bursts})[0]
    assert row["output_tok_s"] == 400.0 and row["output_tok_s_range"] == [250.0, 500.0]
    assert row["cpu_us_per_token.gateway"] == pytest.approx(400.0)
    sweep = overhead.sweep_table(capped + bursts, num_prompts=64)
    assert [(r["concurrency"], r["output_tok_s"], r["output_tok_s_range"]) for r in sweep] == [
        (16, 1000.0, [1000.0, 2000.0]), (64, 400.0, [250.0, 500.0])]  # of two, the slower middle one
    printed = overhead.render(overhead.main_table({"this stack": bursts}), sweep, [])
    assert "| this stack | 16 | 1000 | 1000-2000 | 1000 | 100 | 0 |" in printed


def test_the_rounds_repeat_the_burst_then_each_cap_with_fresh_prompts_of_the_same_lengths() -> None:
    vocab = np.arange(1000)
    requests = build_workload(WorkloadSpec("random", 8, input_len=8, output_len=4), vocab, 0)
    args = overhead.build_parser().parse_args(["--num-prompts", "8", "--concurrency", "2,4,8", "--repeats", "2"])
    loads = overhead.rounds(requests, vocab, args)
    assert [cap for cap, _ in loads] == [None, 2, 4, None, 2, 4]  # a cap of every prompt is the burst
    assert loads[0][1] is requests
    prompts = [tuple(map(tuple, (r.prompt for r in load))) for _, load in loads]
    assert len(set(prompts)) == len(loads)
    lengths = [(r.num_prompt_tokens, r.max_tokens) for r in requests]
    assert all([(r.num_prompt_tokens, r.max_tokens) for r in load] == lengths for _, load in loads)


def test_repeats_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--repeats", "0"])
    assert "--repeats is the runs of each row, at least 1, got 0" in capsys.readouterr().err


def test_bad_concurrency_caps_are_named() -> None:
    assert overhead.concurrency_caps("64,16,64") == [16, 64]
    for text, bad in (("16,x", "'x'"), ("0", "'0'"), ("16,,64", "''")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"got {bad} in"):
            overhead.concurrency_caps(text)
