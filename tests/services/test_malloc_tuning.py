"""A worker keeps the memory its steps free (services/runtime/malloc_tuning.py): a prefill on a thread, as
the engine thread runs it, stops faulting in fresh pages for its activations once warm."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.runtime import malloc_tuning

# Prefills of 1,024 new tokens each on a thread of their own; prints each one's minor page faults.
PREFILLS = """
import json, random, resource, sys, threading
from services.runtime.malloc_tuning import keep_freed_memory
print(json.dumps({"tuned": keep_freed_memory() if sys.argv[1] == "tuned" else False}))
from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
llm, rng, faults = LLM(), random.Random(0), []
def prefills():
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        llm.generate([[rng.randrange(1000, 40000) for _ in range(1024)]], SamplingParams(max_tokens=1, temperature=0))
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=prefills)
thread.start()
thread.join()
print(json.dumps({"faults": faults}))
"""


def prefill_faults(mode: str) -> tuple[bool, list[int]]:
    env = {k: v for k, v in os.environ.items() if k not in malloc_tuning.OPERATOR_SETTINGS and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PREFILLS, mode], capture_output=True, text=True, env=env, check=True,
                         timeout=300).stdout.splitlines()
    lines = [json.loads(line) for line in out if line.startswith("{")]
    return lines[0]["tuned"], lines[1]["faults"]


@pytest.mark.slow
def test_a_warm_prefill_takes_no_fresh_pages_for_its_activations() -> None:
    tuned, faults = prefill_faults("tuned")
    plain_tuned, plain = prefill_faults("plain")
    assert tuned and not plain_tuned
    # warm (after the first prefill): glibc's own thresholds hand activations back and fault them in
    # again, 7,000-38,000 pages over three prefills (seen; fewer once its dynamic mmap threshold has
    # grown); kept, none on an idle Zen 4, 1,000-2,700 on a Zen 3 (faults that are not the activations')
    assert sum(plain[1:]) > 1000
    assert sum(faults[1:]) * 2 < sum(plain[1:])


def test_the_operators_malloc_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert malloc_tuning.operator_set_malloc() and not malloc_tuning.keep_freed_memory()
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert malloc_tuning.operator_set_malloc() and not malloc_tuning.keep_freed_memory()
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert not malloc_tuning.operator_set_malloc()
