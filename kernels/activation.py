"""SwiGLU activation: silu(gate) * up on the fused gate_up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _triton, cpu_layer_ops
from kernels._triton import jit, tl


@jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr,
    stride_out, stride_x,
    INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + token * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0).to(tl.float32)
    # HF rounds silu's result to the model dtype before the multiply
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + offs, (act * up).to(dtype), mask=mask)


def _check_args(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate_size], got {tuple(x.shape)}")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # [num_tokens, intermediate_size] each
    # silu on a contiguous gate: ATen's vectorised and scalar exp differ in the last bit, and
    # HF applies silu to the contiguous gate_proj output, so the same elements must take the
    # same path
    return F.silu(gate.contiguous()) * up


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    _check_args(x)
    if x.stride(1) != 1:
        raise ValueError(f"x needs a contiguous last dim, got strides {x.stride()}")
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    block = min(_triton.next_power_of_2(intermediate), 1024)
    if num_tokens > 0 and intermediate > 0:
        _triton.launch(
            _silu_and_mul_kernel, (num_tokens, _triton.cdiv(intermediate, block)),
            out, x, out.stride(0), x.stride(0),
            INTERMEDIATE=intermediate, BLOCK=block,
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, 2 * I] = cat(gate, up) -> silu(gate) * up [num_tokens, I].

    On the CPU, float32 and bfloat16 with a contiguous last dim run the C kernel of
    `kernels.cpu_layer_ops`, the rest the reference."""
    if x.is_cuda:
        return silu_and_mul_triton(x)
    _check_args(x)
    if cpu_layer_ops.supports(x) and x.stride(1) == 1:
        return cpu_layer_ops.silu_and_mul(x)
    return silu_and_mul_ref(x)
