from __future__ import annotations

import pytest
import torch

from kernels.rotary import apply_rotary, apply_rotary_ref, apply_rotary_triton

MAX_POSITIONS = 4096


def _cos_sin_cache(inv_freq: torch.Tensor, device: str = "cpu") -> torch.Tensor:
    freqs = torch.arange(MAX_POSITIONS, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)  # [max_pos, D]


def _inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _qkv_views(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k as strided views into one fused qkv projection output, as the model makes them."""
    gen = torch.Generator().manual_seed(num_tokens * 7 + head_dim)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen).to(device)
    return qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads], positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"), [(1, 4, 4, 64), (5, 9, 3, 64), (3, 8, 1, 128)]
)
def test_triton_matches_ref(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, triton_device: str
) -> None:
    q, k, positions = _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, triton_device)
    cache = _cos_sin_cache(_inv_freq(head_dim), triton_device)
    q_out, k_out = apply_rotary_triton(q, k, positions, cache)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache)
    # the same correctly rounded products and sums in the same order, without FMA contraction
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_is_bitwise_hf_apply_rotary_pos_emb(dtype: torch.dtype) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, num_tokens = 64, 11
    config = LlamaConfig(hidden_size=9 * head_dim, num_attention_heads=9, num_key_value_heads=3)
    rotary = LlamaRotaryEmbedding(config)
    q, k, positions = _qkv_views(num_tokens, 9, 3, head_dim, dtype)
    cos, sin = rotary(q, positions[None])  # [1, num_tokens, head_dim] each, in q's dtype
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = apply_rotary(q, k, positions, _cos_sin_cache(rotary.inv_freq))
    assert torch.equal(q_out, hf_q[0].transpose(0, 1))
    assert torch.equal(k_out, hf_k[0].transpose(0, 1))


def test_returns_new_tensors_and_leaves_inputs_alone() -> None:
    q, k, positions = _qkv_views(3, 4, 2, 64, torch.float32)
    q_before, k_before = q.clone(), k.clone()
    q_out, _ = apply_rotary(q, k, positions, _cos_sin_cache(_inv_freq(64)))
    assert q_out.data_ptr() != q.data_ptr()
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


@pytest.mark.parametrize(
    ("positions", "cache", "message"),
    [
        (torch.zeros(3, dtype=torch.int32), torch.zeros(8, 64), "positions must be int64 \\[3\\]"),
        (torch.zeros(3, dtype=torch.int64), torch.zeros(8, 32), "must be float32 \\[max_positions, 64\\]"),
        (torch.zeros(3, dtype=torch.int64), torch.zeros(8, 64, dtype=torch.float64), "cos_sin_cache must be float32"),
    ],
)
def test_bad_arguments_raise_value_error(positions: torch.Tensor, cache: torch.Tensor, message: str) -> None:
    q, k, _ = _qkv_views(3, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match=message):
        apply_rotary(q, k, positions, cache)
