"""The model's linear layers alone: over the GGUF's blocks against oneDNN's packed float32, by rows.

    python -m bench.linear_products [--rows 1,4,8,16,24,32,64]

For each row count, runs every Q4_1 / Q8_0 matrix of the default model once, back to back on
its own weights (so, as in a decode step, each product reads its weights from memory rather
than from cache), through `kernels.quantized_linear` and through the oneDNN-packed float32
weight that `shared.model.linear.Linear` keeps; prints the best of 5 passes (of two tries)
each, in ms. Where the two cross is where `QUANTIZED_MAX_ROWS` belongs on this machine.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kernels import quantized_linear
from shared.model.linear import Linear, onednn_packing_available
from shared.model.loader import load_model


def best_pass_ms(run: Callable[[], None], passes: int = 5, tries: int = 2) -> float:
    run()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        for _ in range(passes):
            run()
        best = min(best, (time.perf_counter() - start) / passes * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,24,32,64")
    args = parser.parse_args(argv)
    if quantized_linear.load() is None:
        raise SystemExit("the quantized linear kernel did not build here (see the warning above)")
    loaded = load_model(None)
    if not loaded.quantized:
        raise SystemExit(f"{loaded.path} has no Q4_1 / Q8_0 matrices")
    pack = onednn_packing_available(torch.float32, torch.device("cpu"))
    pairs = [(blocks, Linear(loaded.weights[name], None, pack)) for name, blocks in loaded.quantized.items()]
    print(f"{len(pairs)} matrices, {sum(b.num_bytes() for b, _ in pairs) / 1e6:.0f} MB of blocks, "
          f"{'oneDNN-packed' if pack else 'F.linear'} float32 beside them")
    print("| rows | blocks ms | float32 ms |")
    print("|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k) for k in {b.in_features for b, _ in pairs}}

        def over_blocks() -> None:
            for blocks, _ in pairs:
                quantized_linear.quantized_linear(inputs[blocks.in_features], blocks, None)

        def over_float32() -> None:
            for blocks, linear in pairs:
                linear(inputs[blocks.in_features])

        print(f"| {rows} | {best_pass_ms(over_blocks):.1f} | {best_pass_ms(over_float32):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
