"""The gateway's resources, built once at start-up and shared by every handler through `GATEWAY`."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from services.gateway.admission import Admission
from services.gateway.dispatcher import Dispatcher
from services.gateway.kv_feed import KVIndexFeed
from services.gateway.kv_index import KVIndex
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_info import ModelInfo
from services.gateway.openai_schema import ApiError
from services.gateway.replies import ReplyRouter
from services.gateway.router import Router
from shared.settings import GatewayServiceSettings, GatewaySettings
from shared.streams import Bus
from shared.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from shared.engine.structured import Grammars

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Gateway:
    settings: GatewaySettings
    gateway_id: str
    model: ModelInfo
    tokenizer: Tokenizer
    bus: Bus
    router: ReplyRouter
    dispatcher: Dispatcher
    admission: Admission
    metrics: GatewayMetrics
    kv_feed: KVIndexFeed
    reader: asyncio.Task[None] | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _grammars: Grammars | None = None

    def grammars(self) -> Grammars:
        """The grammar compiler, built on first use (about half a second): requests without a
        constraint never need it. Call it off the event loop."""
        if self._grammars is None:
            # imported here: xgrammar and torch would add seconds to every gateway's start
            from shared.engine.structured import Grammars

            tokenizer = self.tokenizer
            self._grammars = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
        return self._grammars

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` to its end even if the handler that started it is cancelled (client gone)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_spawned(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model.name:
            raise ApiError(
                404, f"The model `{name}` does not exist; this server serves `{self.model.name}` (see /v1/models).",
                param="model", code="model_not_found",
            )


GATEWAY = web.AppKey("gateway", Gateway)
SETTINGS = web.AppKey("settings", GatewayServiceSettings)


def default_gateway_id() -> str:
    return f"gateway-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def build_gateway(settings: GatewayServiceSettings, model: ModelInfo, tokenizer: Tokenizer) -> Gateway:
    cfg = settings.gateway
    gateway_id = cfg.gateway_id or default_gateway_id()
    bus = Bus(settings.redis)
    admission = Admission(cfg.max_queued_requests, cfg.max_queued_prompt_tokens)
    metrics = GatewayMetrics(model.name, lambda: admission.num_requests)
    router = ReplyRouter(bus, gateway_id, metrics.phase_seconds)
    index = KVIndex()
    routing = Router(bus, index, settings.routing, on_route=metrics.observe_route)
    return Gateway(
        settings=cfg, gateway_id=gateway_id, model=model, tokenizer=tokenizer, bus=bus, router=router,
        dispatcher=Dispatcher(bus, router, gateway_id, on_migrated=metrics.migrations.inc, routing=routing),
        admission=admission, metrics=metrics, kv_feed=KVIndexFeed(bus, index),
    )  # fmt: skip
