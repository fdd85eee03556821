"""The measurements of `bench.overhead`, one kind of run each: this engine alone (in this process),
vLLM's engine alone (a script in vLLM's interpreter), and a served run against this stack or vLLM's
server, each with the CPU time of every process it involves and the phase counters they keep.

    this_engine(model, dtype, request_sets, warmups) -> list[Run]          # one run per set of requests
    vllm_engine(python, model, dtype, kv_gib, request_sets, warmups) -> list[Run]
    this_stack(model, dtype, loads, warmups) -> list[Run]                  # one run per load in `loads`
    vllm_serve(python, model, dtype, kv_gib, loads, warmups) -> list[Run]

Each builds its engine or server once and runs the sets or loads one after another on it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch

from bench import vllm_offline
from bench.hf_export import hf_checkpoint
from bench.phase_counters import PhaseCounters, engine_phases, read_phases
from bench.proc_cpu import cpu_delta, sample_trees
from bench.servers import vllm_environment, vllm_server
from bench.serving.runner import LoadSpec
from bench.serving.workload import BenchRequest
from bench.stack_harness import run_load, scrape_metrics, stack_config, warm_up, worker_metrics_by_id
from bench.vllm_offline import MARKER
from services.launcher import Stack
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams

VLLM_SCRIPT = Path(vllm_offline.__file__)
LOG_TAIL_LINES = 20
ERROR_LINES = 10
# each served run in order: the client's cap on requests in flight (None: all at once), the requests it sends
Loads = list[tuple[int | None, list[BenchRequest]]]


@dataclass(slots=True)
class Run:
    system: str  # "this engine alone", "vLLM engine alone", "this stack", "vLLM server"
    concurrency: int | None  # the client's cap on requests in flight; None: the whole burst at once
    seconds: float
    output_tokens: int
    failed: int
    cpu_s: dict[str, float]  # process (with its descendants) -> CPU seconds in the run
    client_cpu_s: float | None = None  # this process sending the requests and reading the streams
    phases: dict[str, PhaseCounters] = field(default_factory=dict)  # process -> its counters' growth

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def cpu_us_per_token(self) -> dict[str, float]:
        return {name: seconds * 1e6 / max(self.output_tokens, 1) for name, seconds in self.cpu_s.items()}


def this_engine(
    model: str, dtype: str, request_sets: list[list[BenchRequest]], warmups: list[BenchRequest]
) -> list[Run]:
    """`LLM.generate` on every request of a set at once, detokenising as it goes, one set after
    another; the CPU time is this process's, every thread (torch's included)."""
    llm = LLM(model, dtype=dtype)
    llm.generate(*_offline_inputs(warmups))
    runs = []
    for requests in request_sets:
        before_phases, before_cpu = engine_phases(llm.engine), _own_cpu_s()
        started = time.perf_counter()
        outputs = llm.generate(*_offline_inputs(requests))
        seconds = time.perf_counter() - started
        cpu = {"engine (this process)": _own_cpu_s() - before_cpu}
        spent = engine_phases(llm.engine) - before_phases
        phases = {"engine": spent} if spent.seconds else {}
        output_tokens = sum(len(o.token_ids) for o in outputs)
        runs.append(Run("this engine alone", None, seconds, output_tokens, 0, cpu, phases=phases))
    return runs


def vllm_engine(
    python: Path, model: str, dtype: str, kv_gib: float, request_sets: list[list[BenchRequest]],
    warmups: list[BenchRequest],
) -> list[Run]:
    """`vllm.LLM.generate` in vLLM's interpreter (bench/vllm_offline.py) on each set in turn; the CPU
    time is its process tree's (vLLM runs its engine core in a child process)."""
    workload = {"model": str(hf_checkpoint(model)), "dtype": dtype,
                "runs": [_batch(requests) for requests in request_sets], "warmups": _batch(warmups)}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as spec:
        json.dump(workload, spec)
        spec.flush()
        env = vllm_environment(python, kv_gib, os.sched_getaffinity(0), dict(os.environ))
        # -P: the script's folder (bench/) stays off sys.path, so none of its modules shadows vLLM's imports
        with subprocess.Popen([str(python), "-P", str(VLLM_SCRIPT), spec.name], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process:
            assert process.stdin is not None and process.stdout is not None
            log: list[str] = []
            _read_marked(process, process.stdout, log)
            root = {"vLLM engine (process tree)": process.pid}
            runs = []
            for _ in request_sets:
                before = sample_trees(root)
                process.stdin.write("go\n")
                process.stdin.flush()
                result = json.loads(_read_marked(process, process.stdout, log))
                cpu = cpu_delta(before, sample_trees(root))
                runs.append(Run("vLLM engine alone", None, result["seconds"], result["output_tokens"], 0, cpu))
            process.stdin.close()
            process.wait()
    return runs


def this_stack(model: str, dtype: str, loads: Loads, warmups: list[BenchRequest]) -> list[Run]:
    """The stack with its defaults (gateway, one prefill and one decode worker, a private Redis);
    CPU time per process, phase counters from the gateway's and each worker's /metrics."""
    config = stack_config({})
    config.model, config.dtype = model, dtype
    with Stack(config) as stack:
        assert stack.base_url is not None
        urls = {"gateway": f"{stack.base_url}/metrics", **worker_metrics_by_id(stack, "prefill"),
                **worker_metrics_by_id(stack, "decode")}  # fmt: skip
        warm_up(stack.base_url, warmups)
        return [_served("this stack", stack.base_url, stack.process_ids(), urls, requests, cap)
                for cap, requests in loads]


def vllm_serve(
    python: Path, model: str, dtype: str, kv_gib: float, loads: Loads, warmups: list[BenchRequest]
) -> list[Run]:
    with vllm_server(python, model, kv_gib, getattr(torch, dtype)) as server:
        warm_up(server.base_url, warmups)
        roots = {"vLLM server (process tree)": server.process.pid}
        urls = {"vLLM server": f"{server.base_url}/metrics"}
        return [_served("vLLM server", server.base_url, roots, urls, requests, cap) for cap, requests in loads]


def _served(
    system: str, base_url: str, roots: Mapping[str, int], metrics_urls: Mapping[str, str],
    requests: list[BenchRequest], cap: int | None,
) -> Run:
    # scrapes stay outside the CPU window: answering them is not serving
    phases_before = {name: read_phases(scrape_metrics(url)) for name, url in metrics_urls.items()}
    cpu_before, client_before = sample_trees(roots), _own_cpu_s()
    print(f"{system}, concurrency {cap or 'burst'}:", file=sys.stderr)
    metrics, _ = run_load(base_url, requests, LoadSpec(max_concurrency=cap))
    client_cpu_s = _own_cpu_s() - client_before
    cpu = cpu_delta(cpu_before, sample_trees(roots))
    phases = {name: read_phases(scrape_metrics(url)) - phases_before[name] for name, url in metrics_urls.items()}
    return Run(system, cap, metrics.duration_s, metrics.total_output_tokens, metrics.num_failed, cpu, client_cpu_s,
               {name: spent for name, spent in phases.items() if spent.seconds})


def _read_marked(process: subprocess.Popen[str], stdout: IO[str], log: list[str]) -> str:
    """The next line the script marks, keeping vLLM's log lines before it for the error if it exits."""
    for line in stdout:
        if line.startswith(MARKER):
            return line.removeprefix(MARKER).strip()
        log.append(line)
    process.wait()
    # the root cause sits far above the tail, among the engine core's and its worker's tracebacks
    errors = list(dict.fromkeys(line for line in log if "Error:" in line))[:ERROR_LINES]
    raise SystemExit(f"vLLM's offline engine ({VLLM_SCRIPT.name}) exited with {process.returncode}; its errors:\n"
                     f"{''.join(errors)}the end of its log:\n{''.join(log[-LOG_TAIL_LINES:])}")


def _offline_inputs(requests: list[BenchRequest]) -> tuple[list[list[int]], list[SamplingParams]]:
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    return [_ids(r) for r in requests], params


def _batch(requests: list[BenchRequest]) -> dict[str, list]:
    """Requests as bench/vllm_offline.py reads them."""
    return {"prompts": [_ids(r) for r in requests], "max_tokens": [r.max_tokens for r in requests]}


def _ids(request: BenchRequest) -> list[int]:
    assert isinstance(request.prompt, list), "the overhead workload sends token ids"
    return request.prompt


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
