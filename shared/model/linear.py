"""y = x W^T + b, with W packed once for oneDNN where that is faster than plain F.linear.

On the CPU in float32, F.linear calls MKL, which on the 2-core AMD EPYC of
docs/benchmarks.md runs the LM head (49152 x 576) 2.3x slower at batch 64, and the MLP's
gate/up projection 2x slower at batch 16, than oneDNN with the weight reordered once into
its blocked layout; no shape measured was slower by more than a few microseconds. So the
weights are packed at load and every call goes through oneDNN's linear. In bfloat16 on a CPU
with native bf16 (AMX) the packed weight is also faster: 1.4-2x at decode batches 1-64
on a 2-core Xeon with AMX (the LM head 1.9x at batch 64), even at prefill sizes of
512-2048 rows. Elsewhere (CUDA, bf16 emulated, a torch without those ops) the plain
weight and F.linear are used.

oneDNN sums in another order than MKL, so logits differ from transformers' (which uses
F.linear) by float rounding (about 1e-5); greedy output stays token-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return ops._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class Linear:
    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        """`weight` [out_features, in_features]; `pack` reorders it for oneDNN (CPU float32, or bf16 where native)."""
        self.bias = bias
        self.packed = pack
        # the packed copy replaces the plain one: keeping both would double the weights' memory
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def num_bytes(self) -> int:
        tensors = [self.weight] + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in tensors)
