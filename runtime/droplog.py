"""Counting and rate-limited logging of the messages a receiver drops (the engine core's input socket, a decode
core's KV receiver): a flood of malformed messages costs a counter each, not a log line each."""
from __future__ import annotations

import logging
import time
from typing import Any


class DropLog:
    """Logs the messages a receiver drops: the first of each kind at once, then at most one line a kind every
    `every` seconds, saying how many were dropped since; `counts` holds every kind's total."""

    def __init__(self, every: float = 60.0, logger: logging.Logger | None = None) -> None:
        self.every = every
        self.logger = logger or logging.getLogger("kiln.core")
        self.counts: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (when its last line was written, its count then)

    def __call__(self, kind: str, message: str, *args: Any) -> None:
        count = self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        when, then = self._logged.get(kind, (None, 0))
        if when is not None and now - when < self.every:
            return
        since = f" ({count - then - 1} more of this kind since the last)" if count - then > 1 else ""
        self.logger.warning("dropped %s" + since, message % args if args else message)
        self._logged[kind] = (now, count)
