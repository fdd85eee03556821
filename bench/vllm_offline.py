"""vLLM's offline engine (`vllm.LLM.generate`) on one workload, timed: run by bench.overhead in the
interpreter of vLLM's environment, so it imports nothing of this project.

    ENV/bin/python -P bench/vllm_offline.py WORKLOAD.json

WORKLOAD.json: {"model", "dtype", "runs": [BATCH], "warmups": BATCH}, each BATCH {"prompts": [[ids]],
"max_tokens": [n]}. The script builds the engine and runs the warm-ups, prints "ready", then for each
run waits for a line on stdin (the parent reads the process tree's CPU time meanwhile), generates,
and prints one JSON line: {"seconds", "output_tokens"}; these lines start with MARKER, as vLLM logs
to stdout too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

MARKER = "VLLM_OFFLINE "  # tells the script's lines from vLLM's log


def main(workload_path: str) -> None:
    from vllm import LLM, SamplingParams

    workload = json.loads(Path(workload_path).read_text())
    llm = LLM(model=workload["model"], dtype=workload["dtype"], seed=0)

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(batch: dict) -> tuple[float, int]:
        prompts = [{"prompt_token_ids": ids} for ids in batch["prompts"]]
        started = time.perf_counter()
        outputs = llm.generate(prompts, [params(n) for n in batch["max_tokens"]], use_tqdm=False)
        seconds = time.perf_counter() - started
        return seconds, sum(len(completion.token_ids) for output in outputs for completion in output.outputs)

    generate(workload["warmups"])
    print(f"{MARKER}ready", flush=True)
    for batch in workload["runs"]:
        sys.stdin.readline()
        seconds, output_tokens = generate(batch)
        print(MARKER + json.dumps({"seconds": seconds, "output_tokens": output_tokens}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
