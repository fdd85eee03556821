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
    # best, best ids, scores, their row stride, rows, columns, the columns' offset in the vocabulary
    "argmax_fold": [_PTR, _PTR, _PTR, _INT64, _INT64, _INT32, _INT64],
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


def argmax_fold(best: torch.Tensor, best_ids: torch.Tensor, scores: torch.Tensor, offset: int) -> None:
    """Folds a slice of each row's scores, the vocabulary's columns [offset, offset + columns), into
    the row's running maximum `best` (float32 [rows]) and its first index `best_ids` (int64 [rows]),
    in place: over slices taken in order of offset, from -inf and -1, `best_ids` ends as `argmax`
    over the whole rows would give it (-1 where a row has no value above -inf)."""
    lib = _built("argmax")
    _check_scores(scores, "argmax")
    rows = scores.shape[0]
    for name, tensor, dtype in (("best", best, torch.float32), ("best_ids", best_ids, torch.int64)):
        if tensor.dtype != dtype or tensor.shape != (rows,) or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype} [{rows}], got {tensor.dtype} {list(tensor.shape)}")
    lib.argmax_fold(best.data_ptr(), best_ids.data_ptr(), scores.data_ptr(), scores.stride(0), rows,
                    scores.shape[1], offset)


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
