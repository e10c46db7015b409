"""The OpenAI-compatible HTTP app: FastAPI routes over an OpenAIServer (serving.py), the body limits
(middleware.py), the error handlers, /health and /metrics. runtime/launch.py serves it over the engine core."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .async_engine import AsyncLLMEngine
from .embeddings import create_embeddings, refuse_generation
from .lora_api import add_lora_routes
from .messages import count_tokens, create_message
from .messages_format import anthropic_error, is_messages_path
from .metrics import CONTENT_TYPE
from .middleware import BODY_TIMEOUT_S, MAX_BODY_BYTES, BodyLimit
from .protocol import APIError
from .rerank import create_rerank, create_score
from .serving import OpenAIServer, resolve_served_name


def build_app(engine: AsyncLLMEngine, *, served_model_name: str | None = None, api_key: str | None = None,
              metrics_public: bool = False, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout: float = BODY_TIMEOUT_S, tool_parser: str | None = None,
              reasoning_parser: str | None = None, reasoning_efforts: dict[str, int] | None = None,
              require_cache_salt: bool = False, json_whitespace: str = "compact") -> FastAPI:
    """The app over `engine` (connected to its core when the app starts). `api_key` covers every route but
    `/health` (and `/metrics` when `metrics_public`). `/health` answers 503 once the engine core is gone."""
    server = OpenAIServer(engine, model_name=resolve_served_name(engine.info, served_model_name),
                          api_key=api_key, metrics_public=metrics_public, tool_parser=tool_parser,
                          reasoning_parser=reasoning_parser, reasoning_efforts=reasoning_efforts,
                          require_cache_salt=require_cache_salt, json_whitespace=json_whitespace)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.async_engine.start()
        try:
            yield
        finally:
            await server.async_engine.shutdown()
            server.text_pool.shutdown(wait=False, cancel_futures=True)
            server.grammar_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kiln", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=body_timeout)

    def error_response(request: Request, e: APIError, headers: dict | None = None) -> JSONResponse:
        if is_messages_path(request.url.path):  # Anthropic's routes answer in Anthropic's error shape
            status, body = anthropic_error(e)
            return JSONResponse(body, status_code=status, headers=headers)
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(request, e)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # nobody is listening; not a server error

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}"
            return error_response(request, APIError(404, message, code="unknown_url"))
        return error_response(request, APIError(e.status_code, str(e.detail)), getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return error_response(request, APIError(500, f"internal server error: {type(e).__name__}: {e}",
                                                type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if server.async_engine.is_running else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not server.metrics_public:
            server.check_auth(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.check_auth(request)
        await server.lora.refresh()
        return {"object": "list", "data": [server.model_card(), *server.lora.cards()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict[str, Any]:
        server.check_auth(request)
        if model != server.model_name:
            if not await server.lora.exists(model):
                raise APIError(404, f"The model {model!r} does not exist", param="model", code="model_not_found")
            return next(c for c in server.lora.cards() if c["id"] == model)
        return server.model_card()

    embeds = engine.info.embedding is not None  # an embedding artifact (task = embed) generates nothing
    app.add_api_route("/v1/completions", refuse_generation if embeds else server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", refuse_generation if embeds else server.chat_completions,
                      methods=["POST"])
    app.add_api_route("/v1/embeddings", create_embeddings, methods=["POST"])
    app.add_api_route("/v1/rerank", refuse_generation if embeds else create_rerank, methods=["POST"])
    app.add_api_route("/v1/score", refuse_generation if embeds else create_score, methods=["POST"])
    add_lora_routes(app)
    app.add_api_route("/v1/responses", refuse_generation if embeds else server.create_response, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", server.stored_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", server.delete_response, methods=["DELETE"])
    app.add_api_route("/v1/messages", refuse_generation if embeds else create_message, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", server.tokenizer_info, methods=["GET"])
    return app
