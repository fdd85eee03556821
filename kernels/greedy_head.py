"""Greedy tokens from the last hidden states through a float32 LM head, without the logits:
csrc/greedy_head.c through ctypes.

The reference is `(hidden @ weight.T).max(dim=-1).indices`: the first index of each row's largest
logit (`reference_argmax`). The kernel sums each logit in order of the hidden index with fused
multiply-adds, so where two logits lie within a few units in the last place of each other it may
pick the other; NaN logits never win. Built on first use for this CPU (see `kernels.cpu_build`);
where it cannot be built, `load()` logs why once and callers keep their own path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import CSRC, load_functions, profiled

SOURCE = CSRC / "greedy_head.c"
ROWS = 8  # hidden rows per tile: the kernel takes a multiple of it
_INT64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "greedy_head_lanes": [],  # vocabulary rows per packed panel: one vector register's floats
    "greedy_head_pack": [_PTR, _PTR, _INT64, _INT64],  # packed, weight, vocab, hidden
    "greedy_head_argmax": [_PTR, _PTR, _INT64, _INT64, _PTR, _INT64],  # out, x, rows, hidden, packed, vocab
}


@functools.cache
def load() -> ctypes.CDLL | None:
    return load_functions(SOURCE, ("-fno-math-errno", "-fno-trapping-math"), "the greedy LM head", _SIGNATURES)


def reference_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(hidden, weight.t()).max(dim=-1).indices


class PackedHead:
    """An LM head's weight (float32 [vocab, hidden] on the CPU), packed for `argmax`: a copy of its size."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"the greedy head takes a float32 [vocab, hidden] weight on the CPU, got "
                             f"{weight.dtype} {list(weight.shape)} on {weight.device}")
        lib = _built()
        self.vocab, self.hidden = weight.shape
        weight = weight.contiguous()
        lanes = lib.greedy_head_lanes()
        self._packed = torch.empty(-(-self.vocab // lanes) * self.hidden * lanes)
        lib.greedy_head_pack(self._packed.data_ptr(), weight.data_ptr(), self.vocab, self.hidden)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows] int64: the first index of each row's largest logit, -1 where none is above -inf.
        hidden: float32 [rows, hidden size] on the CPU."""
        if hidden.dtype != torch.float32 or hidden.dim() != 2 or hidden.shape[1] != self.hidden:
            raise ValueError(f"the greedy head takes float32 [rows, {self.hidden}], got {hidden.dtype} "
                             f"{list(hidden.shape)}")
        rows = hidden.shape[0]
        padded = -(-rows // ROWS) * ROWS
        x = hidden.contiguous() if padded == rows else torch.cat([hidden, hidden.new_zeros(padded - rows, self.hidden)])
        out = torch.empty(padded, dtype=torch.int64)
        with profiled("greedy_head"):
            failed = _built().greedy_head_argmax(out.data_ptr(), x.data_ptr(), padded, self.hidden,
                                                 self._packed.data_ptr(), self.vocab)
        if failed:
            raise MemoryError(f"the greedy head could not allocate its scratch for {padded} rows")
        return out[:rows]


def _built() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"the greedy head kernel is not built (see the warning logged for {SOURCE})")
    return lib
