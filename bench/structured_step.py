"""Decode step time with none, half and all of the batch under a JSON-schema constraint.

    python -m bench.structured_step [--batch-size 32] [--context 256] [--dtype auto] [--repeats 30]

The constrained requests follow a schema whose answer is long (a list of at least 200 strings), so
none finishes during the measurement; the others decode freely with ignore_eos (bench.decode_step's
engine). Each row is the best of `--repeats` steps, taken in turn with the other rows; the
difference to the first row is what the constrained rows add: their masks' fill (xgrammar, one
matcher per row), the masks' application in the sampler and the matchers' advance. The best of many
interleaved steps filters out the spells when other work holds the cores.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from bench.decode_step import best_step_seconds, decode_engine, free_decode
from shared.engine.constraint import StructuredSpec
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import load_model

LONG_LIST = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
             "required": ["items"]}  # fmt: skip


def params_with(num_constrained: int) -> Callable[[int], SamplingParams]:
    spec = StructuredSpec("json_schema", json.dumps(LONG_LIST))

    def params_of(i: int) -> SamplingParams:
        if i >= num_constrained:
            return free_decode(i)
        return SamplingParams(max_tokens=64, temperature=0.0, structured=spec)

    return params_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30, help="at most 60: the requests' max_tokens is 64")
    args = parser.parse_args()
    loaded = load_model(None)
    bs = args.batch_size
    print(f"| constrained rows (of {bs}) | step ms | vs none |")
    print("|---|---|---|")
    engines = {n: decode_engine(loaded, args.dtype, bs, args.context, params_with(n)) for n in (0, bs // 2, bs)}
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(args.repeats):  # interleaved, so that a busy spell on the machine hits every row alike
        for n, engine in engines.items():
            best[n] = min(best[n], best_step_seconds(engine, 1))
    for n, engine in engines.items():
        assert len(engine.scheduler.running) == bs, "a request finished during the measurement"
        print(f"| {n} | {best[n] * 1e3:.1f} | {best[n] / best[0]:.3f}x |")


if __name__ == "__main__":
    main()
