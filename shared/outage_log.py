"""One log line when an operation starts failing and one when it works again.

A loop that retries through a Redis outage, or through Redis refusing its command (out of memory,
an ACL without the command), would otherwise log a warning at every retry, and an episode of
minutes would bury everything else an operator needs to read.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import ResponseError


class OutageLog:
    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self.what = what
        self._since: float | None = None  # monotonic: the first failure of the outage in progress
        self._failures = 0
        self._refused = False  # Redis answered with an error, rather than not at all

    def failed(self, error: BaseException) -> None:
        """Warn at the first failure of an outage; later ones go to the debug log."""
        self._failures += 1
        if self._since is None:
            self._since = time.monotonic()
            self._refused = isinstance(error, ResponseError)
            problem = "Redis refused it" if self._refused else "Redis unavailable"
            self._logger.warning("%s: %s (%s); retrying with backoff", self.what, problem, error)
        else:
            self._logger.debug("%s: still failing (%s), failure %d", self.what, error, self._failures)

    def recovered(self) -> None:
        """Say how long the outage lasted, once, when the operation works again."""
        if self._since is None:
            return
        self._logger.info(
            "%s: Redis %s again after %.1fs (%d failed attempts)",
            self.what, "accepts it" if self._refused else "reachable", time.monotonic() - self._since, self._failures,
        )  # fmt: skip
        self._since = None
        self._failures = 0
