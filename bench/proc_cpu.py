"""CPU time (user + system) of processes and their descendants, from /proc (Linux).

A shared machine stretches wall-clock time by whatever else runs there; the CPU seconds a process
spends on the same work barely move, so a benchmark divides them by the tokens it produced.

    before = sample_trees({"gateway": pid, ...})
    ... the run ...
    spent = cpu_delta(before, sample_trees({"gateway": pid, ...}))    # {"gateway": seconds, ...}
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    ppid: int
    cpu_s: float  # user + system of the process and of its children it has waited for


def parse_stat(text: str) -> ProcStat:
    """One /proc/<pid>/stat line (proc(5))."""
    # the command name (field 2) may hold spaces and parentheses: the fields start after its last ')'
    pid = int(text[: text.index(" ")])
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4; utime, stime, cutime, cstime are fields 14-17.
    # A child's time joins cutime/cstime once it has exited and been waited for, so a helper that
    # ran and ended within the measured window still counts.
    ticks = sum(int(value) for value in fields[11:15])
    return ProcStat(pid=pid, ppid=int(fields[1]), cpu_s=ticks / CLOCK_TICKS)


def read_stats(pids: Iterable[int] | None = None) -> dict[int, ProcStat]:
    """The stats of `pids` (None: every process); those that exit meanwhile are left out."""
    chosen = pids if pids is not None else (int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit())
    stats = {}
    for pid in chosen:
        try:
            stats[pid] = parse_stat((PROC / str(pid) / "stat").read_text())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return stats


def tree_cpu_seconds(root: int, stats: Mapping[int, ProcStat]) -> float:
    """CPU seconds of `root` and every live descendant in `stats`."""
    if root not in stats:
        raise ProcessLookupError(f"process {root} is not running: no CPU time to read")
    children: dict[int, list[int]] = {}
    for stat in stats.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    total, pending = 0.0, [root]
    while pending:
        pid = pending.pop()
        total += stats[pid].cpu_s
        pending.extend(children.get(pid, ()))
    return total


def sample_trees(roots: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds of each named process tree, from one pass over /proc."""
    stats = read_stats()
    return {name: tree_cpu_seconds(pid, stats) for name, pid in roots.items()}


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    missing = sorted(set(before) ^ set(after))
    if missing:
        raise ValueError(f"CPU samples of different processes: {missing} in only one")
    return {name: after[name] - before[name] for name in before}
