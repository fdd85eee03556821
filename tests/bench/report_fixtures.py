"""Small result documents in the shapes the benchmarks write, for tests/bench/test_bench_report.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

MACHINE = {"cpu": "Test CPU", "cores": 2, "isa": ["avx2"], "memory_gib": 8, "gpu": None, "torch": "2.13.0",
           "auto_dtype": "float32", "date": "2026-12-06", "commit": "abc1234"}


def _dist(p50: float, p99: float, mean: float | None = None) -> dict[str, Any]:
    return {"count": 10, "mean": mean if mean is not None else p50, "median": p50, "std": 1.0,
            "percentiles": {"p50": p50, "p99": p99, "p100": p99 * 2}}


def _metrics(tps: float, ttft_ms: float, itl_p99: float) -> dict[str, Any]:
    return {"output_throughput": tps, "ttft_ms": _dist(ttft_ms, ttft_ms * 2), "itl_ms": _dist(30.0, itl_p99),
            "num_failed": 0}


DOCUMENTS: dict[str, dict[str, Any]] = {
    "engine": {
        "workload": {"num_requests": 8, "seed": 0, "prompt_lens": [32, 512], "output_lens": [16, 64]},
        "dtype": "torch.float32", "continuous_over_static": 1.25,
        "engine": {"tokens_per_s": 50.0, "kv_utilization": 0.95, "reserved_kv_utilization": 0.8},
        "engine_static": {"tokens_per_s": 40.0, "batch_size": 16},
        "transformers_static": {"tokens_per_s": 10.0}, "speedup": 5.0, "static_over_transformers": 4.0,
    },
    "kv_reservation": {
        "workload": {"num_requests": 8}, "dtype": "torch.float32",
        "kv_pool": {"tokens": 1024, "bytes": 2**20 * 45, "block_size": 16},
        "policies": {p: {"peak_running": 5, "mean_running": 3.5, "kv_utilization": 0.9, "preemptions": 1,
                         "tokens_per_s": 20.0} for p in ("paged", "max_length")},
    },
    "kv_dtype": {
        "model_dtype": "torch.float32", "kv_bytes": 2**20 * 45, "num_requests": 8,
        "results": {
            "auto": {"format": "float32", "blocks": 64, "peak_running": 6, "output_tokens_per_s": 12.0,
                     "decode_step_ms_128": 40.0, "handoff_bytes": 2**20 * 44},
            "int8": {"format": "int8", "blocks": 240, "peak_running": 23, "output_tokens_per_s": 11.0,
                     "decode_step_ms_128": 18.0, "handoff_bytes": 2**20 * 12, "prefix_agreement": 0.86,
                     "logprob_mean_abs_diff": 0.0093},
        },
    },
    "prefix_cache": {
        "config": {"num_prompts": 16, "request_rate": 0.5, "num_groups": 4, "prefix_len": 512, "suffix_len": 32,
                   "output_len": 32},
        "summary": [{"prefix_caching": mode, "ttft_mean_ms": ms, "ttft_p50_ms": ms, "ttft_p99_ms": ms * 2,
                     "output_throughput_tok_s": 7.5, "prefix_cache_hit_rate": hit, "handoff_mib_per_request": 5.0}
                    for mode, ms, hit in (("off", 4000.0, 0.0), ("on", 500.0, 0.9))],
        "ttft_ratio_off_on": {"mean": 8.0, "p50": 8.0, "p99": 8.0},
    },
    "handoff_tcp": {
        "config": {"transport": "tcp", "stream_min_tokens": None},
        "summary": [{"prompt_tokens": n, "streamed": int(n >= 512), "kv_bytes_per_request": n * 23040,
                     "handoff_mean_s": s, "itl0_client_mean_s": 0.05, "ttft_client_mean_s": 0.5}
                    for n, s in ((128, 0.012), (4096, 0.008))],
    },
    "handoff_redis": {
        "config": {"transport": "redis", "stream_min_tokens": None},
        "summary": [{"prompt_tokens": n, "kv_bytes_per_request": n * 23040, "handoff_mean_s": s,
                     "itl0_client_mean_s": 0.2, "ttft_client_mean_s": 0.5} for n, s in ((128, 0.03), (4096, 0.7))],
    },
    "interference": {
        "config": {"num_short": 40, "short_input_len": 64, "short_min_tokens": 64, "short_max_tokens": 128, "rate": 1.0,
                   "num_long": 4, "long_input_len": 1024, "kv_transport": "auto"},
        "modes": {mode: {"short": {key: {"no_burst": _dist(30.0, 100.0), "during_burst": _dist(30.0, 100.0 * r),
                                         "ratio": {"p50": 1.0, "p99": r}}
                                   for key in ("itl_ms", "itl_after_first_gap_ms")},
                         "long": {"ttft_ms": _dist(2000.0, 4000.0)}}
                  for mode, r in (("disaggregated", 0.9), ("colocated", 20.0))},
    },
    "side_by_side": {
        "config": {"workload": "random", "num_prompts": 8, "request_rate": float("inf")},
        "runs": {"this stack (1P+1D)": {"metrics": _metrics(150.0, 20000.0, 170.0),
                                        "output_throughput_runs": [146.0, 150.0, 155.5]},
                 "vLLM CPU 0.32.0": {"metrics": _metrics(140.0, 15000.0, 3000.0)}},  # from before repeats
        "transformers": {"batch_size": 16, "output_throughput": 22.0},
    },
    "goodput": {
        "config": {"share": 0.9},
        "targets": {"ttft_ms": 1000.0, "itl_ms": 100.0, "itl_measure": "p90"},
        "runs": {label: [{"request_rate": r, "both": b} for r, b in points]
                 for label, points in (("disaggregated", ((1.0, 0.95), (2.0, 0.5))),
                                       ("vLLM CPU 0.32.0", ((1.0, 0.92), (2.0, 0.3))))},
        "goodput": {"disaggregated": 1.0, "vLLM CPU 0.32.0": 1.0},
    },
    "routing": {
        "config": {"conversations": 8, "turns": 4, "system_len": 1000, "user_len": 64},
        "modes": {mode: {"follow_up_hit_rate": hit, "follow_up_ttft_p50_ms": p50, "follow_up_ttft_p99_ms": p50 * 2,
                         "itl_p99_ms": 400.0, "kv_mib_per_follow_up": kv}
                  for mode, hit, p50, kv in (("2+2, off", 0.88, 1200.0, 2.8), ("2+2, on", 0.94, 575.0, 0.0),
                                             ("1+1, on", 0.94, 1000.0, 0.0))},
    },
    "overhead": {
        "table": [{"row": "this engine alone", "output_tok_s": 8267.0, "share_of_own_engine": None, "vs_vllm": None,
                   "cpu_us_per_token": 237.0, "cpu_vs_vllm": None, "cpu_us_per_token.engine": 237.0,
                   "client_cpu_us_per_token": None},
                  {"row": "this stack", "output_tok_s": 3783.0, "share_of_own_engine": 0.4576, "vs_vllm": None,
                   "cpu_us_per_token": 473.0, "cpu_vs_vllm": None, "cpu_us_per_token.prefill-0": 70.0,
                   "cpu_us_per_token.decode-0": 280.0, "cpu_us_per_token.gateway": 113.0,
                   "cpu_us_per_token.redis-server": 10.0, "client_cpu_us_per_token": 60.0}],
        "sweep": [], "phases": [],
    },
}


def write_results(folder: Path, names: list[str] | None = None, machine: dict[str, Any] | None = None) -> Path:
    """The fixtures (or those of `names`, in that order) as JSON files with a machine and a command."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names if names is not None else list(DOCUMENTS):
        document = copy.deepcopy(DOCUMENTS[name]) | {"machine": machine or MACHINE,
                                                      "command": f"python -m bench.{name}"}
        (folder / f"{name}.json").write_text(json.dumps(document))
    return folder
