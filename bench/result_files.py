"""Where every benchmark writes its results, each JSON stamped with the machine it ran on.

    RESULTS_DIR: bench/results/ (git-ignored; `make bench-report ARGS=--collect` copies them to docs/results/)
    save_result(path, document) -> Path
        `document` plus {"machine": describe_machine()}, as JSON at `path`
    write_result(name, document) -> Path
        save_result(RESULTS_DIR / f"{name}.json", document)
    write_figure(name, figure) -> Path
        RESULTS_DIR / f"{name}.png"
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.machine import describe_machine
from bench.serving.report import write_json

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def save_result(path: Path, document: dict[str, Any]) -> Path:
    write_json(path, {**document, "machine": describe_machine()})
    return path


def write_result(name: str, document: dict[str, Any]) -> Path:
    return save_result(RESULTS_DIR / f"{name}.json", document)


def write_figure(name: str, figure: Figure) -> Path:
    path = RESULTS_DIR / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
