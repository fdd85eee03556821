"""KV cache dtypes at equal KV memory: capacity, throughput, step time, handoff bytes, quality.

    python -m bench.kv_dtype [--kv-dtypes auto,bfloat16,fp8_e4m3,fp8_e5m2,int8] [--dtype float32]

For each `LLMD_KV_CACHE__DTYPE`, with the model in --dtype and a KV pool of the same bytes
(--kv-tokens tokens of the model's own dtype):

- blocks in the pool, and on bench.engine's seeded workload (sized to overfill the pool) the peak
  of requests running at once, preemptions and output tokens/s;
- the best decode step time of --decode-batch requests at each of --contexts tokens of context
  (128 and 4,096);
- handoff bytes per request: what `Engine.read_blocks` gives a prefill worker to send for a
  prompt of --handoff-tokens tokens (8-bit blocks with their scales);
- quality against the model's own dtype on the engine-parity prompts (tests/engine/
  test_engine_parity.py's lengths, 1 to 1,500 tokens), --quality-tokens greedy tokens each: the
  share of tokens identical before each prompt's first divergence, the share identical overall
  (position by position), and the mean |difference| of the chosen tokens' logprobs before the
  first divergence;
- the round-trip error of real K/V (the float pool after those prompts) under this module's
  scale per row (token and kv head) and two block-wide alternatives: a scale per block and kv
  head from the whole block (known only once it is full) and one fixed by the block's first
  token, later values clipped.

Prints one table (plus the scale comparison) and writes JSON to --result-json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from bench.engine import make_workload, run_engine
from bench.result_files import RESULTS_DIR, save_result
from kernels.kv_quant import FORMATS, KVFormat, dequantize, kv_format, quantize
from shared.engine.engine import Engine, resolve_dtype
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel, load_model
from shared.model.runner import kv_block_bytes
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings, SchedulerSettings
from shared.text.tokenizer import Tokenizer
from tests.engine.test_engine_parity import PROMPT_LENGTHS
from tests.model.reference import TEXT

def make_engine(loaded: LoadedModel, args: argparse.Namespace, kv_dtype: str, memory: int, max_num_seqs: int = 64,
                budget: int = 2048) -> Engine:
    return Engine(EngineSettings(
        model=ModelSettings(path=args.model, dtype=args.dtype, device="cpu"),  # type: ignore[arg-type]
        kv_cache=KVCacheSettings(memory_bytes=memory, dtype=kv_dtype, enable_prefix_caching=False),  # type: ignore[arg-type]
        scheduler=SchedulerSettings(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
    ), loaded)


def decode_step_ms(loaded: LoadedModel, args: argparse.Namespace, kv_dtype: str, context: int) -> float:
    """Best of 5 decode steps of --decode-batch requests holding `context` tokens each."""
    fmt = kv_format(kv_dtype, resolve_dtype(args.dtype, torch.device("cpu")))
    blocks = args.decode_batch * (-(-(context + 16) // 16))
    engine = make_engine(loaded, args, kv_dtype, blocks * kv_block_bytes(loaded.config, 16, fmt),
                         max_num_seqs=args.decode_batch, budget=max(2048, context))
    rng = random.Random(0)
    for i in range(args.decode_batch):
        engine.add_request(str(i), [rng.randrange(1000, 20000) for _ in range(context)],
                           SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in [*engine.scheduler.running, *engine.scheduler.waiting]):
        engine.step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def greedy_runs(loaded: LoadedModel, args: argparse.Namespace, kv_dtype: str, prompts: list[list[int]]
                ) -> tuple[list[list[int]], list[list[float]], Engine]:
    """Tokens and their logprobs for each prompt, one engine, all prompts at once."""
    fmt = kv_format(kv_dtype, resolve_dtype(args.dtype, torch.device("cpu")))
    engine = make_engine(loaded, args, kv_dtype, 1024 * kv_block_bytes(loaded.config, 16, fmt))
    params = SamplingParams(max_tokens=args.quality_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
            logprobs[out.req_id].extend(out.new_logprobs or [])
    return list(tokens.values()), list(logprobs.values()), engine


def agreement(base: tuple[list[list[int]], list[list[float]]], other: tuple[list[list[int]], list[list[float]]]
              ) -> dict[str, float]:
    prefix = same = total = 0
    diffs: list[float] = []
    for tokens, lps, other_tokens, other_lps in zip(*base, *other):
        n = next((i for i, (a, b) in enumerate(zip(tokens, other_tokens)) if a != b), len(tokens))
        prefix += n
        same += sum(a == b for a, b in zip(tokens, other_tokens))
        total += len(tokens)
        diffs.extend(abs(a - b) for a, b in zip(lps[:n], other_lps[:n]))
    return {"prefix_agreement": prefix / total, "overall_agreement": same / total,
            "logprob_mean_abs_diff": sum(diffs) / len(diffs)}


def scale_policy_errors(pool: torch.Tensor, fmt: KVFormat, num_blocks: int = 64) -> dict[str, float]:
    """Relative RMS error of a float pool's real K/V (its first `num_blocks` written blocks) under three scales."""
    used = (pool.abs().amax(dim=(0, 1, 3, 4, 5)) > 0).nonzero().squeeze(1)[:num_blocks]
    x = pool[:, :, used].float()  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    assert fmt.max_value is not None

    def with_scale(scale: torch.Tensor) -> torch.Tensor:
        codes = (x / scale).clamp(-fmt.max_value, fmt.max_value)
        codes = codes.round() if fmt.dtype == torch.int8 else codes.to(fmt.dtype).float()
        return codes * scale

    def error(approx: torch.Tensor) -> float:
        return float((approx - x).norm() / x.norm())

    per_block = x.abs().amax(dim=(3, 5), keepdim=True) / fmt.max_value  # whole block, per kv head
    first_token = x[:, :, :, :1].abs().amax(dim=5, keepdim=True) / fmt.max_value
    return {"per_row": error(dequantize(quantize(x, fmt), fmt, torch.float32)),
            "per_block": error(with_scale(per_block.clamp_min(1e-30))),
            "per_block_first_token_clipped": error(with_scale(first_token.clamp_min(1e-30)))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--kv-dtypes", default="auto,bfloat16,fp8_e4m3,fp8_e5m2,int8")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="the pool: this many tokens of the model's dtype")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--prompt-lens", default="256,1024", help="min,max prompt tokens of the workload")
    parser.add_argument("--output-lens", default="64,256", help="min,max output tokens of the workload")
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--contexts", default="128,4096", help="contexts of the decode step times, in tokens")
    parser.add_argument("--handoff-tokens", type=int, default=1000)
    parser.add_argument("--quality-tokens", type=int, default=64)
    parser.add_argument("--result-json", type=Path, default=RESULTS_DIR / "kv_dtype.json")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]

    loaded = load_model(args.model)
    model_dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    memory = args.kv_tokens // 16 * kv_block_bytes(loaded.config, 16, model_dtype)
    # by default the widest format's 8k tokens of pool hold a tenth of the 96 requests at once
    prompt_lens, output_lens = (tuple(int(n) for n in lens.split(",")) for lens in (args.prompt_lens, args.output_lens))
    work = make_workload(args.num_requests, 0, loaded.config.vocab_size, prompt_lens, output_lens)  # type: ignore[arg-type]
    tokenizer = Tokenizer.from_path(str(loaded.path))
    corpus = tokenizer.encode(TEXT * 40, add_special_tokens=False)
    prompts = [corpus[(i * 37) % 400:][:n] for i, n in enumerate(PROMPT_LENGTHS)]
    print(f"model {model_dtype}, KV pool {memory / 2**20:.1f} MiB; torch threads {torch.get_num_threads()}",
          file=sys.stderr)

    results: dict[str, dict[str, object]] = {}
    base: tuple[list[list[int]], list[list[float]]] | None = None
    for kv_dtype in args.kv_dtypes.split(","):
        fmt = kv_format(kv_dtype, model_dtype)
        engine = make_engine(loaded, args, kv_dtype, memory)
        run = run_engine(engine, work, kv_dtype)
        tokens, logprobs, quality_engine = greedy_runs(loaded, args, kv_dtype, prompts)
        row: dict[str, object] = {
            "format": fmt.name, "blocks": engine.stats().kv.num_blocks, "peak_running": run.peak_running,
            "preemptions": run.preemptions, "output_tokens_per_s": run.tokens_per_s,
            "handoff_bytes": math.prod(engine.kv_blocks_shape(-(-args.handoff_tokens // 16))) * engine.kv_dtype.itemsize,
            **{f"decode_step_ms_{c}": decode_step_ms(loaded, args, kv_dtype, c) for c in contexts},
        }
        if base is None:  # the first KV dtype (auto: the model's) is the reference
            base = (tokens, logprobs)
            if not fmt.is_scaled:
                pool = quality_engine.runner.kv_cache
                row["scale_policies"] = {f.name: scale_policy_errors(pool, f) for f in FORMATS.values() if f.is_scaled}
        else:
            row |= agreement(base, (tokens, logprobs))
        results[kv_dtype] = row
        print(f"  {kv_dtype}: {json.dumps({k: v for k, v in row.items() if k != 'scale_policies'})}", file=sys.stderr)

    steps = " | ".join(f"step ms @{c}" for c in contexts)
    print(f"\n| KV dtype | blocks | peak running | output tok/s | {steps} | handoff bytes ({args.handoff_tokens} tokens) "
          "| greedy same before divergence | same overall | logprob mean abs diff |")
    print("|---|---|---|---|" + "---|" * len(contexts) + "---|---|---|---|")
    for kv_dtype, r in results.items():
        quality = (f"{r['prefix_agreement']:.1%} | {r['overall_agreement']:.1%} | {r['logprob_mean_abs_diff']:.4f}"
                   if "prefix_agreement" in r else "(reference) | | ")
        print(f"| {kv_dtype} ({r['format']}) | {r['blocks']} | {r['peak_running']} | {r['output_tokens_per_s']:.1f} | "
              + "".join(f"{r[f'decode_step_ms_{c}']:.1f} | " for c in contexts)
              + f"{r['handoff_bytes'] / 2**20:.2f} MiB | {quality} |")
    policies = next(iter(results.values())).get("scale_policies", {})
    print("\n| 8-bit format | K/V relative RMS error: scale per row (used) | per block and kv head | "
          "per block from its first token, clipped |\n|---|---|---|---|")
    for name, e in policies.items():  # type: ignore[union-attr]
        print(f"| {name} | {e['per_row']:.4f} | {e['per_block']:.4f} | {e['per_block_first_token_clipped']:.4f} |")
    save_result(args.result_json, {"model_dtype": str(model_dtype), "kv_bytes": memory,
                                   "num_requests": args.num_requests, "results": results})


if __name__ == "__main__":
    main()
