"""`python -m services.gateway`: settings from the environment (LLMD_*), serve until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import sys

from aiohttp import web

from services.gateway.app import create_app
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

    def announce(_: str) -> None:
        logger.info("listening on http://%s:%d", cfg.host, cfg.port)

    try:
        web.run_app(
            create_app(settings), host=cfg.host, port=cfg.port, handler_cancellation=True, access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S, print=announce,
        )  # fmt: skip
    except ModelNotFoundError as e:
        logger.error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
