"""The services' event loop is uvloop's (shared/event_loop.py)."""

from __future__ import annotations

import asyncio

import uvloop

from shared import event_loop


def test_run_runs_the_coroutine_on_a_uvloop_loop_and_returns_its_result() -> None:
    async def which_loop() -> type[asyncio.AbstractEventLoop]:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop())

    assert event_loop.run(which_loop()) is uvloop.Loop
    loop = event_loop.new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
