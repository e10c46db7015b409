"""The OpenAI server's LoRA side: the `model` field naming an adapter, /v1/models listing them, and
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's request bodies) changing them at run time.

The adapters live in the engine core (lora.LoRAManager); this keeps the names it last heard of, so a request
naming a known adapter costs no round trip. A name it does not know is checked with the core once before a 404
(another API server of the same core may have loaded it)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import KilnRuntimeError
from .async_engine import AsyncLLMEngine
from .protocol import APIError


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


class LoRAAdapters:
    """The adapter names a server routes `model` to, kept in step with its engine core. `model_name` is the
    served name of the base model, `base_card` its /v1/models card (an adapter's card is the base's, renamed)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, base_card: dict[str, Any]) -> None:
        self.engine, self.model_name, self.base_card = engine, model_name, base_card
        self.adapters: dict[str, dict[str, Any]] = {}  # name -> {"name", "rank"}

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            reply = await self.engine.call_utility(method, *args)
        except KilnRuntimeError as e:
            raise APIError(503, str(e), type="server_error") from None
        if "error" in reply:  # the core's refusal: its status (403: loading off, a path outside the roots)
            raise APIError(reply.get("status", 400), reply["error"], param=reply.get("param", "lora_name"))
        return reply["result"]

    async def refresh(self) -> None:
        self.adapters = {a["name"]: a for a in await self._call("list_lora_adapters")}

    async def update(self, method: str, *args: Any) -> None:
        """Runs a load or unload utility on the core, then re-reads what it serves."""
        await self._call(method, *args)
        await self.refresh()

    async def exists(self, model: str) -> bool:
        if model in self.adapters:
            return True
        await self.refresh()
        return model in self.adapters

    def lora_name(self, model: str) -> str | None:
        """The adapter a request's `model` names (None: the base model)."""
        return None if model == self.model_name else model

    def cards(self) -> list[dict[str, Any]]:
        # `root` is the adapter's name, never a path on the server (vLLM shows the path it was loaded from)
        return [{**self.base_card, "id": name, "root": name, "parent": self.model_name}
                for name, a in self.adapters.items()]


async def _body(request: Request, schema: type[BaseModel]) -> Any:
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}",
                       param=str(first["loc"][0]) if first["loc"] else None) from None


async def _authenticated(request: Request, schema: type[BaseModel]) -> tuple[Any, Any]:
    """The server `build_app` keeps in `app.state.server` (serving.OpenAIServer), once the caller is authenticated,
    and the request body as `schema`."""
    server = request.app.state.server
    server.check_auth(request)
    return server, await _body(request, schema)


def add_lora_routes(app: FastAPI) -> None:
    """The adapter routes, over the server `build_app` keeps in `app.state.server` (serving.OpenAIServer)."""

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> dict[str, Any]:
        server, req = await _authenticated(request, LoadLoRARequest)
        if req.lora_name == server.model_name:
            raise APIError(400, f"{req.lora_name!r} is the base model's name", param="lora_name")
        await server.lora.update("load_lora_adapter", req.lora_name, req.lora_path)
        return {"object": "lora_adapter", "id": req.lora_name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> dict[str, Any]:
        server, req = await _authenticated(request, UnloadLoRARequest)
        if not await server.lora.exists(req.lora_name):
            raise APIError(404, f"no LoRA adapter named {req.lora_name!r} is loaded", param="lora_name",
                           code="model_not_found")
        await server.lora.update("unload_lora_adapter", req.lora_name)
        return {"object": "lora_adapter", "id": req.lora_name, "status": "unloaded"}
