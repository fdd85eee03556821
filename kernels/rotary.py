"""Rotary position embedding, NeoX / HF "rotate_half" convention, rounding where HF's does."""

from __future__ import annotations

import torch

from kernels import _triton, cpu_layer_ops
from kernels._triton import jit, tl
from kernels.kv_cache_write import check_kv_cache_args, write_kv_cache
from kernels.kv_quant import KVFormat, unscaled_format


@jit
def _rotary_kernel(
    out_ptr, x_ptr, positions_ptr, cos_sin_ptr,
    stride_out_t, stride_out_h, stride_x_t, stride_x_h, stride_cos_sin,
    NUM_HEADS: tl.constexpr, HALF_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, BLOCK_HALF)
    offs_h = tl.arange(0, BLOCK_H)
    d_mask = offs_d < HALF_DIM
    # HF casts cos and sin to the model dtype before multiplying
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + offs_d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF_DIM + offs_d, mask=d_mask, other=0.0)
    sin = sin.to(dtype).to(tl.float32)
    mask = (offs_h[:, None] < NUM_HEADS) & d_mask[None, :]
    x_offs = token * stride_x_t + offs_h[:, None] * stride_x_h + offs_d[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    # each product is rounded to the model dtype before the sum, as in HF's bf16 arithmetic
    out1 = (x1 * cos[None, :]).to(dtype).to(tl.float32) - (x2 * sin[None, :]).to(dtype).to(tl.float32)
    out2 = (x2 * cos[None, :]).to(dtype).to(tl.float32) + (x1 * sin[None, :]).to(dtype).to(tl.float32)
    out_offs = token * stride_out_t + offs_h[:, None] * stride_out_h + offs_d[None, :]
    tl.store(out_ptr + out_offs, out1.to(dtype), mask=mask)
    tl.store(out_ptr + out_offs + HALF_DIM, out2.to(dtype), mask=mask)


def _check_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [num_tokens, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} must equal q dtype {q.dtype}")
    if positions.shape != (num_tokens,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{num_tokens}], got {positions.dtype} {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32:
        raise ValueError(
            f"cos_sin_cache must be float32 [max_positions, {head_dim}], "
            f"got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}"
        )


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x * cat(c, c) + rotate_half(x) * cat(s, s), written on halves; bitwise the same as HF's
    # apply_rotary_pos_emb since x1*c + (-x2)*s and x1*c - x2*s round identically
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, heads, head_dim // 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache[positions]  # [num_tokens, head_dim]
    cos, sin = cos_sin.to(q.dtype)[:, None, :].chunk(2, dim=-1)  # [num_tokens, 1, head_dim // 2] each
    return _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)


def _rotate_triton(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty_like(x)
    if num_tokens > 0:
        _triton.launch(
            _rotary_kernel, (num_tokens,),
            out, x, positions, cos_sin_cache,
            out.stride(0), out.stride(1), x.stride(0), x.stride(1), cos_sin_cache.stride(0),
            NUM_HEADS=num_heads, HALF_DIM=head_dim // 2,
            BLOCK_H=_triton.next_power_of_2(num_heads), BLOCK_HALF=_triton.next_power_of_2(head_dim // 2),
        )
    return out


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(q, k, positions, cos_sin_cache)
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    return _rotate_triton(q, positions, cos_sin_cache), _rotate_triton(k, positions, cos_sin_cache)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim].

    `cos_sin_cache[p]` is cat(cos(p * inv_freq), sin(p * inv_freq)) in float32. Returns new
    tensors equal to HF's apply_rotary_pos_emb.
    """
    if q.is_cuda:
        return apply_rotary_triton(q, k, positions, cos_sin_cache)
    _check_args(q, k, positions, cos_sin_cache)
    return apply_rotary_ref(q, k, positions, cos_sin_cache)


def rotate_and_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_format: KVFormat | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary(q, k, ...)`, then `write_kv_cache` of the rotated k and of v in `kv_format`
    (default: the cache's dtype); returns the rotated (q, k). On the CPU, float32 and bfloat16
    with contiguous last dims run both in one call of the C kernel of `kernels.cpu_layer_ops`,
    which rotates q and k in place."""
    kv_format = kv_format or unscaled_format(k_cache.dtype)
    if q.is_cuda or not (cpu_layer_ops.supports(q) and _unit_last_strides(q, k, v, k_cache, v_cache)):
        q, k = apply_rotary(q, k, positions, cos_sin_cache)
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_format)
        return q, k
    _check_args(q, k, positions, cos_sin_cache)
    check_kv_cache_args(k, v, k_cache, v_cache, slot_mapping, kv_format)
    if not (positions.is_contiguous() and slot_mapping.is_contiguous() and cos_sin_cache.is_contiguous()):
        raise ValueError("positions, slot_mapping and cos_sin_cache must be contiguous")
    cpu_layer_ops.rotate_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, kv_format)
    return q, k


def _unit_last_strides(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)
