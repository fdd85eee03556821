"""One log line when an operation starts failing and one when it works again.

A loop that retries through a Redis outage would otherwise log a warning at every retry, and an
outage of minutes would bury everything else an operator needs to read.
"""

from __future__ import annotations

import logging
import time


class OutageLog:
    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self.what = what
        self._since: float | None = None  # monotonic: the first failure of the outage in progress
        self._failures = 0

    def failed(self, error: BaseException) -> None:
        """Warn at the first failure of an outage; later ones go to the debug log."""
        self._failures += 1
        if self._since is None:
            self._since = time.monotonic()
            self._logger.warning("%s: Redis unavailable (%s); retrying with backoff", self.what, error)
        else:
            self._logger.debug("%s: Redis still unavailable (%s), failure %d", self.what, error, self._failures)

    def recovered(self) -> None:
        """Say how long the outage lasted, once, when the operation works again."""
        if self._since is None:
            return
        self._logger.info(
            "%s: Redis reachable again after %.1fs (%d failed attempts)",
            self.what, time.monotonic() - self._since, self._failures,
        )  # fmt: skip
        self._since = None
        self._failures = 0
