"""Comparison: cache-aware routing off vs on, on multi-turn chat over 2 prefill + 2 decode workers.

    python -m bench.routing [--conversations 8 --turns 4 --system-len 1000 --user-len 64 --output-len 16 --seed 0]
    python -m bench.routing --load-weights 0,1,4 --user-len 320     # the prefill load weight, swept

Four stacks, one after the other, with the same settings but these: 2 prefill + 2 decode
workers with routing off (LLMD_ROUTING__ENABLED=false: the shared stream), on but with no local
prefill, and on (a follow-up's short new part prefilled on the decode worker that holds its
history), and 1 + 1 workers (what a single pair caches, the hit rate to match). --conversations
chats run side by side, each for --turns turns: a turn sends the whole history (a --system-len token system prompt that all conversations
share, then every earlier user message and answer) plus a new --user-len token message, and gets
--output-len tokens (greedy, so every mode sees the same answers). The first turns all run
first, then the follow-ups, so that each phase's KV handoffs are counted apart. Measured per
mode, over the follow-up turns: the prefix hit rate (cached prompt tokens over prompt tokens),
TTFT p50/p99, ITL p99 (over every turn: what a prefill on a decode worker costs the others), the
KV bytes handed from prefill to decode per follow-up (the prefill workers' llmd_handoff_bytes), the requests prefilled on their decode worker, and those routed by overlap.
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
from shared.model.paths import resolve_model_path
from shared.settings import RoutingSettings

NAME = "routing"
NO_LOCAL = {"LLMD_ROUTING__LOCAL_PREFILL_MAX_TOKENS": "0"}


@dataclass(slots=True, frozen=True)
class Mode:
    name: str
    num_workers: int  # per role
    env: dict[str, str]


MODES = (
    Mode("2+2, off", 2, {"LLMD_ROUTING__ENABLED": "false"}), Mode("2+2, on, no local prefill", 2, NO_LOCAL),
    Mode("2+2, on", 2, {}), Mode("1+1, on", 1, {}),
)


def load_weight_modes(weights: str) -> list[Mode]:
    """2+2 workers routing with each LLMD_ROUTING__LOAD_WEIGHT of a comma-separated list."""
    return [Mode(f"2+2, on, load weight {w}", 2, {"LLMD_ROUTING__LOAD_WEIGHT": w}) for w in weights.split(",")]
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
    follow_up_handoff_bytes: float
    routed: dict[str, float]  # "prefill"/"decode" -> requests routed by overlap, "local" -> prefilled on decode
    duration_s: float

    @property
    def follow_ups(self) -> list[RequestResult]:
        return [t.result for t in self.turns if t.turn > 0]

    @property
    def hit_rate(self) -> float:
        prompt = sum(r.num_prompt_tokens for r in self.follow_ups)
        return sum(r.num_cached_tokens for r in self.follow_ups) / max(1, prompt)

    def ttft_ms(self, q: float) -> float:
        return float(np.percentile([r.ttft_s for r in self.follow_ups if r.ttft_s is not None], q)) * 1000

    def itl_ms(self, q: float) -> float:
        """Over every turn's gaps: a prefill on a decode worker delays the other streams it runs."""
        gaps = np.concatenate([np.diff(t.result.chunk_times_s) for t in self.turns] + [np.zeros(0)])
        return float(np.percentile(gaps, q)) * 1000 if len(gaps) else 0.0

    @property
    def mib_per_follow_up(self) -> float:
        return self.follow_up_handoff_bytes / MIB / max(1, len(self.follow_ups))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-weights", help="instead of the modes above, 2+2 routing with each of these "
                   "comma-separated LLMD_ROUTING__LOAD_WEIGHT values (try with --user-len beyond "
                   f"{RoutingSettings().local_prefill_max_tokens}, so that prefill workers get the follow-ups)")
    return p.parse_args(argv)


@dataclass(slots=True)
class Conversation:
    """One chat: the history the next turn sends (each answer joins it), and its turns so far."""

    index: int
    history: list[int]
    messages: list[list[int]]
    turns: list[Turn]

    async def take_turns(self, target: Target, session: aiohttp.ClientSession, turns: range,
                         args: argparse.Namespace, encode: Any) -> None:
        loop = asyncio.get_running_loop()
        for i in turns:
            self.history += self.messages[i]
            req = BenchRequest(prompt=list(self.history), num_prompt_tokens=len(self.history),
                               max_tokens=args.output_len)
            result = await send_request(session, target, req, loop.time)
            if result.error is not None:
                raise RuntimeError(f"conversation {self.index} turn {i}: {result.error}")
            self.turns.append(Turn(self.index, i, result))
            self.history += encode(result.text)


