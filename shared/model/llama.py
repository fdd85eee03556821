"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Reads like the paper: embed, then per layer RMSNorm -> attention with rotary positions and
grouped-query heads -> residual -> RMSNorm -> SwiGLU -> residual, then a final norm and the
LM head. The op order follows transformers' LlamaForCausalLM so greedy output matches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul
from kernels.kv_quant import KVFormat
from kernels.paged_attention import paged_attention
from kernels.rms_norm import rms_norm
from kernels.rotary import rotate_and_write_kv
from shared.model.config import ModelConfig
from kernels.quantized_linear import QuantizedWeight
from shared.model.linear import (
    PLAIN_MIN_ROWS,
    Linear,
    onednn_packing_available,
    plain_products_faster,
    block_rows_text,
    quantized_kernel_available,
)
from shared.model.rotary import cos_sin_cache

logger = logging.getLogger(__name__)


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
    qkv_proj: Linear  # [q heads, then k heads, then v heads] x hidden, one product for all three
    o_proj: Linear
    post_attention_norm: torch.Tensor
    gate_up_proj: Linear  # [2 * intermediate, hidden]: gate rows first, then up
    down_proj: Linear


class LlamaModel:
    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
        quantized: dict[str, QuantizedWeight] | None = None,
    ) -> None:
        """`quantized`: block-format copies of some of `weights` (a GGUF's), used where the kernel runs here."""
        self.config = config
        self.dtype = dtype
        self.device = device
        # called after each decoder layer: where a CPU worker gives borrowed cores back mid-step,
        # streams the layer's KV out and runs calls queued for the step's next layer
        self.between_layers: Callable[[], None] | None = None
        # called twice inside each layer (after attention, after the MLP's up projection): where a CPU
        # worker's thread count may change too, since one layer of a long prompt takes tens of ms
        self.within_layer: Callable[[], None] | None = None
        pack = onednn_packing_available(dtype, device)
        blocks = (quantized or {}) if quantized_kernel_available(dtype, device) else {}
        keep_plain = plain_products_faster(dtype, device)

        def take(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        def linear(*names: str, plain: bool = keep_plain) -> Linear:
            """One product for the named projections, their output rows stacked in that order."""
            bias_names = [n.removesuffix("weight") + "bias" for n in names]
            if any(b in weights for b in bias_names) and not all(b in weights for b in bias_names):
                raise ValueError(f"{', '.join(names)}: some have a bias and some do not; they cannot be fused")
            bias = torch.cat([take(b) for b in bias_names]) if bias_names[0] in weights else None
            parts = [blocks[n] for n in names if n in blocks]
            one_format = len(parts) == len(names) and len({p.format for p in parts}) == 1
            stacked = QuantizedWeight.stack(parts) if one_format else None
            return Linear(torch.cat([take(n) for n in names]).contiguous(), bias, pack, stacked, plain)

        self.embed_tokens = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        # one row per request: never prefill-sized, so no plain copy
        lm_head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = linear(lm_head_name, plain=False)
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv_proj=linear(*(p + f"self_attn.{x}_proj.weight" for x in "qkv")),
                    o_proj=linear(p + "self_attn.o_proj.weight"),
                    post_attention_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up_proj=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down_proj=linear(p + "mlp.down_proj.weight"),
                )
            )
        self.cos_sin_cache = cos_sin_cache(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        ).to(device)
        self.scale = config.head_dim**-0.5
        layers = [self.lm_head] + [lin for w in self.layers for lin in (w.qkv_proj, w.o_proj, w.gate_up_proj, w.down_proj)]
        in_blocks = sum(lin.quantized is not None for lin in layers)
        logger.info("linear layers: %s%s; %d of %d also as GGUF blocks for products of up to %s; the weights "
                    "take %.0f MiB", "oneDNN, packed at load" if pack else "F.linear",
                    f", MKL on a plain copy from {PLAIN_MIN_ROWS} rows" if keep_plain else "", in_blocks, len(layers),
                    block_rows_text(dtype), self.weight_bytes() / 2**20)

    def weight_bytes(self) -> int:
        """Bytes the weights take here, the packed copy of a tied LM head included."""
        total = sum(t.numel() * t.element_size() for t in (self.embed_tokens, self.norm)) + self.lm_head.num_bytes()
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for t in (layer.input_norm, layer.post_attention_norm))
            total += sum(lin.num_bytes() for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
        return total

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens]
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, row]
        kv_format: KVFormat | None = None,  # how kv_cache stores a row (default: head_dim values of its dtype)
    ) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            normed, residual = rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps, residual)
            hidden = self._attention(layer, normed, positions, meta, kv_cache[i, 0], kv_cache[i, 1], kv_format)
            if self.within_layer is not None:
                self.within_layer()
            normed, residual = rms_norm(hidden, layer.post_attention_norm, self.config.rms_norm_eps, residual)
            activated = silu_and_mul(layer.gate_up_proj(normed))
            if self.within_layer is not None:
                self.within_layer()
            hidden = layer.down_proj(activated)
            if self.between_layers is not None:
                self.between_layers()
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
        kv_format: KVFormat | None,
    ) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = layer.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        q, _ = rotate_and_write_kv(
            q, k, v, positions, self.cos_sin_cache, k_cache, v_cache, meta.slot_mapping, kv_format
        )
        out = paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, self.scale,
            kv_format,
        )  # [num_tokens, num_heads, head_dim]
        return layer.o_proj(out.reshape(num_tokens, cfg.num_heads * cfg.head_dim))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> float32 [num_rows, vocab]."""
        return self.lm_head(hidden).float()

