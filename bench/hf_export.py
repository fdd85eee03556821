"""A GGUF model as a Hugging Face checkpoint folder, for servers that read only those (vLLM's CPU build).

    python -m bench.hf_export [--model PATH]      # prints the folder

The weights are the ones this project's loader makes of the file (dequantised, in float32, so a
server that runs bfloat16 rounds them exactly as the workers do); the config and the tokenizer
are transformers' reading of the same file. The folder is cached beside the converted weights
(`kernels.disk_cache`), keyed on the file, so a second run costs nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import save_file

from kernels.disk_cache import build_folder, derived_folder
from shared.model.loader import load_model
from shared.model.paths import resolve_model_path
from shared.text.tokenizer import Tokenizer

# bump when what `_write_checkpoint` writes changes
HF_CHECKPOINT_ENTRY = "hf-checkpoint-v1"


def hf_checkpoint(model: str | Path | None) -> Path:
    """The Hugging Face folder of `model` (a .gguf file, 'default', or already such a folder)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"model {str(path)!r} is neither a .gguf file nor a checkpoint folder")
    return build_folder(derived_folder("models", path, HF_CHECKPOINT_ENTRY), lambda folder: _write_checkpoint(path, folder))


def _write_checkpoint(gguf: Path, folder: Path) -> None:
    from transformers import AutoConfig

    loaded = load_model(gguf)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers records the file's quantisation; the folder holds plain float32 weights
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(folder)
    # the gateway's tokenizer, converted once and kept in the disk cache (converting takes about 8 s)
    Tokenizer.from_path(str(gguf)).hf.save_pretrained(folder)
    # a tied LM head is the embedding again; safetensors refuses tensors that share memory
    weights = {name: tensor.contiguous() for name, tensor in loaded.weights.items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a .gguf file or 'default'")
    print(hf_checkpoint(parser.parse_args(argv).model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
