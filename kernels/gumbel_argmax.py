"""Gumbel-max sampling over the whole vocabulary on the CPU, and greedy decoding's plain argmax:
csrc/gumbel_argmax.c through ctypes.

The reference of `gumbel_argmax` is `shared.engine.sampler`'s `gumbel_noise` followed by an argmax;
this is the same computation in one pass (see the C file for where their bits may differ). The
reference of `argmax` is torch's `max(dim=-1).indices`, to the index. Built on first
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
_SIGNATURES = {
    "gumbel_argmax": [_PTR, _PTR, _INT64, _PTR, _INT64, _INT32, _INT64],
    "argmax_rows": [_PTR, _PTR, _INT64, _INT64, _INT32],  # out, scores, their row stride, rows, vocab
}


@functools.cache
def load() -> ctypes.CDLL | None:
    return load_functions(SOURCE, COMPILE_FLAGS, "Gumbel-max sampling on the CPU", _SIGNATURES)


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """[rows] int64: the first index of each row's largest score, as `scores.max(dim=-1).indices`
    gives it where no score is NaN. scores: float32 [rows, vocab] on the CPU, last dim contiguous."""
    lib = _built("argmax")
    _check_scores(scores, "argmax")
    out = torch.empty(scores.shape[0], dtype=torch.int64)
    if lib.argmax_rows(out.data_ptr(), scores.data_ptr(), scores.stride(0), scores.shape[0], scores.shape[1]):
        raise ValueError("a row of scores has no value above -inf (or only NaN)")
    return out


def _built(kernel: str) -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"the {kernel} kernel is not built (see the warning logged for {SOURCE})")
    return lib


def _check_scores(scores: torch.Tensor, kernel: str) -> None:
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(1) != 1 or scores.device.type != "cpu":
        raise ValueError(
            f"the {kernel} kernel takes float32 [rows, vocab] on the CPU with a contiguous last dim, got "
            f"{scores.dtype} {list(scores.shape)} with strides {scores.stride()} on {scores.device}"
        )


def gumbel_argmax(scores: torch.Tensor, keys: torch.Tensor, vocab_salt: int) -> torch.Tensor:
    """[rows] int64: argmax over v of scores[r, v] + the Gumbel noise of (keys[r], v).

    scores: float32 [rows, vocab] on the CPU, last dim contiguous; keys: int64 [rows] holding
    uint32 values; vocab_salt: the sampler's salt of vocab ids.
    """
    lib = _built("Gumbel-max")
    rows = scores.shape[0]
    _check_scores(scores, "Gumbel-max")
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
