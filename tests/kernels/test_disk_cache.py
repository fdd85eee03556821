"""The disk cache of converted models: what it keeps, and that a bad entry only costs time."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from kernels import disk_cache
from kernels.disk_cache import build_folder, derived_folder, file_key, load_or_build, one_builder
from shared.model import loader
from shared.text import tokenizer as tokenizer_module
from shared.text.tokenizer import Tokenizer


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def _write_text(value: str, folder: Path) -> None:
    (folder / "value.txt").write_text(value)


def _read_text(folder: Path) -> str:
    return (folder / "value.txt").read_text()


def test_an_entry_is_built_once_then_read(tmp_path: Path) -> None:
    builds = []

    def build() -> str:
        builds.append(1)
        return "converted"

    folder = tmp_path / "entry"
    assert load_or_build(folder, _read_text, build, _write_text) == "converted"
    assert load_or_build(folder, _read_text, build, _write_text) == "converted"
    assert len(builds) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no scratch folder left behind


def test_an_unreadable_entry_is_logged_removed_and_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "entry"
    folder.mkdir()  # an entry without its file, as a deleted or half-copied one would be
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        assert load_or_build(folder, _read_text, lambda: "again", _write_text) == "again"
    assert "unreadable" in caplog.text and str(folder) in caplog.text
    assert _read_text(folder) == "again"


def test_a_value_not_worth_keeping_is_not_written(tmp_path: Path) -> None:
    folder = tmp_path / "entry"
    assert load_or_build(folder, _read_text, lambda: "huge", _write_text, keep=lambda _: False) == "huge"
    assert not folder.exists()


def test_a_failed_write_is_logged_and_the_value_still_returned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folder = blocker / "entry"  # its parent is a file: nothing can be written there
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        assert load_or_build(folder, _read_text, lambda: "value", _write_text) == "value"
    assert "could not write cache entry" in caplog.text


def test_losing_the_race_to_another_writer_keeps_its_entry(tmp_path: Path) -> None:
    folder = tmp_path / "entry"

    def write_after_the_other_process(value: str, scratch: Path) -> None:
        folder.mkdir()
        _write_text("theirs", folder)
        _write_text(value, scratch)

    assert load_or_build(folder, _read_text, lambda: "ours", write_after_the_other_process) == "ours"
    assert _read_text(folder) == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_while_one_process_builds_an_entry_another_waits_then_reads_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # one_builder's flock belongs to its open file, so a thread's second open waits as another process would
    folder = tmp_path / "entry"
    results: list[str] = []
    waiter = threading.Thread(target=lambda: results.append(load_or_build(
        folder, _read_text, lambda: pytest.fail("built again"), _write_text, what="converting the test entry",
    )))  # fmt: skip
    with caplog.at_level(logging.INFO, logger=disk_cache.__name__):
        with one_builder(folder, "converting the test entry"):
            waiter.start()
            deadline = time.monotonic() + 30  # bounds a hang only
            while "waiting while another process is converting the test entry" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.01)
            build_folder(folder, lambda scratch: _write_text("built by the first", scratch))
        waiter.join()
    assert results == ["built by the first"]


def test_a_failed_build_leaves_no_lock_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_cache.tempfile, "gettempdir", lambda: str(tmp_path / "locks"))
    (tmp_path / "locks").mkdir()

    def build() -> str:
        raise RuntimeError("no compiler")

    with pytest.raises(RuntimeError, match="no compiler"):
        load_or_build(tmp_path / "entry", _read_text, build, _write_text)
    assert list((tmp_path / "locks").iterdir()) == []


def test_the_key_follows_the_files_bytes_and_the_format_not_its_place(tmp_path: Path, cache_home: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"one")
    key = file_key(source)
    assert file_key(source) == key and file_key(source, "v2") != key
    elsewhere = tmp_path / "another-venv" / "model.gguf"  # a reinstall or another clone: the same entries
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"one")
    assert file_key(elsewhere) == key
    source.write_bytes(b"two")
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a coarse clock may not have moved
    assert file_key(source) != key
    # read once per path, size and mtime: one memo for each version of each file
    assert len(list((cache_home / "llmd" / "digests").iterdir())) == 3
    assert derived_folder("models", source, "weights-v2").parent.name.startswith("model-")


def test_a_gguf_model_is_converted_once_and_read_back_identical(
    model_path: str, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    superseded = derived_folder("models", Path(model_path), "weights-v1")
    superseded.mkdir(parents=True)
    (superseded / "model.safetensors").write_bytes(b"an older format")
    fresh = loader.load_model(model_path)  # converted now (what it returns is the conversion) and written
    assert not superseded.exists()
    monkeypatch.setattr(loader, "_load_gguf", lambda path: pytest.fail(f"{path} converted again"))
    cached = loader.load_model(model_path)
    assert cached.config == fresh.config
    assert cached.weights.keys() == fresh.weights.keys()
    for name, tensor in fresh.weights.items():
        assert cached.weights[name].dtype == torch.float32
        assert torch.equal(cached.weights[name], tensor), name
    (entry,) = (cache_home / "llmd" / "models").iterdir()
    assert sorted(p.name for p in (entry / "weights-v2").iterdir()) == ["config.json", "model.safetensors"]


def test_weights_over_the_cap_are_not_cached(
    model_path: str, cache_home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loader, "MAX_CACHED_WEIGHT_BYTES", 2**20)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        loader.load_model(model_path)
    assert "over the cap of 0.000977 GiB" in caplog.text
    assert not (cache_home / "llmd" / "models").exists()


def test_a_gguf_tokenizer_is_converted_once_and_behaves_the_same(
    model_path: str, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = Tokenizer.from_path(model_path)  # converted now (what it returns is the conversion) and written
    assert (cache_home / "llmd" / "models").exists()
    convert = tokenizer_module.AutoTokenizer.from_pretrained

    def no_conversion(*args: object, **kwargs: object) -> object:
        assert "gguf_file" not in kwargs, "the GGUF was converted again"
        return convert(*args, **kwargs)

    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained", no_conversion)
    cached = Tokenizer.from_path(model_path)
    texts = ["Hello world!", "  two spaces\n\ttab", "émoji 🤖 and 中文", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        ids = fresh.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids) == fresh.decode(ids)
        assert cached.decode(ids, skip_special_tokens=False) == fresh.decode(ids, skip_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(messages) == fresh.apply_chat_template(messages)
    assert (cached.eos_token_ids, cached.bos_token_id, cached.vocab_size) == (
        fresh.eos_token_ids, fresh.bos_token_id, fresh.vocab_size
    )
    assert cached.token_bytes(fresh.encode(" world")[0]) == fresh.token_bytes(fresh.encode(" world")[0])
