"""A Llama of random weights and any size, as a Hugging Face folder, made at run time.

    python -m bench.tiny_model [--layers 2 --hidden 64 ...]     # prints the folder

With 2 layers of hidden size 64 the model's compute is almost nothing, so a serving benchmark on
it measures what the serving path costs per step and per token: scheduling, inputs, sampling,
outputs, messages, HTTP. The vocabulary and tokenizer are the default model's (SmolLM2's), so a
server's tokenising and detokenising cost what they cost with the real model. The weights come
from a seeded generator: the same options give the same folder, kept in the disk cache.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.hf_export import hf_checkpoint
from kernels.disk_cache import build_folder, derived_folder
from shared.model.paths import resolve_model_path

# bump when what `_write` writes changes
TINY_MODEL_ENTRY = "tiny-llama-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True, slots=True)
class TinyShape:
    layers: int = 2
    hidden: int = 64
    intermediate: int = 128
    # heads of 32 dimensions: vLLM's CPU attention takes no smaller ones
    heads: int = 2
    kv_heads: int = 2
    max_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden} must split into {self.heads} heads, and those into "
                             f"{self.kv_heads} KV heads")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"head size {self.hidden // self.heads} must be even for rotary embeddings")

    @property
    def key(self) -> str:
        return "-".join(f"{name}{value}" for name, value in asdict(self).items())


def tiny_model(shape: TinyShape = TinyShape()) -> Path:
    """The folder of a random-weight Llama of `shape` with the default model's tokenizer."""
    source = resolve_model_path("default")
    entry = f"{TINY_MODEL_ENTRY}-{shape.key}"
    return build_folder(derived_folder("models", source, entry), lambda folder: _write(shape, folder))


def _write(shape: TinyShape, folder: Path) -> None:
    reference = hf_checkpoint("default")
    ref_config = json.loads((reference / "config.json").read_text())
    vocab = ref_config["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "max_position_embeddings": shape.max_len,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": ref_config.get("bos_token_id"),
        "eos_token_id": ref_config.get("eos_token_id"),
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (reference / name).exists():
            (folder / name).write_bytes((reference / name).read_bytes())
    save_file(_weights(shape, vocab), str(folder / "model.safetensors"), metadata={"format": "pt"})


def _weights(shape: TinyShape, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(shape.seed)
    head_dim = shape.hidden // shape.heads

    def normal(*size: int) -> torch.Tensor:
        # small weights keep the logits spread, so greedy tokens vary as a real model's do
        return torch.randn(*size, generator=gen) * 0.02

    weights = {"model.embed_tokens.weight": normal(vocab, shape.hidden), "model.norm.weight": torch.ones(shape.hidden)}
    for i in range(shape.layers):
        prefix = f"model.layers.{i}."
        weights |= {
            prefix + "self_attn.q_proj.weight": normal(shape.heads * head_dim, shape.hidden),
            prefix + "self_attn.k_proj.weight": normal(shape.kv_heads * head_dim, shape.hidden),
            prefix + "self_attn.v_proj.weight": normal(shape.kv_heads * head_dim, shape.hidden),
            prefix + "self_attn.o_proj.weight": normal(shape.hidden, shape.heads * head_dim),
            prefix + "mlp.gate_proj.weight": normal(shape.intermediate, shape.hidden),
            prefix + "mlp.up_proj.weight": normal(shape.intermediate, shape.hidden),
            prefix + "mlp.down_proj.weight": normal(shape.hidden, shape.intermediate),
            prefix + "input_layernorm.weight": torch.ones(shape.hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(shape.hidden),
        }
    return weights


def add_shape_options(parser: argparse.ArgumentParser) -> None:
    defaults = TinyShape()
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--intermediate", type=int, default=defaults.intermediate)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)


def shape_from(args: argparse.Namespace) -> TinyShape:
    return TinyShape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_options(parser)
    print(tiny_model(shape_from(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
