from __future__ import annotations

from pathlib import Path

import pytest

from shared.text import Tokenizer


@pytest.fixture(scope="session")
def gguf_path(model_path: str) -> Path:
    return Path(model_path)


@pytest.fixture(scope="session")
def tokenizer(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_path(str(gguf_path))
