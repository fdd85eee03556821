"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Reads like the paper: embed, then per layer RMSNorm -> attention with rotary positions and
grouped-query heads -> residual -> RMSNorm -> SwiGLU -> residual, then a final norm and the
LM head. The op order follows transformers' LlamaForCausalLM so greedy output matches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul
from kernels.kv_cache_write import write_kv_cache
from kernels.paged_attention import paged_attention
from kernels.rms_norm import rms_norm
from kernels.rotary import apply_rotary
from shared.model.config import ModelConfig
from shared.model.rotary import cos_sin_cache


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each request attends to."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor  # int32 [num_reqs], tokens in cache after this step
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    max_query_len: int


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]: gate rows first, then up
    down_proj: torch.Tensor


class LlamaModel:
    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device

        def take(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in weights else None

        self.embed_tokens = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else take("lm_head.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    q_proj=take(p + "self_attn.q_proj.weight"),
                    k_proj=take(p + "self_attn.k_proj.weight"),
                    v_proj=take(p + "self_attn.v_proj.weight"),
                    q_bias=maybe(p + "self_attn.q_proj.bias"),
                    k_bias=maybe(p + "self_attn.k_proj.bias"),
                    v_bias=maybe(p + "self_attn.v_proj.bias"),
                    o_proj=take(p + "self_attn.o_proj.weight"),
                    post_attention_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up_proj=torch.cat(
                        [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0
                    ).contiguous(),
                    down_proj=take(p + "mlp.down_proj.weight"),
                )
            )
        self.cos_sin_cache = cos_sin_cache(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        ).to(device)
        self.scale = config.head_dim**-0.5

    def weight_bytes(self) -> int:
        tensors = [self.embed_tokens, self.norm] + ([] if self.lm_head is self.embed_tokens else [self.lm_head])
        for layer in self.layers:
            tensors += [t for t in vars_of(layer) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens]
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            normed, residual = rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps, residual)
            hidden = self._attention(layer, normed, positions, meta, kv_cache[i, 0], kv_cache[i, 1])
            normed, residual = rms_norm(hidden, layer.post_attention_norm, self.config.rms_norm_eps, residual)
            hidden = F.linear(silu_and_mul(F.linear(normed, layer.gate_up_proj)), layer.down_proj)
        hidden, _ = rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def _attention(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        q = F.linear(x, layer.q_proj, layer.q_bias).view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, layer.k_proj, layer.k_bias).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, layer.v_proj, layer.v_bias).view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        q, k = apply_rotary(q, k, positions, self.cos_sin_cache)
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, self.scale
        )  # [num_tokens, num_heads, head_dim]
        return F.linear(out.reshape(num_tokens, cfg.num_heads * cfg.head_dim), layer.o_proj)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> float32 [num_rows, vocab]."""
        return F.linear(hidden, self.lm_head).float()


def vars_of(layer: LayerWeights) -> list[torch.Tensor | None]:
    return [getattr(layer, name) for name in LayerWeights.__slots__]
