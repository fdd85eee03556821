"""Rotary position embedding tables, computed exactly as Hugging Face transformers does."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    # int64 arange then float, as transformers does, so the table is bitwise identical
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope_scaling)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(rope_scaling["factors"], dtype=torch.float32)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: linear, llama3)")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None, max_positions: int
) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second (kernels/rotary.py layout)."""
    inv_freq = inverse_frequencies(head_dim, theta, rope_scaling)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
