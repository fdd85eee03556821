"""The model's linear layers alone: over the GGUF's blocks against oneDNN's packed weights, by rows.

    python -m bench.linear_products [--rows 1,4,8,16,24,32,64] [--dtype float32|bfloat16]

For each row count, runs every Q4_1 / Q8_0 matrix of the default model once, back to back on
its own weights (so, as in a decode step, each product reads its weights from memory rather
than from cache), through `kernels.quantized_linear` and through the oneDNN-packed float32
weight that `shared.model.linear.Linear` keeps; prints the best of 5 passes (of two tries)
each, in ms. Where the two cross is where `QUANTIZED_MAX_ROWS` belongs on this machine.
`--dtype bfloat16`: bfloat16 inputs and weights, and the blocks rounded to them, as a bfloat16
model runs them: through `kernels.quantized_linear.quantized_linear_bf16` on a CPU with AVX512-BF16
and no AMX (`BF16_KERNEL_MAX_ROWS`, on OMP_NUM_THREADS=1 `BF16_KERNEL_MAX_ROWS_ONE_THREAD`),
elsewhere the float32 kernel (`QUANTIZED_MAX_ROWS_BF16`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kernels import quantized_linear
from shared.model.linear import Linear, bf16_kernel_applies, onednn_packing_available
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
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if quantized_linear.load() is None:
        raise SystemExit("the quantized linear kernel did not build here (see the warning above)")
    loaded = load_model(None)
    if not loaded.quantized:
        raise SystemExit(f"{loaded.path} has no Q4_1 / Q8_0 matrices")
    pack = onednn_packing_available(dtype, torch.device("cpu"))
    pairs = [(blocks, Linear(loaded.weights[name].to(dtype), None, pack)) for name, blocks in loaded.quantized.items()]
    print(f"{len(pairs)} matrices, {sum(b.num_bytes() for b, _ in pairs) / 1e6:.0f} MB of blocks, "
          f"{'oneDNN-packed' if pack else 'F.linear'} {args.dtype} beside them")
    print(f"| rows | blocks ms | {args.dtype} ms |")
    print("|---:|---:|---:|")
    bf16 = dtype == torch.bfloat16
    bf16_kernel = bf16_kernel_applies(dtype)
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k).to(dtype) for k in {b.in_features for b, _ in pairs}}

        def over_blocks() -> None:
            # as `Linear` calls them for a bfloat16 model: x widened, the weights rounded, y rounded back
            for blocks, _ in pairs:
                x = inputs[blocks.in_features]
                if bf16_kernel:
                    quantized_linear.quantized_linear_bf16(x, blocks, None)
                elif bf16:
                    quantized_linear.quantized_linear(x.float(), blocks, None, bf16_weights=True).bfloat16()
                else:
                    quantized_linear.quantized_linear(x, blocks, None)

        def over_packed() -> None:
            for blocks, linear in pairs:  # built without the blocks: every row count runs the packed weight
                linear(inputs[blocks.in_features])

        print(f"| {rows} | {best_pass_ms(over_blocks):.1f} | {best_pass_ms(over_packed):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
