"""One streamed /v1/completions request, timed chunk by chunk."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.serving.sse import DONE, SSEDecoder
from bench.serving.workload import BenchRequest

Clock = Callable[[], float]


@dataclass(slots=True, frozen=True)
class Target:
    """Where and how to send: the full completions URL and what every payload carries."""

    url: str
    model: str
    timeout_s: float
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        # ignore_eos + max_tokens pin the output length, so runs are comparable across servers.
        return {
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times are seconds on the benchmark's clock.

    A chunk is an SSE event with a non-empty `choices` list (its text may be empty, e.g.
    while the server holds back a partial UTF-8 character). Events read in the same network
    read share a timestamp.
    """

    start_s: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    chunk_times_s: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""  # the answer (first choice), for workloads whose next request builds on it
    num_cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage.prompt_tokens_details)

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def latency_s(self) -> float | None:
        """End-to-end latency: send to the last chunk."""
        return self.chunk_times_s[-1] if self.chunk_times_s else None

    @property
    def itl_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float | None:
        """(latency - ttft) / (output tokens - 1); undefined for outputs of one token."""
        if not self.success or self.num_output_tokens < 2:
            return None
        assert self.latency_s is not None and self.ttft_s is not None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class _StreamRecord:
    chunk_times_s: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: str | None = None
    is_done: bool = False

    def add(self, event: str, elapsed_s: float) -> None:
        if event == DONE:
            self.is_done = True
            return
        data = json.loads(event)
        if not isinstance(data, dict):
            raise ValueError(f"stream event is not a JSON object: {event[:100]}")
        if data.get("error"):
            self.error = f"stream error: {_error_message(data)}"
        if data.get("choices"):
            self.chunk_times_s.append(elapsed_s)
            self.texts.append(data["choices"][0].get("text") or "")
        if data.get("usage"):
            self.usage = data["usage"]

    def finish(self, result: RequestResult) -> None:
        result.chunk_times_s = self.chunk_times_s
        # usage may be repeated on every chunk; the last one is the complete count.
        usage = self.usage or {}
        result.num_output_tokens = usage.get("completion_tokens") or len(self.chunk_times_s)
        result.num_prompt_tokens = usage.get("prompt_tokens") or result.num_prompt_tokens
        result.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        result.text = "".join(self.texts)
        if self.error is None and not self.chunk_times_s:
            self.error = "stream ended before the first chunk"
        result.error = self.error


async def send_request(
    session: aiohttp.ClientSession, target: Target, req: BenchRequest, clock: Clock
) -> RequestResult:
    """Send one request and stream its answer; never raises for server or network errors,
    which land in `RequestResult.error` instead."""
    start = clock()
    result = RequestResult(start_s=start, num_prompt_tokens=req.num_prompt_tokens)
    record = _StreamRecord()
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    try:
        async with session.post(target.url, json=target.payload(req), headers=target.headers, timeout=timeout) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {await _error_body(resp)}"
            else:
                await _read_stream(resp, record, clock, start)
    except TimeoutError:
        record.error = f"timed out after {target.timeout_s:g} s"
    except (aiohttp.ClientError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.finish(result)
    return result


async def fetch_model_name(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> str:
    """The first model that /v1/models lists."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(f"{base_url}/v1/models", timeout=timeout) as resp:
        resp.raise_for_status()
        models = (await resp.json())["data"]
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


async def _read_stream(resp: aiohttp.ClientResponse, record: _StreamRecord, clock: Clock, start: float) -> None:
    decoder = SSEDecoder()
    async for chunk in resp.content.iter_any():
        events = decoder.feed(chunk)
        if events:
            elapsed_s = clock() - start
            for event in events:
                record.add(event, elapsed_s)
        if record.is_done or record.error:
            return
    for event in decoder.flush():
        record.add(event, clock() - start)


async def _error_body(resp: aiohttp.ClientResponse) -> str:
    text = (await resp.text(errors="replace")).strip()
    try:
        return _error_message(json.loads(text))
    except (ValueError, AttributeError):
        return text[:500] or (resp.reason or "")


def _error_message(body: dict[str, Any]) -> str:
    error = body.get("error", body)
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
