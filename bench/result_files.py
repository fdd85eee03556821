"""Where every benchmark writes its results, each JSON stamped with the machine it ran on.

    RESULTS_DIR: bench/results/ (git-ignored; `make bench-report ARGS=--collect` copies them to docs/results/)
    save_result(path, document) -> Path
        `document` plus the machine (describe_machine()) and the command that ran, as JSON at `path`
    write_result(name, document) -> Path
        save_result(RESULTS_DIR / f"{name}.json", document)
    write_figure(name, figure) -> Path
        RESULTS_DIR / f"{name}.png"
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.machine import describe_machine
from bench.serving.report import write_json

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def save_result(path: Path, document: dict[str, Any]) -> Path:
    write_json(path, {**document, "machine": describe_machine(), "command": command_line()})
    return path


def command_line() -> str:
    """How this process was started, as `python -m bench.x ARGS` (docs/benchmarks.md shows it)."""
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = ["python", "-m", main_spec.name] if main_spec is not None else ["python", sys.argv[0]]
    return shlex.join([*program, *sys.argv[1:]])


def write_result(name: str, document: dict[str, Any]) -> Path:
    return save_result(RESULTS_DIR / f"{name}.json", document)


def write_figure(name: str, figure: Figure) -> Path:
    path = RESULTS_DIR / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
