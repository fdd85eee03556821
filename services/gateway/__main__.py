"""`python -m services.gateway`: settings from the environment (LLMD_*), serve until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

from aiohttp import web

from services.gateway.app import create_app
from shared import event_loop
from shared.gc_tuning import freeze_startup_heap
from shared.model.paths import ModelNotFoundError
from shared.settings import GatewayServiceSettings, warn_unknown_settings

logger = logging.getLogger("services.gateway")

# Longer than a typical generation, shorter than an orchestrator's kill timeout (30 s).
SHUTDOWN_TIMEOUT_S = 25.0


def main() -> None:
    settings = GatewayServiceSettings()
    logging.basicConfig(
        level=settings.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s [gateway] %(name)s: %(message)s"
    )
    warn_unknown_settings()
    cfg = settings.gateway

    where: dict[str, Any] = {"host": cfg.host, "port": cfg.port}
    host, port = cfg.host, cfg.port
    if cfg.listen_fd is not None:  # bound by the launcher
        inherited = socket.socket(fileno=cfg.listen_fd)
        host, port = inherited.getsockname()[:2]
        where = {"sock": inherited}

    def announce(_: str) -> None:
        logger.info("listening on http://%s:%d", host, port)

    app = create_app(settings)
    # after the app's own start-up (its resources come first), and only in the gateway's process
    app.on_startup.append(_freeze_startup_heap)
    try:
        web.run_app(
            app, **where, handler_cancellation=True, access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S, print=announce, loop=event_loop.new_event_loop(),
        )  # fmt: skip
    except ModelNotFoundError as e:
        logger.error("%s", e)
        sys.exit(1)


async def _freeze_startup_heap(_: web.Application) -> None:
    freeze_startup_heap()


if __name__ == "__main__":
    main()
