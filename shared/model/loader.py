"""Weight loading from a GGUF file or a Hugging Face checkpoint folder; never downloads.

Both paths yield the same thing: a `ModelConfig` and a state dict named as in transformers'
Llama (`model.layers.0.self_attn.q_proj.weight`, ...), in float32 on the CPU. A GGUF's
Q4_1 and Q8_0 matrices are also kept as they are in the file, under the same names
(`LoadedModel.quantized`), for the kernels that read them without widening them first
(`kernels.quantized_linear`); their float32 copies are exactly what those blocks hold.

Reading a GGUF is slow in Python (SmolLM2's: 5.6 s, most of it the gguf reader walking the
header's 49k-token vocabulary field by field, the rest dequantising), and every worker did it
on start. So the first load of a file also writes its result to the disk cache
(`kernels.disk_cache`, `models/<name>-<key>/weights-v2/`: safetensors and the config as JSON), and
later loads of the same unchanged file read that instead, in about a second.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kernels.quantized_linear import QuantizedWeight
from kernels.disk_cache import derived_folder, load_or_build
from shared.model.config import ModelConfig
from shared.model.paths import ModelNotFoundError, resolve_model_path

logger = logging.getLogger(__name__)

T = TypeVar("T")

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# the block formats kept beside the float32 weights (GGML's type names, as the kernels spell them)
_KEPT_BLOCK_FORMATS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}
# the disk cache's entry: bump the version when what _load_gguf returns changes
_GGUF_CACHE_ENTRY = "weights-v2"
# where the cache's safetensors file keeps a kept block tensor: this prefix, its format, its name
_QUANTIZED_KEY_PREFIX = "quantized."
# beyond this the float32 copy on disk costs more than re-reading the file saves
MAX_CACHED_WEIGHT_BYTES = 16 * 2**30
PROGRESS_EVERY_S = 10.0


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    path: Path
    # a GGUF's Q4_1 / Q8_0 matrices in their own format, named as in `weights`; empty otherwise
    quantized: dict[str, QuantizedWeight] = dataclasses.field(default_factory=dict)


def load_model(path: str | Path | None, disk_cache: bool = True) -> LoadedModel:
    """`disk_cache`: read a GGUF's converted weights from the disk cache, writing them on first load."""
    resolved = resolve_model_path(path)
    if resolved.is_file() and resolved.suffix == ".gguf":
        gguf = _load_gguf_cached(resolved) if disk_cache else _load_gguf(resolved)
        return LoadedModel(config=gguf.config, weights=gguf.weights, path=resolved, quantized=gguf.quantized)
    if resolved.is_dir() and (resolved / "config.json").exists():
        config, weights = _load_hf_folder(resolved)
        return LoadedModel(config=config, weights=weights, path=resolved)
    raise ModelNotFoundError(f"model path {str(resolved)!r} is neither a .gguf file nor a folder with config.json")


def gguf_metadata(reader: object) -> dict[str, object]:
    """GGUF key/value header as plain Python values (strings decoded, 1-element arrays unwrapped)."""
    from gguf import GGUFValueType

    meta: dict[str, object] = {}
    for key, field in reader.fields.items():  # type: ignore[attr-defined]
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                meta[key] = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
            else:
                meta[key] = [field.parts[i].tolist()[0] for i in field.data]
        elif field.types[0] == GGUFValueType.STRING:
            meta[key] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
        else:
            meta[key] = field.parts[field.data[0]].tolist()[0]
    return meta


@dataclass(slots=True)
class _GGUFWeights:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    quantized: dict[str, QuantizedWeight]


def _load_gguf(path: Path) -> _GGUFWeights:
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf_metadata(
        meta, has_output_weight="output.weight" in names, has_qkv_bias="blk.0.attn_q.bias" in names
    )
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for tensor in _progress(reader.tensors, f"loading {path.name}"):
        array = dequantize(tensor.data, tensor.tensor_type)
        if tensor.name == "rope_freqs.weight":
            config = _with_rope_freq_factors(config, array)
            continue
        hf_name = _gguf_to_hf_name(tensor.name)
        blocks = tensor.data if tensor.tensor_type.name in _KEPT_BLOCK_FORMATS and array.ndim == 2 else None
        if config.architecture == "llama" and re.search(r"\.attn_[qk]\.", tensor.name):
            num_heads = config.num_kv_heads if ".attn_k." in tensor.name else config.num_heads
            array = _unpermute_rotary_rows(array, num_heads)
            # a row of blocks is one output row, so the same permutation of rows applies
            blocks = None if blocks is None else _unpermute_rotary_rows(blocks, num_heads)
        weights[hf_name] = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
        if blocks is not None:
            quantized[hf_name] = QuantizedWeight(
                _KEPT_BLOCK_FORMATS[tensor.tensor_type.name], torch.from_numpy(np.array(blocks)), array.shape[1]
            )
    return _GGUFWeights(config, weights, quantized)


