"""Every LLMD_* variable the deployment files set names a real setting.

The settings ignore unknown variables (each process only warns about them at start), so a
misspelt or renamed one in a compose file or manifest would be dropped; these tests are what notices.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from shared.settings import ENV_PREFIX, GatewayServiceSettings, WorkerServiceSettings, env_names
from tests.deploy.tools import BASE, REPO_ROOT, base_manifests, by_kind, compose_config, container

SETTINGS_BY_SERVICE: dict[str, type[BaseModel]] = {
    "gateway": GatewayServiceSettings,
    "prefill": WorkerServiceSettings,
    "decode": WorkerServiceSettings,
}
LLMD_VAR = re.compile(r"\bLLMD_[A-Z0-9_]+")


def test_env_names_follow_pydantic_settings_nesting() -> None:
    # The same names pydantic-settings reads: a nested value set this way arrives.
    names = env_names(WorkerServiceSettings)
    assert {"LLMD_REDIS__URL", "LLMD_KV_CACHE__BLOCK_SIZE", "LLMD_WORKER__HEALTH_PORT"} <= names
    assert "LLMD_GATEWAY__PORT" not in names


def test_worker_reads_a_nested_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMD_WORKER__HEALTH_PORT", "9123")
    assert WorkerServiceSettings().worker.health_port == 9123


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]])
def test_compose_sets_only_known_settings(compose_bin: str, files: list[str]) -> None:
    services: dict[str, Any] = compose_config(compose_bin, files)["services"]
    for service, settings in SETTINGS_BY_SERVICE.items():
        used = {key for key in services[service]["environment"] if key.startswith(ENV_PREFIX)}
        assert used - env_names(settings) == set(), service


def test_kubernetes_manifests_set_only_known_settings() -> None:
    deployments = by_kind(base_manifests(), "Deployment")
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    shared = {literal.split("=", 1)[0] for item in kustomization["configMapGenerator"] for literal in item["literals"]}
    for service, settings in SETTINGS_BY_SERVICE.items():
        used = shared | {item["name"] for item in container(deployments[service])["env"]}
        assert used - env_names(settings) == set(), service


@pytest.mark.parametrize(
    ("path", "services"),
    [
        ("Dockerfile", ("gateway", "prefill", "decode")),
        ("Dockerfile.gpu", ("gateway", "prefill", "decode")),
        ("deploy/k8s/gpu/kustomization.yaml", ("prefill", "decode")),
        ("docs/deploy.md", ("gateway", "prefill", "decode")),
        ("docs/scheduling.md", ("prefill", "decode")),
    ],
)
def test_other_files_name_only_known_settings(path: str, services: tuple[str, ...]) -> None:
    known = set().union(*(env_names(SETTINGS_BY_SERVICE[s]) for s in services))
    used = set(LLMD_VAR.findall((REPO_ROOT / path).read_text()))
    assert used, f"{path} names no LLMD_ setting"
    assert used - known == set()
