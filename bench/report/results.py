"""The result files behind the page: loaded from one folder and checked to come from one machine;
and copied there from bench/results/ (--collect).

A result document is a benchmark's JSON with "machine" (bench/machine.py) and "command"
(bench/result_files.py); its plot, if it has one, is the PNG of the same name beside it.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.machine import machine_identity
from bench.report.model import Document


class ResultsError(ValueError):
    """The result files cannot make one page: missing the machine, or from several machines."""


def load_results(folder: Path, claims: Callable[[str], bool]) -> dict[str, Document]:
    """Every result in `folder` that some comparison `claims`, by name, sorted (so the page does
    not depend on the file system's order); all must come from one machine."""
    documents = {path.stem: _read(path) for path in sorted(folder.glob("*.json")) if claims(path.stem)}
    machine_of(documents)
    return documents


def machine_of(documents: dict[str, Document]) -> dict[str, Any] | None:
    """The machine that every document names (the first one's description); None without documents."""
    first: tuple[str, dict[str, Any]] | None = None
    for name, document in documents.items():
        machine = document.get("machine")
        if not isinstance(machine, dict):
            raise ResultsError(f"{name}.json has no machine description: rerun its benchmark")
        if first is None:
            first = (name, machine)
        elif machine_identity(machine) != machine_identity(first[1]):
            raise ResultsError(f"{name}.json comes from another machine ({_short(machine)}) than {first[0]}.json "
                               f"({_short(first[1])}): one page shows one machine's results")
    return None if first is None else first[1]


def collect(source: Path, target: Path, machine: dict[str, Any], claims: Callable[[str], bool]) -> list[Path]:
    """Copy the results in `source` made on `machine` (and their plots) into `target`, replacing
    older ones of the same name; returns what was copied. Refuses when `target` holds another
    machine's results, as one page shows one machine."""
    kept = {path.stem: _read(path) for path in sorted(target.glob("*.json"))}
    theirs = machine_of(kept)
    if theirs is not None and machine_identity(theirs) != machine_identity(machine):
        raise ResultsError(f"{target} holds results of another machine ({_short(theirs)}) than this one "
                           f"({_short(machine)}): delete them first to start this machine's page")
    copied: list[Path] = []
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.json")):
        if not claims(path.stem):
            continue
        found = _read(path).get("machine")
        if not isinstance(found, dict) or machine_identity(found) != machine_identity(machine):
            print(f"skipped {path}: made on {'an unknown machine' if found is None else _short(found)}, "
                  f"not this one", file=sys.stderr)
            continue
        copied.append(Path(shutil.copy2(path, target / path.name)))
        plot = path.with_suffix(".png")
        if plot.exists():
            copied.append(Path(shutil.copy2(plot, target / plot.name)))
        else:  # an older run's plot would stand beside figures it does not show
            (target / plot.name).unlink(missing_ok=True)
    return copied


def _read(path: Path) -> Document:
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ResultsError(f"{path} is not JSON: {error}") from error
    if not isinstance(document, dict):
        raise ResultsError(f"{path} holds a {type(document).__name__}, not a result document")
    return document


def _short(machine: dict[str, Any]) -> str:
    return f"{machine.get('cpu')}, {machine.get('cores')} cores, {machine.get('gpu') or 'no GPU'}"
