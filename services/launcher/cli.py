"""Runs the whole stack on one machine: Redis (unless REDIS_URL is set), one gateway, N prefill and
M decode workers, and K colocated workers (one engine doing both, for comparison), each its own
process.

    python -m services.launcher --port 8000 --prefill 1 --decode 1 --model PATH --dtype auto
    python -m services.launcher --prefill 0 --decode 0 --colocated 1

Every child gets LLMD_REDIS__URL and a unique LLMD_WORKER__WORKER_ID. Each worker may use every
core (LLMD_TORCH_THREADS), and the workers lend each other idle ones (services/runtime/core_lease.py); with
LLMD_WORKER__ELASTIC_THREADS=false the cores are divided among the workers instead. Ctrl-C or
SIGTERM stops everything: SIGTERM (workers drain), a grace period, then SIGKILL; the private
Redis goes last. `Stack` is the same as a library, for tests and scripts, and can add and stop
workers while it runs.

Scaling at run time: the CLI reads commands on stdin, one per line:

    +prefill, +decode, +colocated   start one more worker of that role (it takes work once its
                                    heartbeat is up)
    -prefill, -decode, -colocated   SIGTERM the newest worker of that role: it drains (takes no new
                                    work, finishes what it holds) and deregisters; refused for the
                                    last one

With --planner the pool planner (services/pool_planner) issues these commands itself, sizing the
prefill and decode pools to their latency targets within --planner-max-workers workers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import urllib.error
import urllib.request
from typing import get_args

from services.launcher.redis_server import StackError
from services.launcher.stack import ROLES, Stack, StackConfig
from services.pool_planner.loop import PlannerThread
from shared.settings import GatewaySettings, KVCacheDType, PlannerServiceSettings

logger = logging.getLogger("launcher")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.launcher", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8000, help="gateway port (0: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="number of decode workers")
    parser.add_argument("--colocated", type=int, default=0,
                        help="number of colocated workers (prefill and decode in one engine)")
    parser.add_argument("--model", default="default", help="a .gguf file or a Hugging Face checkpoint folder")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=get_args(KVCacheDType),
                        help="how every worker's KV pool stores keys and values (LLMD_KV_CACHE__DTYPE)")
    parser.add_argument("--no-gateway", action="store_true", help="start Redis and the workers only")
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="seconds to drain on stop before SIGKILL")
    parser.add_argument("--planner", action="store_true",
                        help="size the prefill and decode pools to their latency targets (LLMD_PLANNER__*; "
                             "services/pool_planner): start and drain workers as their load says")
    parser.add_argument("--planner-max-workers", type=int, default=4,
                        help="--planner: most prefill and decode workers together")
    args = parser.parse_args(argv)
    if min(args.prefill, args.decode, args.colocated) < 0:
        parser.error("--prefill, --decode and --colocated must be at least 0")
    if (args.prefill < 1 or args.decode < 1) and not (args.prefill == args.decode == 0 and args.colocated > 0):
        parser.error("--prefill and --decode must both be at least 1, or both 0 with --colocated at least 1")
    if args.planner and (args.colocated or args.planner_max_workers < args.prefill + args.decode):
        parser.error("--planner sizes the prefill and decode pools: not with --colocated, and --planner-max-workers "
                     f"({args.planner_max_workers}) must be at least --prefill + --decode ({args.prefill + args.decode})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [launcher] %(message)s")
    stack = Stack(StackConfig(
        port=args.port, host=args.host, num_prefill=args.prefill, num_decode=args.decode,
        num_colocated=args.colocated, model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        gateway=not args.no_gateway,
        stop_timeout_s=args.stop_timeout,
    ))
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        logger.info("%s: shutting down", signal.Signals(signum).name)
        stop.set()
        stack.abort()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    planner: PlannerThread | None = None
    try:
        stack.start()
        print(ready_banner(stack, {"prefill": args.prefill, "decode": args.decode, "colocated": args.colocated}),
              flush=True)
        commands: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_read_commands, args=(commands,), daemon=True, name="stdin").start()
        if args.planner:
            assert stack.redis_url is not None
            planner_settings = PlannerServiceSettings()
            planner = PlannerThread(stack.redis_url, stack.namespace, planner_settings.planner,
                                    planner_settings.targets, args.planner_max_workers, commands.put)
            planner.start()
        return _watch(stack, stop, commands)
    except StackError as e:
        logger.error("%s", e)
        return 1
    finally:
        if planner is not None:
            planner.stop()
        stack.stop()


def ready_banner(stack: Stack, counts: dict[str, int]) -> str:
    """What the CLI prints on stdout once everything serves: the URL on a line of its own, apart from the log."""
    workers = " + ".join(f"{n} {role}" for role, n in counts.items() if n)
    if stack.base_url is None:
        where = f"workers only, Redis at {stack.redis_url} namespace {stack.namespace}"
    else:
        model = _served_model(stack.base_url, {**os.environ, **stack.config.env})
        where = f"{stack.base_url}  (OpenAI API at {stack.base_url}/v1{f', model {model}' if model else ''})"
    return f"\n  ready: {where}\n  {workers} worker(s); Ctrl-C stops everything; +ROLE or -ROLE on stdin scales\n"


def _served_model(base_url: str, env: dict[str, str]) -> str | None:
    """The model id that /v1/models lists first (None if it cannot be read)."""
    api_keys = GatewaySettings(api_keys=env.get("LLMD_GATEWAY__API_KEYS", "")).api_key_list
    headers = {"Authorization": f"Bearer {api_keys[0]}"} if api_keys else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base_url}/v1/models", headers=headers), timeout=5) as r:
            return str(json.load(r)["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, LookupError):
        return None


def _read_commands(commands: queue.Queue[str]) -> None:
    for line in sys.stdin:
        if line.strip():
            commands.put(line.strip())


def apply_command(stack: Stack, command: str) -> str:
    """Carry out one scaling command (see the module's doc); returns what was done, for the log.
    Runs on the thread that started the stack: children die with the thread that spawned them."""
    sign, role = command[:1], command[1:].strip()
    if sign not in ("+", "-") or role not in ROLES:
        return f"unknown command {command!r}: use +ROLE or -ROLE with ROLE one of {', '.join(ROLES)}"
    if sign == "+":
        return f"started {stack.add_worker(role, wait=False)}"
    name = stack.newest_worker(role)
    if name is None or stack.num_workers(role) <= 1:
        return f"not removing the last {role} worker"
    stack.drain_worker(name)
    return f"draining {name} (SIGTERM)"


def _watch(stack: Stack, stop: threading.Event, commands: queue.Queue[str]) -> int:
    """Carry out scaling commands and report children that die; a dead gateway ends the stack."""
    reported: set[str] = set()
    while not stop.wait(0.2):
        while not commands.empty():
            logger.info("%s", apply_command(stack, commands.get_nowait()))
        for name, code in stack.exited().items():
            if name not in reported:
                logger.error("%s exited with code %d", name, code)
                reported.add(name)
            if name == "gateway":
                return 1
    return 0
