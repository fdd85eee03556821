"""Scatter new tokens' keys and values into the paged KV cache."""

from __future__ import annotations

import torch

from kernels import _triton
from kernels._triton import jit, tl
from kernels.kv_quant import KVFormat, to_cache, triton_constants, triton_store_rows, unscaled_format


@jit
def _write_kv_cache_kernel(
    k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, slot_mapping_ptr,
    block_size,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_t, stride_kc_h, stride_vc_b, stride_vc_t, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SCALED: tl.constexpr, KV: tl.constexpr, KV_MAX: tl.constexpr, KV_MANT: tl.constexpr, KV_BIAS: tl.constexpr,
    KV_SUB_STEP: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    block_id = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < NUM_KV_HEADS
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    key = tl.load(key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :], mask=mask,
                  other=0.0)
    value = tl.load(value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :],
                    mask=mask, other=0.0)
    k_rows = block_id * stride_kc_b + offset * stride_kc_t + offs_h * stride_kc_h  # [BLOCK_H]
    v_rows = block_id * stride_vc_b + offset * stride_vc_t + offs_h * stride_vc_h
    triton_store_rows(k_cache_ptr, k_rows, key, offs_d, mask, h_mask, HEAD_DIM, SCALED, KV, KV_MAX, KV_MANT, KV_BIAS)
    triton_store_rows(v_cache_ptr, v_rows, value, offs_d, mask, h_mask, HEAD_DIM, SCALED, KV, KV_MAX, KV_MANT,
                      KV_BIAS)


def check_kv_cache_args(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_format: KVFormat,
) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            "key and value must be [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    row = (key.shape[1], kv_format.row_elements(key.shape[2]))
    if tuple(k_cache.shape[2:]) != row:
        raise ValueError(f"cache heads/row {tuple(k_cache.shape[2:])} do not match key {tuple(key.shape[1:])} "
                         f"in {kv_format.name} (rows of {row[1]})")
    if key.dtype != value.dtype:
        raise ValueError(f"key/value dtypes differ: {key.dtype}, {value.dtype}")
    if not k_cache.dtype == v_cache.dtype == kv_format.storage_dtype:
        raise ValueError(f"a {kv_format.name} cache is stored as {kv_format.storage_dtype}, got k_cache "
                         f"{k_cache.dtype} and v_cache {v_cache.dtype}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )


def write_kv_cache_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_format: KVFormat | None = None,
) -> None:
    kv_format = kv_format or unscaled_format(k_cache.dtype)
    block_size = k_cache.shape[1]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[block_ids, offsets] = to_cache(key, kv_format)
    v_cache[block_ids, offsets] = to_cache(value, kv_format)


def write_kv_cache_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_format: KVFormat | None = None,
) -> None:
    kv_format = kv_format or unscaled_format(k_cache.dtype)
    check_kv_cache_args(key, value, k_cache, v_cache, slot_mapping, kv_format)
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _triton.launch(
        _write_kv_cache_kernel, (num_tokens,),
        k_cache, v_cache, key, value, slot_mapping,
        k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=_triton.next_power_of_2(num_kv_heads), BLOCK_D=_triton.next_power_of_2(head_dim),
        **triton_constants(kv_format),
    )


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_format: KVFormat | None = None,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at `slot_mapping` in place, in
    `kv_format` (default: plain values in the cache's dtype; see `kernels.kv_quant`).

    Slot s is offset s % block_size of block s // block_size. Slots must be distinct and in
    range; the range is checked on CPU only, since on CUDA it would cost a device sync.
    """
    kv_format = kv_format or unscaled_format(k_cache.dtype)
    if key.is_cuda:
        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping, kv_format)
        return
    check_kv_cache_args(key, value, k_cache, v_cache, slot_mapping, kv_format)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel():
        low, high = int(slot_mapping.min()), int(slot_mapping.max())
        if low < 0 or high >= num_slots:
            raise ValueError(f"slot_mapping values must lie in [0, {num_slots}), got min {low} max {high}")
    write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping, kv_format)
