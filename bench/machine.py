"""The machine a benchmark ran on, as every result document records it (key "machine").

    describe_machine() -> dict
        cpu, cores, the ISA flags that decide the kernels (AVX2, AVX-512, native bf16, AMX), memory,
        GPU, torch version, what `dtype=auto` runs here, the UTC date, the code's commit as the
        benchmark started (CODE_AT_START), and the 1-minute load average as the result is written
        (above the core count, other work shared the cores)
    machine_identity(machine) -> tuple
        the fields that name the hardware (not the date, commit or software): two results with
        equal identities come from the same kind of machine and may share one page
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

# the flags that change which kernels run and how fast (docs/kernels.md); the rest of cpuinfo's
# hundred-odd flags would only make two equal machines look different
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")
IDENTITY_KEYS = ("cpu", "cores", "isa", "gpu")
REPO_ROOT = Path(__file__).resolve().parent.parent
# the code a benchmark runs; edits elsewhere (docs, tests, the report) leave its figures valid
CODE_PATHS = ("services", "shared", "kernels", "bench", ":!bench/report")


def describe_machine() -> dict[str, Any]:
    import torch  # here, so that reading a result's identity needs no torch

    from shared.engine.engine import resolve_dtype

    cpuinfo = _cpuinfo()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpuinfo.get("model name", platform.processor() or platform.machine()),
        "cores": os.cpu_count(),
        "isa": [flag for flag in ISA_FLAGS if flag in cpuinfo.get("flags", "").split()],
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
        "gpu": gpu,
        "torch": torch.__version__,
        "auto_dtype": str(resolve_dtype("auto", torch.device("cuda" if gpu else "cpu"))).removeprefix("torch."),
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "commit": CODE_AT_START,
        "load_1m": round(os.getloadavg()[0], 1),
    }


def machine_identity(machine: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(tuple(v) if isinstance(v, list) else v for v in (machine.get(k) for k in IDENTITY_KEYS))


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo; empty where there is none (macOS)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _commit() -> str | None:
    """The last commit that changed the benchmarked code (so results of the same code name the same
    commit whatever came after in docs or tests), with "-dirty" when the code differs from it;
    None outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("log", "-1", "--format=%h", "--", *CODE_PATHS)
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("-dirty" if dirty else "")


# read as the benchmark imports this module, at its start: a commit or an edit made while a long run
# goes on is not the code that ran
CODE_AT_START = _commit()