async def run_chats(stack: Stack, args: argparse.Namespace) -> tuple[list[Turn], float, float]:
    """Every conversation's turns: (turns, seconds, KV bytes handed off during the follow-ups)."""
    rng = np.random.default_rng(args.seed)
    vocab = vocab_ids()
    system = rng.choice(vocab, args.system_len).tolist()
    messages = [[rng.choice(vocab, args.user_len).tolist() for _ in range(args.turns)]
                for _ in range(args.conversations)]
    tokenizer = load_tokenizer(resolve_model_path("default"))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    chats = [Conversation(c, list(system), messages[c], []) for c in range(args.conversations)]
    async with aiohttp.ClientSession() as session:
        model = await fetch_model_name(session, stack.base_url, SCRAPE_TIMEOUT_S)
        target = Target(url=f"{stack.base_url}/v1/completions", model=model, timeout_s=REQUEST_TIMEOUT_S)
        # untimed: fresh tokens, so it primes no prefix of the run
        warm = BenchRequest(prompt=rng.choice(vocab, 64).tolist(), num_prompt_tokens=64, max_tokens=2)
        await send_request(session, target, warm, asyncio.get_running_loop().time)
        started = asyncio.get_running_loop().time()
        await asyncio.gather(*(c.take_turns(target, session, range(1), args, encode) for c in chats))
        before = await asyncio.to_thread(handoff_bytes, stack)
        await asyncio.gather(*(c.take_turns(target, session, range(1, args.turns), args, encode) for c in chats))
        follow_up_bytes = await asyncio.to_thread(handoff_bytes, stack) - before
        duration_s = asyncio.get_running_loop().time() - started
    return [t for c in chats for t in c.turns], duration_s, follow_up_bytes


def handoff_bytes(stack: Stack) -> float:
    return metric_sum(scrape_workers(stack, "prefill"), "llmd_handoff_bytes_total")


def routed_by(samples: dict[str, float], stage: str, by: str) -> float:
    return sum(v for k, v in samples.items()
               if k.startswith("llmd_routed_requests_total{") and f'by="{by}"' in k and f'stage="{stage}"' in k)


def run_mode(mode: Mode, args: argparse.Namespace) -> ModeRun:
    env = {"LLMD_KV_CACHE__MEMORY_BYTES": str(KV_BYTES), **mode.env}
    n = mode.num_workers
    print(f"routing {mode.name}: starting {n} prefill + {n} decode workers", file=sys.stderr)
    with Stack(stack_config(env, num_prefill=n, num_decode=n)) as stack:
        turns, duration_s, follow_up_bytes = asyncio.run(run_chats(stack, args))
        gateway = scrape_metrics(f"{stack.base_url}/metrics")
    routed = {"prefill": routed_by(gateway, "prefill", "overlap"), "decode": routed_by(gateway, "decode", "overlap"),
              "local": routed_by(gateway, "prefill", "local")}
    return ModeRun(mode.name, turns, follow_up_bytes, routed, duration_s)


def table(runs: list[ModeRun]) -> str:
    header = ["workers, routing", "follow-ups' prompt tokens cached", "follow-ups' TTFT p50", "TTFT p99", "ITL p99",
              "KV moved per follow-up", "prefilled on decode", "routed by cache (prefill / decode)"]
    rows = [[r.mode, f"{100 * r.hit_rate:.1f}%", f"{r.ttft_ms(50):.0f} ms", f"{r.ttft_ms(99):.0f} ms",
             f"{r.itl_ms(99):.0f} ms", f"{r.mib_per_follow_up:.2f} MiB", f"{r.routed['local']:.0f} of {len(r.follow_ups)}",
             f"{r.routed['prefill']:.0f} / {r.routed['decode']:.0f} of {len(r.turns)}"]
            for r in runs]
    return format_table(header, rows)


def document(args: argparse.Namespace, runs: list[ModeRun]) -> dict[str, Any]:
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": vars(args),
        "modes": {r.mode: {
            "follow_up_hit_rate": r.hit_rate, "follow_up_ttft_p50_ms": r.ttft_ms(50),
            "follow_up_ttft_p99_ms": r.ttft_ms(99), "itl_p99_ms": r.itl_ms(99), "kv_mib_per_follow_up": r.mib_per_follow_up, "routed": r.routed,
            "duration_s": r.duration_s,
            "turns": [{"conversation": t.conversation, "turn": t.turn, "prompt_tokens": t.result.num_prompt_tokens,
                       "cached_tokens": t.result.num_cached_tokens, "ttft_s": t.result.ttft_s} for t in r.turns],
        } for r in runs},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = load_weight_modes(args.load_weights) if args.load_weights else MODES
    runs = [run_mode(mode, args) for mode in modes]
    path = write_result(f"{NAME}_load_weights" if args.load_weights else NAME, document(args, runs))
    print(table(runs))
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
