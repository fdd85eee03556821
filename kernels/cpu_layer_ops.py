"""A Llama layer's small operators on the CPU (float32, bfloat16): csrc/layer_ops.c through ctypes.

RMSNorm with the residual add, rotary embedding with the KV cache write, and silu(gate) * up,
one call each instead of five to fifteen PyTorch operators; at decode batch sizes those calls
are what the operators cost. Built on first use for this CPU (see `kernels.cpu_build`). The
arguments are checked by the dispatching functions (`kernels.rms_norm.rms_norm`,
`kernels.rotary.rotate_and_write_kv`, `kernels.activation.silu_and_mul`), which call these
only where `supports` says so.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import CSRC, load_functions
from kernels.kv_quant import KVFormat

SOURCE = CSRC / "layer_ops.c"
# exact IEEE arithmetic: no fused multiply-adds, no reassociation, so the rotary embedding
# rounds exactly as the PyTorch reference does; no errno or trap semantics to keep, so sqrt
# and the comparisons vectorise
COMPILE_FLAGS = ("-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-mprefer-vector-width=512")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_INT64, _INT32, _PTR, _FLOAT = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [
        _PTR, _INT64, _PTR, _INT64,  # out, residual_out, each with its row stride
        _PTR, _INT64, _PTR, _INT64,  # x, residual (or NULL)
        _PTR, _INT64, _INT32, _FLOAT, _INT32,  # weight, rows, hidden, eps, dtype code
    ],
    "rotary_kv_write": [
        _PTR, _INT64, _INT64,  # q, strides (token, head)
        _PTR, _INT64, _INT64,  # k
        _PTR, _INT64, _INT64,  # v
        _PTR, _PTR, _INT64, _INT64,  # positions, cos_sin_cache, its row stride, its rows
        _PTR, _INT64, _INT64, _INT64,  # k_cache, strides (block, token, head)
        _PTR, _INT64, _INT64, _INT64,  # v_cache
        _PTR, _INT64, _INT64,  # slot_mapping, slots in the cache, tokens
        _INT32, _INT32, _INT32, _INT32, _INT32, _INT32,  # heads, kv heads, head_dim, block_size, dtype, cache format
    ],
    "silu_and_mul": [_PTR, _INT64, _PTR, _INT64, _INT64, _INT32, _INT32],  # out, x (row strides), rows, I, dtype
}
_OUT_OF_RANGE = {3: "slot_mapping", 4: "positions"}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None (logged once) where it cannot be built."""
    return load_functions(SOURCE, COMPILE_FLAGS, "RMSNorm, rotary and SwiGLU on the CPU", _SIGNATURES)


def supports(x: torch.Tensor) -> bool:
    """Whether these kernels take tensors like `x` (CPU, float32 or bfloat16), with the library built."""
    return x.device.type == "cpu" and x.dtype in DTYPE_CODES and load() is not None


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"the CPU layer kernels are not built (see the warning logged for {SOURCE})")
    return lib


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(x + residual), x + residual) for 2-D x with a contiguous last dim."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    residual_out = x if residual is None else torch.empty_like(x)
    _lib().rms_norm(
        out.data_ptr(), out.stride(0), residual_out.data_ptr(), residual_out.stride(0),
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(), rows, hidden, eps, DTYPE_CODES[x.dtype],
    )
    return out, residual_out


def rotate_and_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_format: KVFormat,
) -> None:
    """Rotate q and k in place, then store k and v at their slots in `kv_format`; shapes as in
    `kernels.rotary`."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    failed = _lib().rotary_kv_write(
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1),
        positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        k_cache.data_ptr(), *k_cache.stride()[:3],
        v_cache.data_ptr(), *v_cache.stride()[:3],
        slot_mapping.data_ptr(), num_blocks * block_size, num_tokens,
        num_heads, num_kv_heads, head_dim, block_size, DTYPE_CODES[q.dtype], kv_format.code,
    )
    if failed:
        name = _OUT_OF_RANGE[failed]
        values = slot_mapping if name == "slot_mapping" else positions
        limit = num_blocks * block_size if name == "slot_mapping" else cos_sin_cache.shape[0]
        raise ValueError(
            f"{name} values must lie in [0, {limit}), got min {int(values.min())} max {int(values.max())}"
        )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [rows, 2 * I] with a contiguous last dim -> silu(x[:, :I]) * x[:, I:]."""
    rows, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, intermediate), dtype=x.dtype)
    _lib().silu_and_mul(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), rows, intermediate,
                        DTYPE_CODES[x.dtype])
    return out
