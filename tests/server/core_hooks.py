"""Test hooks loaded into an engine-core process (CoreConfig.plugins): `in_engine` runs a test's function there."""
from __future__ import annotations

import builtins
import importlib
import marshal
import types
from typing import Any


def install(proc: Any) -> None:
    proc.register_utility("test_run", _run)


def _run(engine: Any, code: bytes, modules: dict[str, str], args: list[Any]) -> Any:
    """`code` is a closure-free function's marshalled code object; `modules` the modules it names (name ->
    module), imported here."""
    namespace = {"__builtins__": builtins, **{name: importlib.import_module(m) for name, m in modules.items()}}
    return types.FunctionType(marshal.loads(code), namespace)(engine, *args)


def install_drop_counts(proc: Any) -> None:
    """`dropped`: the core's counts of the messages it dropped, by kind (core/process.py DropLog)."""
    proc.register_utility("dropped", lambda engine: dict(proc.dropped.counts))
