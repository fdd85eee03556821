"""Offline engine benchmark: continuous batching vs static batching of this engine vs transformers.

    python -m bench.engine [--num-requests 64] [--hf-batch-size 16] [--dtype auto]

One fixed, seeded, mixed-length workload (prompts of 32-1,024 tokens, outputs of 16-256 with
ignore_eos), run in one process on the same machine three ways: this engine with continuous
batching; this engine with static batching (batches of --hf-batch-size in arrival order, each
queued together and run to completion before the next); transformers generate on the same
batches. Prints output tokens/s of each and their ratios, and KV utilisation: slots holding
live tokens over slots allocated, for paged blocks and for reserving each request's maximum
length up front.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.hf_export import hf_checkpoint
from bench.result_files import RESULTS_DIR, save_result
from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel, load_model
from shared.settings import (
    EngineSettings,
    KVCacheSettings,
    KVReservation,
    ModelSettings,
    SchedulerSettings,
)

PROGRESS_EVERY_S = 5.0


@dataclass(slots=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class EngineResult:
    seconds: float
    output_tokens: int
    steps: int
    kv_utilization: float  # mean over steps of slots holding live tokens / slots the engine allocated
    reserved_kv_utilization: float  # the same, had each running request reserved prompt + max_tokens
    preemptions: int
    running_per_step: list[int]  # requests that ran in each step

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def peak_running(self) -> int:
        return max(self.running_per_step)

    @property
    def mean_running(self) -> float:
        return sum(self.running_per_step) / len(self.running_per_step)

    def summary(self) -> dict[str, object]:
        """The figures for a JSON report: every field but the per-step series, and what derives from them."""
        figures = asdict(self)
        del figures["running_per_step"]
        return figures | {"tokens_per_s": self.tokens_per_s, "peak_running": self.peak_running,
                          "mean_running": self.mean_running}


def make_workload(num_requests: int, seed: int, vocab_size: int, prompt_lens: tuple[int, int] = (32, 1024),
                  output_lens: tuple[int, int] = (16, 256)) -> list[WorkItem]:
    """Random-token prompts and output lengths, each uniform over its inclusive range."""
    for name, (low, high) in (("prompt", prompt_lens), ("output", output_lens)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} lengths {low}-{high}: the range must satisfy 1 <= min <= max")
    rng = random.Random(seed)
    # skip the low ids, where the special tokens live
    return [
        WorkItem([rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
        for _ in range(num_requests)
    ]


def batches(work: list[WorkItem], size: int) -> Iterator[list[WorkItem]]:
    """Static batches in arrival order."""
    for b in range(0, len(work), size):
        yield work[b : b + size]


def run_engine(engine: Engine, work: list[WorkItem], label: str, batch_size: int | None = None) -> EngineResult:
    """Continuous batching: the whole workload queued at once. With `batch_size`: static batching,
    each batch queued together and stepped until the engine is idle before the next is queued."""
    max_len = {f"bench-{i}": len(w.prompt_token_ids) + w.max_tokens for i, w in enumerate(work)}
    utilization, reserved, running_per_step = [], [], []
    output_tokens = 0
    start = last_report = time.perf_counter()
    first = 0
    for batch in batches(work, batch_size or len(work)):
        for i, item in enumerate(batch, start=first):
            engine.add_request(f"bench-{i}", item.prompt_token_ids, SamplingParams(
                max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True))
        first += len(batch)
        while engine.has_unfinished:
            outputs = engine.step()
            output_tokens += len(outputs)
            running = engine.scheduler.running
            # those that finished in this step ran in it too
            running_per_step.append(len(running) + sum(out.is_finished for out in outputs))
            live = sum(r.num_computed_tokens for r in running)
            if live:
                allocated = sum(len(engine.kv_cache.blocks(r.req_id)) for r in running) * engine.block_size
                utilization.append(live / allocated)
                reserved.append(live / sum(max_len[r.req_id] for r in running))
            if time.perf_counter() - last_report >= PROGRESS_EVERY_S:
                last_report = time.perf_counter()
                print(f"  {label}: {last_report - start:.0f}s, step {len(running_per_step)}, {output_tokens} tokens "
                      f"out, {len(running)} running, {len(engine.scheduler.waiting)} waiting", file=sys.stderr)
    seconds = time.perf_counter() - start
    engine.check_invariants()
    return EngineResult(
        seconds=seconds,
        output_tokens=output_tokens,
        steps=len(running_per_step),
        kv_utilization=sum(utilization) / len(utilization),
        reserved_kv_utilization=sum(reserved) / len(reserved),
        preemptions=engine.stats().num_preemptions,
        running_per_step=running_per_step,
    )


@torch.inference_mode()
def run_hf_static(model_path: Path, work: list[WorkItem], batch_size: int, dtype: torch.dtype) -> tuple[float, int]:
    """transformers generate, batches in arrival order, each padded to its longest prompt and output."""
    from transformers import AutoModelForCausalLM

    # the cached folder of the same weights: transformers reads a GGUF in about 20 s on 2 cores
    model = AutoModelForCausalLM.from_pretrained(hf_checkpoint(model_path), dtype=dtype).eval()
    pad = 0
    useful = 0
    start = time.perf_counter()
    for n, batch in enumerate(batches(work, batch_size), start=1):
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.tensor([[pad] * (width - len(w.prompt_token_ids)) + w.prompt_token_ids for w in batch])
        mask = torch.tensor([[0] * (width - len(w.prompt_token_ids)) + [1] * len(w.prompt_token_ids) for w in batch])
        longest = max(w.max_tokens for w in batch)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       pad_token_id=pad)
        useful += sum(w.max_tokens for w in batch)
        print(f"  transformers batch {n}: {time.perf_counter() - start:.0f}s", file=sys.stderr)
    return time.perf_counter() - start, useful


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model, engine and workload flags that the offline engine benchmarks share."""
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)


