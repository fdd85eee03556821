from __future__ import annotations

import pytest
import torch

from kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref, write_kv_cache_triton
from kernels.kv_quant import FORMATS

NUM_BLOCKS = 6


def _caches(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


def _new_kv(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """key and value as strided views into a fused qkv projection output, as the model makes them."""
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    return qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_dim"), [(16, 1, 64), (32, 3, 128), (16, 8, 64)])
def test_triton_matches_ref(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            triton_device: str) -> None:
    key, value = _new_kv(5, 4, num_kv_heads, head_dim, dtype, triton_device)
    # slots straddle a block boundary and skip around blocks
    slot_mapping = torch.tensor(
        [block_size - 1, block_size, 3 * block_size + 2, 0, NUM_BLOCKS * block_size - 1], device=triton_device
    )
    k_cache, v_cache = _caches(block_size, num_kv_heads, head_dim, dtype, triton_device)
    k_ref, v_ref = _caches(block_size, num_kv_heads, head_dim, dtype, triton_device)
    write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    write_kv_cache_ref(key, value, k_ref, v_ref, slot_mapping)
    _assert_same(k_cache, k_ref)
    _assert_same(v_cache, v_ref)


def test_ref_writes_exactly_the_mapped_slots() -> None:
    key, value = _new_kv(3, 2, 2, 64, torch.float32)
    k_cache, v_cache = _caches(16, 2, 64, torch.float32)
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([17, 2, 95]))
    for i, (block_id, offset) in enumerate([(1, 1), (0, 2), (5, 15)]):
        assert torch.equal(k_cache[block_id, offset], key[i]) and torch.equal(v_cache[block_id, offset], value[i])
    assert int(k_cache.isnan().all(dim=(2, 3)).sum()) == NUM_BLOCKS * 16 - 3


@pytest.mark.parametrize("slot", [-1, NUM_BLOCKS * 16])
def test_out_of_range_slot_raises_value_error(slot: int) -> None:
    key, value = _new_kv(1, 2, 2, 64, torch.float32)
    k_cache, v_cache = _caches(16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match=f"must lie in \\[0, {NUM_BLOCKS * 16}\\)"):
        write_kv_cache(key, value, k_cache, v_cache, torch.tensor([slot]))


def test_mismatched_dtype_raises_value_error() -> None:
    key, _ = _new_kv(1, 2, 2, 64, torch.float32)
    k_cache, v_cache = _caches(16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="dtypes differ"):
        write_kv_cache(key, key.bfloat16(), k_cache, v_cache, torch.tensor([0]))


def test_float32_values_go_into_a_bf16_cache_rounded() -> None:
    key, value = _new_kv(1, 2, 2, 64, torch.float32)
    k_cache, v_cache = _caches(16, 2, 64, torch.bfloat16)
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([0]), FORMATS["bfloat16"])
    assert torch.equal(k_cache[0, 0], key[0].bfloat16()) and torch.equal(v_cache[0, 0], value[0].bfloat16())
