"""Offline engine benchmark: continuous batching on paged KV vs transformers' static batching.

    python -m bench.engine [--num-requests 64] [--hf-batch-size 16] [--dtype auto]

One fixed, seeded, mixed-length workload (prompts of 32-1,024 tokens, outputs of 16-256 with
ignore_eos), run in one process on the same machine by both engines. Prints output tokens/s of
each and their ratio, and KV utilisation: slots holding live tokens over slots allocated, for
paged blocks and for reserving each request's maximum length up front.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import load_model
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings, SchedulerSettings


@dataclass(slots=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class EngineResult:
    seconds: float
    output_tokens: int
    steps: int
    paged_kv_utilization: float
    reserved_kv_utilization: float
    preemptions: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(num_requests: int, seed: int, vocab_size: int) -> list[WorkItem]:
    rng = random.Random(seed)
    # skip the low ids, where the special tokens live
    return [
        WorkItem([rng.randrange(100, vocab_size) for _ in range(rng.randint(32, 1024))], rng.randint(16, 256))
        for _ in range(num_requests)
    ]


def run_engine(engine: Engine, work: list[WorkItem]) -> EngineResult:
    for i, item in enumerate(work):
        engine.add_request(f"bench-{i}", item.prompt_token_ids, SamplingParams(
            max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True))
    max_len = {f"bench-{i}": len(w.prompt_token_ids) + w.max_tokens for i, w in enumerate(work)}
    paged, reserved = [], []
    output_tokens = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished:
        output_tokens += len(engine.step())
        steps += 1
        running = engine.scheduler.running
        live = sum(r.num_computed_tokens for r in running)
        if live:
            paged.append(live / (sum(len(engine.kv_cache.blocks(r.req_id)) for r in running) * engine.block_size))
            reserved.append(live / sum(max_len[r.req_id] for r in running))
        if steps % 20 == 0:
            print(f"  step {steps}: {output_tokens} tokens out, {len(running)} running", file=sys.stderr)
    seconds = time.perf_counter() - start
    engine.check_invariants()
    return EngineResult(
        seconds=seconds,
        output_tokens=output_tokens,
        steps=steps,
        paged_kv_utilization=sum(paged) / len(paged),
        reserved_kv_utilization=sum(reserved) / len(reserved),
        preemptions=engine.stats().num_preemptions,
    )


@torch.inference_mode()
def run_hf_static(model_path: Path, work: list[WorkItem], batch_size: int, dtype: torch.dtype) -> tuple[float, int]:
    """transformers generate, batches in arrival order, each padded to its longest prompt and output."""
    from transformers import AutoModelForCausalLM

    folder, file = (model_path.parent, model_path.name) if model_path.suffix == ".gguf" else (model_path, None)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype).eval()
    pad = 0
    useful = 0
    start = time.perf_counter()
    for b in range(0, len(work), batch_size):
        batch = work[b : b + batch_size]
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.tensor([[pad] * (width - len(w.prompt_token_ids)) + w.prompt_token_ids for w in batch])
        mask = torch.tensor([[0] * (width - len(w.prompt_token_ids)) + [1] * len(w.prompt_token_ids) for w in batch])
        longest = max(w.max_tokens for w in batch)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       pad_token_id=pad)
        useful += sum(w.max_tokens for w in batch)
        print(f"  transformers batch {b // batch_size + 1}: {time.perf_counter() - start:.0f}s", file=sys.stderr)
    return time.perf_counter() - start, useful


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-memory-gib", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="only run this engine")
    parser.add_argument("--result-json", type=Path, default=Path("bench/results/engine.json"))
    args = parser.parse_args(argv)

    loaded = load_model(args.model)
    settings = EngineSettings(
        model=ModelSettings(path=args.model, dtype=args.dtype, device="cpu"),
        kv_cache=KVCacheSettings(memory_bytes=int(args.kv_memory_gib * 2**30)),
        scheduler=SchedulerSettings(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
    )
    engine = Engine(settings, loaded)
    work = make_workload(args.num_requests, args.seed, loaded.config.vocab_size)
    print(f"workload: {len(work)} requests, {sum(len(w.prompt_token_ids) for w in work)} prompt tokens, "
          f"{sum(w.max_tokens for w in work)} output tokens; dtype {engine.dtype}; torch threads "
          f"{torch.get_num_threads()}", file=sys.stderr)
    ours = run_engine(engine, work)
    report: dict[str, object] = {"workload": {"num_requests": len(work), "seed": args.seed}, "dtype": str(engine.dtype),
                                 "engine": asdict(ours) | {"tokens_per_s": ours.tokens_per_s}}
    rows = [("this engine (continuous batching, paged KV)", ours.tokens_per_s)]
    if not args.skip_hf:
        del engine
        hf_seconds, hf_tokens = run_hf_static(loaded.path, work, args.hf_batch_size, getattr(torch, str(
            report["dtype"]).removeprefix("torch.")))
        report["transformers_static"] = {"seconds": hf_seconds, "output_tokens": hf_tokens,
                                         "batch_size": args.hf_batch_size, "tokens_per_s": hf_tokens / hf_seconds}
        rows.append((f"transformers generate, static batches of {args.hf_batch_size}", hf_tokens / hf_seconds))
        report["speedup"] = ours.tokens_per_s / (hf_tokens / hf_seconds)
    print("\n| engine | output tokens/s |\n|---|---|")
    for name, tps in rows:
        print(f"| {name} | {tps:.1f} |")
    if "speedup" in report:
        print(f"\nspeedup over static batching: {report['speedup']:.2f}x")
    print(f"KV utilisation (live / allocated slots): paged {ours.paged_kv_utilization:.1%}, "
          f"reserving max length {ours.reserved_kv_utilization:.1%}; {ours.steps} steps, {ours.preemptions} preemptions")
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
