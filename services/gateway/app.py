"""The gateway's aiohttp application: OpenAI-compatible REST in front of the prefill and decode pools.

It never runs the model: it validates and tokenises, queues requests on Redis, and streams
back the tokens the workers send to its replies stream. Run it with handler cancellation on
(`python -m services.gateway` does), so that a client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from services.gateway.context import GATEWAY, SETTINGS, build_gateway
from services.gateway.middlewares import api_key_auth, openai_errors
from services.gateway.model_info import load_model_info
from services.gateway.routes import add_routes
from services.pool_planner.loop import watch_pools
from shared.settings import GatewayServiceSettings
from shared.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Resources = Callable[[web.Application], AsyncIterator[None]]


def create_app(settings: GatewayServiceSettings, tokenizer: Tokenizer | None = None) -> web.Application:
    """The application; `tokenizer` skips loading one from the model path (tests share one)."""
    middlewares = [openai_errors]
    if settings.gateway.api_key_list:
        middlewares.append(api_key_auth(settings.gateway.api_key_list))
    app = web.Application(middlewares=middlewares, client_max_size=settings.gateway.max_body_bytes)
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_resources(tokenizer))
    add_routes(app)
    return app


def _resources(tokenizer: Tokenizer | None) -> Resources:
    async def resources(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        model = await asyncio.to_thread(load_model_info, settings.model)
        model_tokenizer = tokenizer or await asyncio.to_thread(
            Tokenizer.from_path, str(model.path), settings.model.disk_cache
        )
        # the streams' detokenisers read this table; built on the event loop it would stall the first one
        await asyncio.to_thread(model_tokenizer.byte_pieces)
        gw = build_gateway(settings, model, model_tokenizer)
        app[GATEWAY] = gw
        gw.reader = asyncio.create_task(gw.router.run(), name="replies-reader")
        gw.reader.add_done_callback(_log_reader_exit)
        watcher = asyncio.create_task(gw.dispatcher.watch(), name="migration-watch")
        kv_feed = asyncio.create_task(gw.kv_feed.run(), name="kv-index-feed")
        kv_feed.add_done_callback(_log_feed_exit)
        stop_pool_watch = asyncio.Event()
        planner = settings.planner
        pool_watch = asyncio.create_task(watch_pools(
            gw.bus, planner, settings.targets, stop_pool_watch,
            lambda pools: gw.metrics.observe_pools(pools, planner.target_load),
        ), name="pool-watch")
        _log_start(settings, gw.gateway_id, model.name, model.max_model_len)
        yield
        gw.router.stop()
        gw.dispatcher.stop()
        gw.kv_feed.stop()
        stop_pool_watch.set()
        gw.reader.cancel()
        await asyncio.gather(gw.reader, watcher, pool_watch, kv_feed, return_exceptions=True)
        await gw.wait_spawned()  # cancels on their way to the workers
        await gw.bus.close()
        logger.info("gateway %s stopped", gw.gateway_id)

    return resources


def _log_start(settings: GatewayServiceSettings, gateway_id: str, model_name: str, max_model_len: int) -> None:
    cfg = settings.gateway
    logger.info(
        "gateway %s: model %s (context %d tokens), redis %s namespace %s, auth %s, "
        "admits %d requests / %d prompt tokens in flight, request timeout %g s",
        gateway_id, model_name, max_model_len, settings.redis.url, settings.redis.namespace,
        f"on ({len(cfg.api_key_list)} keys)" if cfg.api_key_list else "off",
        cfg.max_queued_requests, cfg.max_queued_prompt_tokens, cfg.request_timeout_s,
    )  # fmt: skip


def _log_feed_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the KV index feed crashed; routing by load from now on", exc_info=task.exception())


def _log_reader_exit(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the replies reader crashed; /ready reports it", exc_info=task.exception())
