"""A utility's answer that is not ready when the utility returns (core/process.py answers it later).

A utility of the engine core (`fn(engine, *args)`, run between two steps) whose work must not hold the core's loop
(reading an adapter's files: seconds for a large one) starts that work on a thread and returns a `Deferred`: its
`future` is the work, and once it is done the core runs `finish(future)` on its loop, between two steps (what
touches the engine: installing what was read), and answers the call with what `finish` returns (or its error)."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Deferred:
    future: Future
    finish: Callable[[Future], Any]
