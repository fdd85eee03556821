"""What the gateway needs to know of the served model without loading its weights."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from shared.model.paths import resolve_model_path
from shared.settings import ModelSettings


@dataclass(slots=True, frozen=True)
class ModelInfo:
    name: str  # the id clients send as "model"; the workers label their metrics with the same
    path: Path
    max_model_len: int
    created: int


def load_model_info(settings: ModelSettings) -> ModelInfo:
    """Name and context length as the workers' engines derive them (`Engine.max_model_len`)."""
    path = resolve_model_path(settings.path)
    context_len = _context_length(path)
    max_model_len = min(settings.max_model_len or context_len, context_len)
    return ModelInfo(name=settings.name or path.stem, path=path, max_model_len=max_model_len, created=int(time.time()))


def _context_length(path: Path) -> int:
    if path.is_file() and path.suffix == ".gguf":
        # transformers' reader skips the tensor table, so this is quick even for large files
        from transformers.integrations.gguf.reader import read_gguf_metadata

        metadata, _ = read_gguf_metadata(str(path))
        return int(metadata[f"{metadata['general.architecture']}.context_length"])
    config = json.loads((path / "config.json").read_text())
    return int(config.get("max_position_embeddings", 4096))  # ModelConfig.from_hf_config's default
