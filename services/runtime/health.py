"""A worker's small HTTP server: `/health` for orchestrators, `/metrics` for Prometheus."""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web


class Observable(Protocol):
    def health(self) -> tuple[int, dict[str, Any]]:
        """HTTP status and JSON body of /health."""

    def render_metrics(self) -> tuple[bytes, str]:
        """Body and content type of /metrics."""


SOURCE = web.AppKey("source", Observable)


def create_health_app(source: Observable) -> web.Application:
    app = web.Application()
    app[SOURCE] = source
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _health(request: web.Request) -> web.Response:
    status, body = request.app[SOURCE].health()
    return web.json_response(body, status=status)


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[SOURCE].render_metrics()
    return web.Response(body=body, headers={"Content-Type": content_type})
