"""Everything but generation: the model list, tokenisation, and the probes and metrics operators use."""

from __future__ import annotations

from aiohttp import web

from services.gateway import api
from services.gateway.body import read_body
from services.gateway.context import GATEWAY, Gateway
from services.gateway.openai_responses import models_body
from services.gateway.openai_schema import DetokenizeRequest, TokenizeRequest, check_token_ids, parse_request
from services.gateway.prompts import encode_chat, encode_text
from shared.streams import REDIS_ERRORS, STAGE_ROLES

OWNED_BY = "llmd"


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)


async def models(request: web.Request) -> web.Response:
    model = request.app[GATEWAY].model
    return web.json_response(models_body([model.name], model.created, OWNED_BY))


async def tokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    req = parse_request(TokenizeRequest, await read_body(request, gw.settings.max_body_bytes))
    gw.check_model(req.model)
    if req.prompt is not None:
        token_ids = await encode_text(gw.tokenizer, req.prompt, req.add_special_tokens)
    else:
        token_ids = await encode_chat(gw.tokenizer, req.template_messages(), req.add_generation_prompt)
    return web.json_response({"count": len(token_ids), "max_model_len": gw.model.max_model_len, "tokens": token_ids})


async def detokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    req = parse_request(DetokenizeRequest, await read_body(request, gw.settings.max_body_bytes))
    gw.check_model(req.model)
    check_token_ids(req.tokens, gw.tokenizer.vocab_size, "tokens")
    return web.json_response({"prompt": gw.tokenizer.decode(req.tokens)})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "gateway_id": request.app[GATEWAY].gateway_id})


async def ready(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    reason = await _not_ready_reason(gw)
    if reason is not None:
        return web.json_response({"status": "not ready", "reason": reason}, status=503)
    return web.json_response({"status": "ready"})


async def _not_ready_reason(gw: Gateway) -> str | None:
    if gw.reader is None or gw.reader.done():
        return "the replies reader is not running"
    if not await gw.bus.ping():
        return f"Redis at {gw.bus.settings.url} is unreachable"
    try:
        for stage, roles in STAGE_ROLES.items():
            workers = [w for role in roles for w in await gw.bus.live_workers(role)]
            if not any(not w.draining for w in workers):
                return f"no live {stage} worker (namespace {gw.bus.settings.namespace!r})"
    except REDIS_ERRORS as e:
        return f"cannot list workers: {e}"
    return None


async def metrics(request: web.Request) -> web.Response:
    gw_metrics = request.app[GATEWAY].metrics
    return web.Response(body=gw_metrics.render(), headers={"Content-Type": gw_metrics.content_type})
