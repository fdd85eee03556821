"""POST /v1/completions and /v1/chat/completions: validate, tokenise, admit, generate, answer
as one JSON body or as server-sent events."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from services.gateway.body import read_body
from services.gateway.context import GATEWAY
from services.gateway.formats import CHAT, COMPLETION, ResponseFormat
from services.gateway.generation import Generation
from services.gateway.metrics import SSE
from services.gateway.openai_responses import SSE_DONE, Choice, PositionLogprobs, ResponseMeta, sse_event
from services.gateway.openai_schema import ApiError, ChatCompletionRequest, CompletionRequest, error_body, parse_request
from services.gateway.planner import ApiRequest, PromptLimits, plan_choices
from services.gateway.prompts import encode_chat, encode_prompts
from services.gateway.structured import checked_constraint
from services.gateway.tools import ToolChatFormat, plan_tools
from shared.engine.constraint import StructuredSpec

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True, frozen=True)
class Job:
    api_req: ApiRequest
    prompts: list[list[int]]
    limits: PromptLimits
    fmt: ResponseFormat
    arrived_at: float  # monotonic
    structured: StructuredSpec | None = None


async def completions(request: web.Request) -> web.StreamResponse:
    arrived_at = time.monotonic()
    gw = request.app[GATEWAY]
    api_req = parse_request(CompletionRequest, await read_body(request, gw.settings.max_body_bytes))
    gw.check_model(api_req.model)
    structured = await checked_constraint(gw.grammars, api_req, None)
    prompts = await encode_prompts(gw.tokenizer, api_req.prompt)
    limits = PromptLimits(gw.model.max_model_len, gw.settings.default_max_tokens, "prompt")
    return await respond(request, Job(api_req, prompts, limits, COMPLETION, arrived_at, structured))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived_at = time.monotonic()
    gw = request.app[GATEWAY]
    api_req = parse_request(ChatCompletionRequest, await read_body(request, gw.settings.max_body_bytes))
    gw.check_model(api_req.model)
    tools = plan_tools(api_req)
    structured = await checked_constraint(gw.grammars, api_req, tools.spec() if tools is not None else None)
    messages, fmt = api_req.template_messages(), CHAT
    template_tools = None
    if tools is not None:
        knows_tools = gw.tokenizer.template_knows_tools
        messages, template_tools = tools.prompt_messages(messages, knows_tools), tools.template_tools(knows_tools)
        fmt = ToolChatFormat(tools)
    prompt = await encode_chat(gw.tokenizer, messages, tools=template_tools)
    limits = PromptLimits(gw.model.max_model_len, None, "messages")  # chat may use the rest of the context
    return await respond(request, Job(api_req, [prompt], limits, fmt, arrived_at, structured))


async def respond(request: web.Request, job: Job) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    deadline = time.time() + gw.settings.request_timeout_s
    choices = plan_choices(job.api_req, job.prompts, job.limits, deadline, job.structured)
    meta = ResponseMeta(f"{job.fmt.id_prefix}-{uuid.uuid4().hex}", gw.model.name, int(time.time()))
    with gw.admission.hold(len(choices), sum(len(c.req.prompt_token_ids) for c in choices)):
        async with Generation(gw, meta.id, choices, job.arrived_at) as gen:
            if job.api_req.stream:
                return await stream(request, gen, job.fmt, meta, job.api_req.include_usage)
            return web.json_response(await collect(gen, job.fmt, meta))


async def collect(gen: Generation, fmt: ResponseFormat, meta: ResponseMeta) -> dict[str, object]:
    texts: dict[int, list[str]] = {c.planned.index: [] for c in gen.choices}
    logprobs: dict[int, list[PositionLogprobs]] = {}
    async for delta in gen.deltas():
        texts[delta.index].append(delta.text)
        if delta.logprobs is not None:
            logprobs.setdefault(delta.index, []).extend(delta.logprobs)
    choices = [
        Choice(c.planned.index, "".join(texts[c.planned.index]), c.finish_reason or "stop",
               logprobs.get(c.planned.index, []) if c.req.params.logprobs is not None else None)
        for c in gen.choices
    ]  # fmt: skip
    return fmt.body(meta, choices, gen.usage)


async def stream(
    request: web.Request, gen: Generation, fmt: ResponseFormat, meta: ResponseMeta, include_usage: bool
) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        await _write_events(response, gen, fmt, meta, include_usage, request.app[GATEWAY].metrics.phase_seconds)
    except ConnectionResetError:
        gen.abandon("client_disconnected")
    return response


async def _write_events(
    response: web.StreamResponse, gen: Generation, fmt: ResponseFormat, meta: ResponseMeta, include_usage: bool,
    phase_seconds: dict[str, float],
) -> None:
    """Every chunk, then `[DONE]`; a failure after the headers went out ends the stream with an error event.
    The time the chunks take is added to `phase_seconds` (GatewayMetrics)."""
    try:
        async for deltas in gen.delta_batches():
            started = time.perf_counter()
            await response.write(b"".join([sse_event(fmt.chunk(meta, delta), has_floats=delta.logprobs is not None)
                                            for delta in deltas]))
            phase_seconds[SSE] += time.perf_counter() - started
        if include_usage:
            await response.write(sse_event(fmt.usage_chunk(meta, gen.usage)))
    except ApiError as e:
        await response.write(sse_event(error_body(e)))
    except ConnectionResetError:
        raise
    except Exception:
        logger.exception("%s: streaming failed", meta.id)
        gen.abandon("failed")
        await response.write(sse_event(error_body(ApiError(500, "Internal error while streaming.", "server_error"))))
    await response.write(SSE_DONE)
