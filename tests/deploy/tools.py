"""Helpers of the deployment checks: where the files are, how the validators are run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
BASE = K8S_DIR / "base"


def require(what: str) -> NoReturn:
    """Skip a test whose validator is absent; fail under CI, where it must be installed."""
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(f"{what} is not installed; .ci/run must install it")
    pytest.skip(f"{what} is not installed")


def venv_tool(name: str) -> str | None:
    """A console script of the running interpreter's environment, else one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def run(cmd: list[str], cwd: Path = REPO_ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # A clean environment plus `env`: LLMD_* or COMPOSE_* variables of the developer's shell
    # must not change what the files render to.
    clean = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=clean, capture_output=True, text=True, timeout=120)


def load_yaml_docs(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def compose_config(
    compose_bin: str, files: list[str], profiles: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> dict[str, Any]:
    args = [arg for name in files for arg in ("-f", name)] + [arg for name in profiles for arg in ("--profile", name)]
    result = run([compose_bin, *args, "config", "--format", "json"], env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def base_manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in load_yaml_docs((BASE / name).read_text())]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]
