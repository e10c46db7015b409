"""The engine core's LoRA utilities (core/process.py), what the API server's adapter endpoints call; a client's
adapter load reads off the core's step loop.

`load_lora_adapter` checks what it can at once (run-time loading on, the path under --lora-roots, the name free),
then reads and parses the adapter's files on a reader thread and returns a `Deferred` (deferred.py): the core
goes on stepping while a large adapter is read, and installs it (LoRAManager.load with what was read) on its
loop between two steps, answering the call then. One reader thread: loads are read one after another, so at most
one adapter's bytes are in memory beside the served ones. On a tensor-parallel mesh the install tells the other
ranks, which read their slices then (the LORA command; worker/distributed/commands.py)."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..deferred import Deferred
from ..errors import RequestError
from .lora import AdapterRefused, LoRAError, check_load, load_adapter

_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-lora-read")


def _answer(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """fn(*args) as a utility's result: {"result": ...}, or a refusal ({"error": why, ...}) rather than a failure
    of the core's."""
    try:
        return {"result": fn(*args)}
    except RequestError as e:
        return _refused(e)


def _refused(e: RequestError) -> dict[str, Any]:
    if isinstance(e, AdapterRefused):
        return {"error": str(e), "param": e.param, "status": e.status}
    return {"error": str(e)}


def _refusal(fn: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    return lambda engine, *args: _answer(fn, engine, *args)


def load_client_adapter(engine: Any, name: str, path: str) -> dict[str, Any] | Deferred:
    """A client's load: refused at once, or read on the reader thread and installed when the read is done; what
    it says names `path` as the client gave it."""
    try:
        resolved = engine.client_adapter_path(path)
        check_load(engine.lora, name)
    except RequestError as e:
        return _refused(e)
    manager = engine.lora
    read = _reader.submit(manager.read, resolved, name)

    def install(future: Future) -> None:
        try:
            adapter = future.result()
        except LoRAError as e:
            raise AdapterRefused(str(e).replace(str(resolved), path)) from None
        load_adapter(manager, name, resolved, shown=path, adapter=adapter)

    return Deferred(read, lambda future: _answer(install, future))


LORA_UTILITIES = {
    # no paths: a client learns nothing of the server's file system
    "list_lora_adapters": _refusal(lambda e: [{"name": a.name, "rank": a.rank}
                                              for a in (e.lora.adapters.values() if e.lora else ())]),
    "load_lora_adapter": load_client_adapter,
    "unload_lora_adapter": _refusal(lambda e, name: e.check_client_updates("lora_name") or e.unload_lora_adapter(name)),
}