def workload_from_args(args: argparse.Namespace, loaded: LoadedModel) -> tuple[list[WorkItem], dict[str, object]]:
    """The workload the flags describe, and its description for a JSON report."""
    prompt_lens, output_lens = (args.min_prompt_len, args.max_prompt_len), (args.min_output_len, args.max_output_len)
    work = make_workload(args.num_requests, args.seed, loaded.config.vocab_size, prompt_lens, output_lens)
    print(f"workload: {len(work)} requests, {sum(len(w.prompt_token_ids) for w in work)} prompt tokens, "
          f"{sum(w.max_tokens for w in work)} output tokens; torch threads {torch.get_num_threads()}", file=sys.stderr)
    return work, {"num_requests": len(work), "seed": args.seed, "prompt_lens": prompt_lens, "output_lens": output_lens}


def make_engine(args: argparse.Namespace, loaded: LoadedModel, kv_memory_bytes: int,
                kv_reservation: KVReservation = "paged") -> Engine:
    """A fresh engine (so no run finds another's prompts in its prefix cache) on the CPU."""
    return Engine(EngineSettings(
        model=ModelSettings(path=args.model, dtype=args.dtype, device="cpu"),
        kv_cache=KVCacheSettings(memory_bytes=kv_memory_bytes),
        scheduler=SchedulerSettings(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                    kv_reservation=kv_reservation),
    ), loaded)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(parser)
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of both static runs")
    parser.add_argument("--kv-memory-gib", type=float, default=2.0)
    parser.add_argument("--skip-hf", action="store_true", help="only run this engine")
    parser.add_argument("--result-json", type=Path, default=RESULTS_DIR / "engine.json")
    args = parser.parse_args(argv)

    loaded = load_model(args.model)
    work, workload = workload_from_args(args, loaded)
    kv_memory_bytes = int(args.kv_memory_gib * 2**30)
    engine = make_engine(args, loaded, kv_memory_bytes)
    dtype = engine.dtype
    ours = run_engine(engine, work, "continuous")
    del engine  # its KV pool, before the next one takes as much
    static = run_engine(make_engine(args, loaded, kv_memory_bytes), work, "static", args.hf_batch_size)
    continuous_over_static = ours.tokens_per_s / static.tokens_per_s
    report: dict[str, object] = {
        "workload": workload, "dtype": str(dtype), "engine": ours.summary(),
        "engine_static": static.summary() | {"batch_size": args.hf_batch_size},
        "continuous_over_static": continuous_over_static,
    }
    rows = [("this engine, continuous batching (paged KV)", ours.tokens_per_s),
            (f"this engine, static batches of {args.hf_batch_size}", static.tokens_per_s)]
    ratios = [("continuous / static batching, this engine", continuous_over_static)]
    if not args.skip_hf:
        hf_seconds, hf_tokens = run_hf_static(loaded.path, work, args.hf_batch_size, dtype)
        hf_tps = hf_tokens / hf_seconds
        speedup, static_speedup = ours.tokens_per_s / hf_tps, static.tokens_per_s / hf_tps
        report |= {"transformers_static": {"seconds": hf_seconds, "output_tokens": hf_tokens,
                                           "batch_size": args.hf_batch_size, "tokens_per_s": hf_tps},
                   "speedup": speedup, "static_over_transformers": static_speedup}
        rows.append((f"transformers generate, static batches of {args.hf_batch_size}", hf_tps))
        ratios += [("this engine continuous / transformers", speedup),
                   ("this engine static / transformers (same batches)", static_speedup)]
    print(f"\ndtype {dtype}\n\n| engine | output tokens/s |\n|---|---|")
    for name, tps in rows:
        print(f"| {name} | {tps:.1f} |")
    print()
    for name, ratio in ratios:
        print(f"{name}: {ratio:.2f}x")
    print(f"KV utilisation (live / allocated slots), continuous run: paged {ours.kv_utilization:.1%}, "
          f"reserving max length {ours.reserved_kv_utilization:.1%}; {ours.steps} steps, {ours.preemptions} preemptions")
    save_result(args.result_json, report)


if __name__ == "__main__":
    main()