def _load_gguf_cached(path: Path) -> _GGUFWeights:
    def small_enough(loaded: _GGUFWeights) -> bool:
        size = sum(t.numel() * t.element_size() for t in loaded.weights.values())
        if size > MAX_CACHED_WEIGHT_BYTES:
            logger.info("not caching %s: %.3g GiB of float32 weights is over the cap of %.3g GiB",
                        path.name, size / 2**30, MAX_CACHED_WEIGHT_BYTES / 2**30)
        return size <= MAX_CACHED_WEIGHT_BYTES

    folder = derived_folder("models", path, _GGUF_CACHE_ENTRY)
    _remove_superseded(folder)
    return load_or_build(
        folder, _read_converted, lambda: _load_gguf(path),
        _write_converted, (OSError, ValueError, TypeError, KeyError, SafetensorError), keep=small_enough,
        what=f"converting the weights of {path.name}",
    )


def _remove_superseded(folder: Path) -> None:
    """Delete the entries an older format of `folder` left beside it (hundreds of MB each)."""
    prefix = folder.name.rsplit("-v", 1)[0] + "-v"
    for old in folder.parent.glob(prefix + "*"):
        if old.name != folder.name and old.is_dir():
            logger.info("removing %s, superseded by %s", old, folder.name)
            shutil.rmtree(old, ignore_errors=True)


def _write_converted(loaded: _GGUFWeights, folder: Path) -> None:
    blocks = {f"{_QUANTIZED_KEY_PREFIX}{q.format}.{name}": q.blocks for name, q in loaded.quantized.items()}
    save_file({**loaded.weights, **blocks}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(loaded.config)))


def _read_converted(folder: Path) -> _GGUFWeights:
    fields = json.loads((folder / "config.json").read_text())
    config = ModelConfig(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"])})
    weights, blocks = {}, {}
    for key, tensor in load_file(str(folder / "model.safetensors")).items():
        if key.startswith(_QUANTIZED_KEY_PREFIX):
            block_format, name = key.removeprefix(_QUANTIZED_KEY_PREFIX).split(".", 1)
            blocks[name] = (block_format, tensor)
        else:
            weights[key] = tensor
    quantized = {name: QuantizedWeight(f, t, weights[name].shape[1]) for name, (f, t) in blocks.items()}
    return _GGUFWeights(config, weights, quantized)


def _with_rope_freq_factors(config: ModelConfig, factors: np.ndarray) -> ModelConfig:
    return dataclasses.replace(config, rope_scaling={"rope_type": "freq_factors", "factors": factors.tolist()})


def _gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_LAYER_RE.fullmatch(name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"


def _unpermute_rotary_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rotary halves; undo it to get HF's layout
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _load_hf_folder(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    generation_file = path / "generation_config.json"
    config = ModelConfig.from_hf_config(
        json.loads((path / "config.json").read_text()),
        name=path.name,
        generation_cfg=json.loads(generation_file.read_text()) if generation_file.exists() else None,
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {str(path)!r}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in _progress(list(f.keys()), f"loading {file.name}"):
                weights[key] = f.get_tensor(key).to(torch.float32)
    return config, weights


def _progress(items: list[T], description: str) -> Iterator[T]:
    """`items`, with a log line every PROGRESS_EVERY_S while they last: lines, not a progress bar,
    since the launcher's processes share one terminal."""
    started = last = time.monotonic()
    for num_done, item in enumerate(items):
        if (now := time.monotonic()) - last >= PROGRESS_EVERY_S:
            logger.info("%s: %d of %d tensors after %.0f s", description, num_done, len(items), now - started)
            last = now
        yield item
