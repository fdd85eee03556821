"""RMSNorm with an optional fused residual add, rounding exactly where HF's LlamaRMSNorm does."""

from __future__ import annotations

import torch

from kernels import _triton, cpu_layer_ops
from kernels._triton import jit, tl


@jit
def _rms_norm_kernel(
    out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr,
    eps,
    stride_out, stride_residual_out, stride_x, stride_residual,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0).to(tl.float32)
        # HF adds the residual in the model dtype, so the sum is rounded before it is normed
        x = (x + residual).to(dtype).to(tl.float32)
        tl.store(residual_out_ptr + row * stride_residual_out + offs, x.to(dtype), mask=mask)
    var = tl.sum(x * x, axis=0) / HIDDEN
    # correctly rounded sqrt and division, as torch.rsqrt on CPU, rather than rsqrt.approx
    h = x * tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = weight * h.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(dtype), mask=mask)


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dim, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} must be ({x.shape[-1]},) to match x {tuple(x.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal x dtype {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(x.dtype), x


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(x, weight, residual)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # [num_rows, hidden]
    if x2.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError(f"x and weight need a contiguous last dim, got strides {x.stride()} and {weight.stride()}")
    out = torch.empty_like(x2)
    if residual is None:
        residual2 = residual_out = x2
    else:
        residual2 = residual.reshape(-1, hidden)
        if residual2.stride(-1) != 1:
            raise ValueError(f"residual needs a contiguous last dim, got strides {residual.stride()}")
        residual_out = torch.empty_like(x2)
    if x2.shape[0] > 0:
        _triton.launch(
            _rms_norm_kernel, (x2.shape[0],),
            out, residual_out, x2, residual2, weight,
            eps,
            out.stride(0), residual_out.stride(0), x2.stride(0), residual2.stride(0),
            HIDDEN=hidden, BLOCK=_triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
            num_warps=4 if hidden <= 4096 else 8,
        )
    residual_out = x if residual is None else residual_out.view(x.shape)
    return out.view(x.shape), residual_out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(normed, residual_out)`; with `residual`, the norm is taken of `x + residual`.

    `residual_out` is the norm's input (the sum when `residual` is given, else `x` itself),
    which the next layer adds its output to. On the CPU, 2-D float32 and bfloat16 inputs with a
    contiguous last dim run the C kernel of `kernels.cpu_layer_ops`, the rest the reference.
    """
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps, residual)
    _check_args(x, weight, residual)
    if x.dim() == 2 and cpu_layer_ops.supports(x) and _unit_last_strides(x, weight, residual):
        return cpu_layer_ops.rms_norm(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def _unit_last_strides(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.stride(-1) == 1 for t in tensors)
