"""The Hugging Face folder that vLLM's CPU build reads holds exactly the workers' weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bench import hf_export
from kernels.disk_cache import derived_folder
from shared.model.loader import LoadedModel, load_model
from shared.model.paths import resolve_model_path

pytestmark = pytest.mark.slow


def test_checkpoint_holds_the_weights_the_workers_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loaded_model: LoadedModel
) -> None:
    # A cache of its own, holding the user cache's converted weights and tokenizer (converting them is
    # tests/test_disk_cache.py's, at about 8 s each): only the checkpoint is written here.
    gguf = resolve_model_path("default")
    converted = derived_folder("models", gguf, hf_export.HF_CHECKPOINT_ENTRY).parent
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    own = derived_folder("models", gguf, hf_export.HF_CHECKPOINT_ENTRY).parent
    own.mkdir(parents=True)
    for entry in converted.iterdir():
        if entry.name != hf_export.HF_CHECKPOINT_ENTRY:
            (own / entry.name).symlink_to(entry)
    folder = hf_export.hf_checkpoint("default")

    assert folder.is_relative_to(tmp_path) and folder.name == hf_export.HF_CHECKPOINT_ENTRY
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    from_gguf, from_folder = load_model(None), load_model(folder)
    assert from_folder.weights.keys() == from_gguf.weights.keys()
    for name, tensor in from_gguf.weights.items():
        assert torch.equal(from_folder.weights[name], tensor), name
    # the name is the folder's, as for any checkpoint folder; all else is the file's
    assert from_folder.config == dataclasses.replace(from_gguf.config, name=folder.name)
    # cached: the second call returns the same folder without writing it again
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert hf_export.hf_checkpoint("default") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written


def test_checkpoint_folder_is_used_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert hf_export.hf_checkpoint(tmp_path) == tmp_path


def test_other_files_are_refused_by_name(tmp_path: Path) -> None:
    model = tmp_path / "model.bin"
    model.write_bytes(b"")
    with pytest.raises(ValueError, match="model.bin.*neither a .gguf file nor a checkpoint folder"):
        hf_export.hf_checkpoint(model)

