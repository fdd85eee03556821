"""The event loop the gateway and the workers run on: uvloop's, whose loop (libuv, in C) spends less
per callback, socket read and socket write than asyncio's own.

Those are most of what the gateway does per token (read the workers' replies from Redis, write
server-sent events) and most of what a worker's event loop does beside its engine thread. On a
2-core Zen 4, with the tiny model of `make bench-overhead` (a burst of 256 prompts, 6 alternated
pairs of stacks), the stack served 4,243 output tokens/s on asyncio's loop and 4,615 on uvloop's
(medians), spending 354 and 324 µs of CPU per output token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a new uvloop loop."""
    return uvloop.run(main)
