"""Gumbel-max sampling over the whole vocabulary on the CPU: csrc/gumbel_argmax.c through ctypes.

The reference is `shared.engine.sampler`'s `gumbel_noise` followed by an argmax; this is the
same computation in one pass (see the C file for where their bits may differ). Built on first
use for this CPU (see `kernels.cpu_build`); where it cannot be built, `load()` logs why once and
the sampler keeps the reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import CSRC, load_functions, profiled

SOURCE = CSRC / "gumbel_argmax.c"
# no contraction into fused multiply-adds: every CPU computes the same noise, so a request's
# tokens do not depend on the host that sampled them
COMPILE_FLAGS = ("-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")
_INT64, _INT32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
# out, scores, their row stride, keys, rows, vocab, vocab salt
_SIGNATURES = {"gumbel_argmax": [_PTR, _PTR, _INT64, _PTR, _INT64, _INT32, _INT64]}


@functools.cache
def load() -> ctypes.CDLL | None:
    return load_functions(SOURCE, COMPILE_FLAGS, "Gumbel-max sampling on the CPU", _SIGNATURES)


def gumbel_argmax(scores: torch.Tensor, keys: torch.Tensor, vocab_salt: int) -> torch.Tensor:
    """[rows] int64: argmax over v of scores[r, v] + the Gumbel noise of (keys[r], v).

    scores: float32 [rows, vocab] on the CPU, last dim contiguous; keys: int64 [rows] holding
    uint32 values; vocab_salt: the sampler's salt of vocab ids.
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"the Gumbel-max kernel is not built (see the warning logged for {SOURCE})")
    rows = scores.shape[0]
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(1) != 1 or scores.device.type != "cpu":
        raise ValueError(
            f"the Gumbel-max kernel takes float32 [rows, vocab] on the CPU with a contiguous last dim, got "
            f"{scores.dtype} {list(scores.shape)} with strides {scores.stride()} on {scores.device}"
        )
    if keys.dtype != torch.int64 or keys.shape != (rows,) or not keys.is_contiguous():
        raise ValueError(f"keys must be contiguous int64 [{rows}], got {keys.dtype} {list(keys.shape)}")
    out = torch.empty(rows, dtype=torch.int64)
    with profiled("llmd::gumbel_argmax"):
        failed = lib.gumbel_argmax(
            out.data_ptr(), scores.data_ptr(), scores.stride(0), keys.data_ptr(), rows, scores.shape[1], vocab_salt
        )
    if failed:
        raise ValueError("a row of scores has no finite value to sample")
    return out
