"""A small real OpenAI-style streaming server for testing the benchmark client.

It answers /v1/completions with `max_tokens // tokens_per_chunk` SSE chunks (ignore_eos
semantics), an optional usage event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


class ScriptedClock:
    """Reads return the time the server set last. Each read is signalled, so the server
    writes its next chunk only after the client has stamped the previous one: every
    chunk gets exactly its scripted time however the event loop interleaves."""

    def __init__(self, now: float) -> None:
        self.now = now
        self._read = asyncio.Event()

    def __call__(self) -> float:
        self._read.set()
        return self.now

    async def wait_for_read(self) -> None:
        await self._read.wait()
        self._read.clear()

    def forget_reads(self) -> None:
        self._read.clear()


@dataclass
class StubScript:
    tokens_per_chunk: int = 1
    send_usage: bool = True
    status: int = 200
    error_after_chunks: int | None = None
    hang_after_chunks: int | None = None
    num_peers: int = 1
    clock: ScriptedClock | None = None
    chunk_times: list[float] = field(default_factory=list)


class StubServer:
    def __init__(self, script: StubScript) -> None:
        self.script = script
        self.payloads: list[dict[str, Any]] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.released = asyncio.Event()
        self._peers_arrived = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        if self.script.status != 200:
            body = {"error": {"message": "prompt is too long", "type": "invalid_request_error", "code": 400}}
            return web.json_response(body, status=self.script.status)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            await self._wait_for_peers()
            return await self._stream(request, payload)
        finally:
            self.num_in_flight -= 1

    async def _wait_for_peers(self) -> None:
        # holding every stream until num_peers are in flight proves they were sent concurrently
        if self.num_in_flight >= self.script.num_peers:
            self._peers_arrived.set()
        await self._peers_arrived.wait()

    async def _stream(self, request: web.Request, payload: dict[str, Any]) -> web.StreamResponse:
        script = self.script
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        num_chunks = payload["max_tokens"] // script.tokens_per_chunk
        if script.clock is not None:
            script.clock.forget_reads()
        for k in range(num_chunks):
            if k == script.error_after_chunks:
                await _send(resp, {"error": {"message": "worker lost", "type": "server_error", "code": 500}})
                return resp
            if k == script.hang_after_chunks:
                await self.released.wait()
                return resp
            await self._send_chunk(resp, payload, k, is_last=k == num_chunks - 1)
        if script.send_usage:
            await _send(resp, _usage_event(payload, num_chunks * script.tokens_per_chunk))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _send_chunk(self, resp: web.StreamResponse, payload: dict[str, Any], k: int, is_last: bool) -> None:
        clock = self.script.clock
        if clock is not None:
            clock.now = self.script.chunk_times[k]
        text = "tok " * self.script.tokens_per_chunk
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length" if is_last else None}
        await _send(
            resp, {"id": "cmpl-stub", "object": "text_completion", "model": payload["model"], "choices": [choice]}
        )
        if clock is not None:
            await clock.wait_for_read()


async def _send(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    await resp.write(f"data: {json.dumps(data)}\n\n".encode())


def _usage_event(payload: dict[str, Any], num_output_tokens: int) -> dict[str, Any]:
    prompt = payload["prompt"]
    num_prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
    usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens}
    return {"id": "cmpl-stub", "object": "text_completion", "choices": [], "usage": usage}
