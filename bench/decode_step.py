"""Decode step time against batch size, and where the time goes.

    python -m bench.decode_step [--dtype auto] [--batch-sizes 1,16,64] [--context 256] [--float32-linears]

For each batch size: prefill that many random prompts of `--context` tokens, then time decode
steps (best of 5) and print tokens/s, and the share of a step in each of its phases (the
engine's own counters, shared/engine/step_phases.py: scheduling, input preparation, the layers,
the LM head, sampling, the scheduler's update, the outputs), and so the share outside the model's
own operators. For the
largest batch, print the torch profiler's top operators by self CPU time. `--float32-linears`
drops the GGUF's block copies of the weights, so every linear layer runs on the float32 ones
(the step as it was before `kernels.quantized_linear`).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_phases import FORWARD, LOGITS, PHASES
from shared.model.loader import LoadedModel, load_model
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings, SchedulerSettings


def free_decode(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def decode_engine(
    loaded: LoadedModel, dtype: str, batch_size: int, context: int,
    params_of: Callable[[int], SamplingParams] = free_decode,
) -> Engine:
    """An engine decoding `batch_size` random prompts of `context` tokens, request i with params_of(i)."""
    engine = Engine(EngineSettings(
        model=ModelSettings(dtype=dtype, device="cpu"),  # type: ignore[arg-type]
        kv_cache=KVCacheSettings(memory_bytes=2**30),
        scheduler=SchedulerSettings(max_num_batched_tokens=max(2048, batch_size * context), max_num_seqs=batch_size),
    ), loaded)
    rng = random.Random(0)
    for i in range(batch_size):
        engine.add_request(str(i), [rng.randrange(1000, 20000) for _ in range(context)], params_of(i))
    # prompts may take a step each (shared/engine/policy/prompt_order.py): step until every request has its
    # first token, so the steps timed are decode steps
    started: set[str] = set()
    while len(started) < batch_size:
        started.update(out.req_id for out in engine.step() if out.new_token_ids)
    engine.step()
    return engine


def best_step_seconds(engine: Engine, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return min(times)


def phase_ms(engine: Engine, steps: int = 3) -> dict[str, float]:
    """Milliseconds per step in each phase of Engine.step, from the engine's own counters."""
    before = dict(engine.phases.seconds)
    for _ in range(steps):
        engine.step()
    return {phase: (engine.phases.seconds[phase] - before[phase]) * 1e3 / steps for phase in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 on CPUs with native bf16, else float32 (as the workers choose)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--float32-linears", action="store_true",
                        help="ignore the GGUF's Q4_1/Q8_0 blocks: every product reads the float32 weights")
    args = parser.parse_args()
    loaded = load_model(None)
    if args.float32_linears:
        loaded = dataclasses.replace(loaded, quantized={})
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"| batch | step ms | tokens/s | {' | '.join(PHASES)} | outside the model |")
    print("|---" * (len(PHASES) + 4) + "|")
    for bs in batch_sizes:
        engine = decode_engine(loaded, args.dtype, bs, args.context)
        seconds = best_step_seconds(engine)
        phases = phase_ms(engine)
        step_ms = sum(phases.values())
        # what the model's own operators (the layers and the LM head) do not account for
        outside = 1 - (phases[FORWARD] + phases[LOGITS]) / step_ms
        shares = " | ".join(f"{100 * ms / step_ms:.1f}%" for ms in phases.values())
        print(f"| {bs} | {seconds * 1e3:.1f} | {bs / seconds:.0f} | {shares} | {100 * outside:.1f}% |")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
