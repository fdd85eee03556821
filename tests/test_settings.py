"""The warning about `LLMD_` variables that name no setting: its names come from the settings classes."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.settings import WorkerServiceSettings, env_names, service_settings, unknown_settings, warn_unknown_settings

REPO_ROOT = Path(__file__).resolve().parents[1]
QUOTED_LLMD_NAME = re.compile(r"""["'](LLMD_[A-Z0-9_]+)["']""")


def warnings_for(environ: dict[str, str], caplog: pytest.LogCaptureFixture) -> list[str]:
    with caplog.at_level(logging.WARNING, logger="shared.settings"):
        warn_unknown_settings(environ)
    return [record.getMessage() for record in caplog.records]


def test_a_misspelt_variable_is_named_once_with_the_closest_setting(caplog: pytest.LogCaptureFixture) -> None:
    environ = {"LLMD_SCHEDULER__MAX_NUM_SEQ": "4", "LLMD_SCHEDULER__MAX_NUM_SEQS": "4", "PATH": "/bin"}
    assert warnings_for(environ, caplog) == [
        "LLMD_SCHEDULER__MAX_NUM_SEQ is not a setting and is ignored; did you mean LLMD_SCHEDULER__MAX_NUM_SEQS?"
    ]


def test_the_suggestion_is_a_setting_not_a_section(caplog: pytest.LogCaptureFixture) -> None:
    # LLMD_KV_CACHE (the section, as JSON) is closer by spelling, but names no one setting
    assert warnings_for({"LLMD_KV_CACHE__COLOUR": "red"}, caplog) == [
        "LLMD_KV_CACHE__COLOUR is not a setting and is ignored; did you mean LLMD_KV_CACHE__BLOCK_SIZE?"
    ]


def test_a_name_close_to_no_setting_gets_no_suggestion(caplog: pytest.LogCaptureFixture) -> None:
    assert warnings_for({"LLMD_QQQQQQQQQQQQQQQQQQ": "1"}, caplog) == [
        "LLMD_QQQQQQQQQQQQQQQQQQ is not a setting and is ignored"
    ]


def test_every_setting_section_and_top_level_field_is_known_in_any_case(caplog: pytest.LogCaptureFixture) -> None:
    names = set().union(*(env_names(settings) for settings in service_settings()))
    assert {"LLMD_TORCH_THREADS", "LLMD_LOG_LEVEL", "LLMD_KV_CACHE", "LLMD_GATEWAY__PORT", "LLMD_WORKER__CPUS"} <= names
    environ = {name: "1" for name in names} | {"llmd_kv_cache__block_size": "32", "REDIS_URL": "redis://x"}
    assert warnings_for(environ, caplog) == []


def test_a_variable_is_read_where_it_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # the names checked are the ones pydantic-settings reads: a nested field, a top-level one, any case
    monkeypatch.setenv("llmd_scheduler__max_num_seqs", "7")
    monkeypatch.setenv("LLMD_TORCH_THREADS", "3")
    settings = WorkerServiceSettings()
    assert (settings.scheduler.max_num_seqs, settings.torch_threads) == (7, 3)


def test_every_llmd_variable_the_code_names_is_a_setting() -> None:
    # A variable read outside the settings would draw the warning: make it a setting instead.
    sources = [p for d in ("services", "shared", "kernels", "bench") for p in (REPO_ROOT / d).rglob("*.py")]
    named = {name for path in sources for name in QUOTED_LLMD_NAME.findall(path.read_text())}
    assert "LLMD_TORCH_THREADS" in named
    assert unknown_settings(dict.fromkeys(named, "")) == {}


def test_a_service_warns_at_start(tmp_path: Path) -> None:
    env = {**os.environ, "LLMD_SCHEDULER__MAX_NUM_SEQ": "4", "LLMD_MODEL__PATH": str(tmp_path / "none.gguf")}
    done = subprocess.run(
        [sys.executable, "-m", "services.gateway"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1  # no such model
    warned = [line for line in done.stderr.splitlines() if "LLMD_SCHEDULER__MAX_NUM_SEQ " in line]
    assert len(warned) == 1 and warned[0].endswith("did you mean LLMD_SCHEDULER__MAX_NUM_SEQS?"), done.stderr
