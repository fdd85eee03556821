"""Comparison: cache-aware routing off vs on, on multi-turn chat over 2 prefill + 2 decode workers.

    python -m bench.routing [--conversations 8 --turns 4 --system-len 1000 --user-len 64 --output-len 16 --seed 0]

Two stacks, one after the other, each 2 prefill + 2 decode workers with the same settings except
LLMD_ROUTING__ENABLED. --conversations chats run side by side, each for --turns turns: a turn
sends the whole history (a --system-len token system prompt that all conversations share, then
every earlier user message and answer) plus a new --user-len token message, and gets
--output-len tokens (greedy, so both modes see the same answers). Measured per mode: the prefix
hit rate of the follow-up turns (the answers' cached prompt tokens over their prompt tokens),
TTFT p50/p99 over every turn, the KV bytes handed from prefill to decode per request (the prefill
workers' llmd_handoff_bytes), and the requests the gateway routed by overlap.
Prints a Markdown table and writes bench/results/routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import numpy as np

from bench.serve import load_tokenizer
from bench.serving.client import RequestResult, Target, fetch_model_name, send_request
from bench.serving.workload import BenchRequest
from bench.stack_harness import (
    REQUEST_TIMEOUT_S,
    SCRAPE_TIMEOUT_S,
    format_table,
    metric_sum,
    scrape_metrics,
    scrape_workers,
    stack_config,
    vocab_ids,
    write_result,
)
from services.launcher import Stack
from shared.model.loader import resolve_model_path

NAME = "routing"
MODES = (("off", False), ("on", True))
MIB = 2**20
KV_BYTES = 256 * 2**20  # per worker: every conversation's history fits, so evictions do not blur the comparison


@dataclass(slots=True)
class Turn:
    conversation: int
    turn: int
    result: RequestResult


@dataclass(slots=True)
class ModeRun:
    mode: str
    turns: list[Turn]
    handoff_bytes: float
    routed: dict[str, float]  # "prefill"/"decode" -> requests routed by overlap
    duration_s: float

    @property
    def follow_ups(self) -> list[RequestResult]:
        return [t.result for t in self.turns if t.turn > 0]

    @property
    def hit_rate(self) -> float:
        prompt = sum(r.num_prompt_tokens for r in self.follow_ups)
        return sum(r.num_cached_tokens for r in self.follow_ups) / max(1, prompt)

    def ttft_ms(self, q: float) -> float:
        return float(np.percentile([t.result.ttft_s for t in self.turns if t.result.ttft_s is not None], q)) * 1000

    @property
    def mib_per_request(self) -> float:
        return self.handoff_bytes / MIB / max(1, len(self.turns))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def chat(target: Target, session: aiohttp.ClientSession, system: list[int], messages: list[list[int]],
               args: argparse.Namespace, conversation: int, encode: Any) -> list[Turn]:
    """One conversation, turn after turn; each answer joins the history the next turn sends."""
    history, turns = list(system), []
    loop = asyncio.get_running_loop()
    for i, message in enumerate(messages):
        history += message
        req = BenchRequest(prompt=list(history), num_prompt_tokens=len(history), max_tokens=args.output_len)
        result = await send_request(session, target, req, loop.time)
        if result.error is not None:
            raise RuntimeError(f"conversation {conversation} turn {i}: {result.error}")
        turns.append(Turn(conversation, i, result))
        history += encode(result.text)
    return turns


async def run_chats(base_url: str, args: argparse.Namespace) -> tuple[list[Turn], float]:
    rng = np.random.default_rng(args.seed)
    vocab = vocab_ids()
    system = rng.choice(vocab, args.system_len).tolist()
    messages = [[rng.choice(vocab, args.user_len).tolist() for _ in range(args.turns)]
                for _ in range(args.conversations)]
    tokenizer = load_tokenizer(resolve_model_path("default"))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    async with aiohttp.ClientSession() as session:
        model = await fetch_model_name(session, base_url, SCRAPE_TIMEOUT_S)
        target = Target(url=f"{base_url}/v1/completions", model=model, timeout_s=REQUEST_TIMEOUT_S)
        # untimed: fresh tokens, so it primes no prefix of the run
        warm = BenchRequest(prompt=rng.choice(vocab, 64).tolist(), num_prompt_tokens=64, max_tokens=2)
        await send_request(session, target, warm, asyncio.get_running_loop().time)
        started = asyncio.get_running_loop().time()
        runs = await asyncio.gather(*(chat(target, session, system, messages[c], args, c, encode)
                                      for c in range(args.conversations)))
        duration_s = asyncio.get_running_loop().time() - started
    return [t for turns in runs for t in turns], duration_s


def routed_by_overlap(samples: dict[str, float], stage: str) -> float:
    return sum(v for k, v in samples.items()
               if k.startswith("llmd_routed_requests_total{") and 'by="overlap"' in k and f'stage="{stage}"' in k)


def run_mode(mode: str, enabled: bool, args: argparse.Namespace) -> ModeRun:
    env = {"LLMD_ROUTING__ENABLED": str(enabled).lower(), "LLMD_KV_CACHE__MEMORY_BYTES": str(KV_BYTES)}
    print(f"routing {mode}: starting 2 prefill + 2 decode workers", file=sys.stderr)
    with Stack(stack_config(env, num_prefill=2, num_decode=2)) as stack:
        before = scrape_workers(stack, "prefill")
        turns, duration_s = asyncio.run(run_chats(stack.base_url, args))
        after = scrape_workers(stack, "prefill")
        gateway = scrape_metrics(f"{stack.base_url}/metrics")
    handoff = metric_sum(after, "llmd_handoff_bytes_total") - metric_sum(before, "llmd_handoff_bytes_total")
    routed = {stage: routed_by_overlap(gateway, stage) for stage in ("prefill", "decode")}
    return ModeRun(mode, turns, handoff, routed, duration_s)


def table(runs: list[ModeRun]) -> str:
    header = ["routing", "follow-ups' prompt tokens cached", "TTFT p50", "TTFT p99", "KV moved per request",
              "routed by cache (prefill / decode)"]
    rows = [[r.mode, f"{100 * r.hit_rate:.1f}%", f"{r.ttft_ms(50):.0f} ms", f"{r.ttft_ms(99):.0f} ms",
             f"{r.mib_per_request:.1f} MiB", f"{r.routed['prefill']:.0f} / {r.routed['decode']:.0f} of {len(r.turns)}"]
            for r in runs]
    return format_table(header, rows)


def document(args: argparse.Namespace, runs: list[ModeRun]) -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": vars(args),
        "modes": {r.mode: {
            "follow_up_hit_rate": r.hit_rate, "ttft_p50_ms": r.ttft_ms(50), "ttft_p99_ms": r.ttft_ms(99),
            "kv_mib_per_request": r.mib_per_request, "routed_by_overlap": r.routed, "duration_s": r.duration_s,
            "turns": [{"conversation": t.conversation, "turn": t.turn, "prompt_tokens": t.result.num_prompt_tokens,
                       "cached_tokens": t.result.num_cached_tokens, "ttft_s": t.result.ttft_s} for t in r.turns],
        } for r in runs},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [run_mode(mode, enabled, args) for mode, enabled in MODES]
    path = write_result(NAME, document(args, runs))
    print(table(runs))
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
