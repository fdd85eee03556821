"""Fixtures shared by the whole suite: the real default model, loaded once per session."""

from __future__ import annotations

import os

import pytest
import torch

# the Triton interpreter must be chosen before anything (transformers included) imports triton
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shared.model.loader import LoadedModel, default_model_path, load_model


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(default_model_path())


@pytest.fixture(scope="session")
def loaded_model(model_path: str) -> LoadedModel:
    return load_model(model_path)
