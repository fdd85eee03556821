"""The model's shape, read from a GGUF header or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(
        cls, cfg: dict[str, Any], name: str, generation_cfg: dict[str, Any] | None = None
    ) -> ModelConfig:
        architecture = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        eos_ids = tuple(dict.fromkeys(_ids(cfg.get("eos_token_id")) + _ids((generation_cfg or {}).get("eos_token_id"))))
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", architecture == "qwen2"),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], has_output_weight: bool, has_qkv_bias: bool) -> ModelConfig:
        arch = meta["general.architecture"]
        num_heads = int(meta[f"{arch}.attention.head_count"])
        hidden_size = int(meta[f"{arch}.embedding_length"])
        rope_scaling = None
        if meta.get(f"{arch}.rope.scaling.type") in ("llama3",) or f"{arch}.rope.scaling.factor" in meta:
            rope_scaling = {
                "rope_type": meta.get(f"{arch}.rope.scaling.type", "linear"),
                "factor": float(meta[f"{arch}.rope.scaling.factor"]),
                "original_max_position_embeddings": int(
                    meta.get(f"{arch}.rope.scaling.original_context_length", meta[f"{arch}.context_length"])
                ),
            }
        # end-of-turn ids end generation too (e.g. Llama 3's <|eot_id|>)
        eos_ids = tuple(dict.fromkeys(
            int(meta[key]) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                       "tokenizer.ggml.eom_token_id") if meta.get(key) is not None
        ))
        return cls(
            architecture=arch,
            vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden_size,
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_layers=int(meta[f"{arch}.block_count"]),
            num_heads=num_heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=int(meta.get(f"{arch}.rope.dimension_count", hidden_size // num_heads)),
            rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(meta[f"{arch}.context_length"]),
            tie_word_embeddings=not has_output_weight,
            attention_bias=has_qkv_bias,
            rope_scaling=rope_scaling,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            name=str(meta.get("general.name", "model")),
        )


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
