"""`POST /v1/embeddings` in OpenAI's shapes, served by an embedding artifact (task = embed, docs/embeddings.md).

Each input is one prefill-only request: the core pools its final hidden states as the checkpoint's
sentence-transformers config says and ends it with the vector (`SeqDelta.embedding`, through the output
processor as `RequestDelta.embedding`); `dimensions` (Matryoshka models) cuts and renormalizes it here
(runtime/embedding.py). `encoding_format: base64` is OpenAI's: the little-endian float32 bytes, base64.
A generation artifact refuses this route, and an embedding artifact the generation routes (`refuse_generation`).
"""
from __future__ import annotations

import base64
import struct
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse

from ..embedding import check_dimensions, shape
from ..errors import KilnRuntimeError, RequestError
from ..sampling_params import SamplingParams
from .async_engine import PromptInput
from .messages import check_auth as messages_check_auth
from .messages_format import is_messages_path
from .protocol import APIError, StrictModel
from .streaming import until_disconnect

EMBED_ONLY = "this model is an embedding model (task = embed): use /v1/embeddings"
NO_EMBEDDINGS = ("this model generates text (its artifact was not compiled with task = embed): it has no "
                 "embeddings; serve an embedding artifact for /v1/embeddings")


class EmbeddingRequest(StrictModel):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, ignored (as OpenAI's is for abuse monitoring)

    def check_supported(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise APIError(400, "input must not be empty", param="input")

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a text or a list of token ids."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and isinstance(given[0], int):
            return [list(given)]
        return list(given)


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """`float`: the list; `base64`: its little-endian float32 bytes in base64 (what OpenAI returns)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embedding_response(vectors: list[list[float]], req: EmbeddingRequest, model_name: str,
                       num_tokens: int) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def create_embeddings(request: Request) -> JSONResponse:
    server = request.app.state.server
    req: EmbeddingRequest = await server.parse(request, EmbeddingRequest)
    section = server.async_engine.info.embedding
    if section is None:
        raise APIError(400, NO_EMBEDDINGS, param="model", code="not_an_embedding_model")
    try:
        check_dimensions(section, req.dimensions)
    except RequestError as e:
        raise APIError(400, str(e), param="dimensions") from None
    params = SamplingParams(max_tokens=1)  # a prefill; the core ends it with the pooled vector
    given = req.inputs()
    try:
        server.async_engine.check_admissible(len(given), params)
    except RequestError as e:
        raise APIError(400, str(e), param="input", code="too_many_inputs") from None
    texts = [p for p in given if isinstance(p, str)]
    encoded = iter(await server.encode(texts, param="input") if texts else [])
    request_id = f"embd-{uuid.uuid4().hex}"
    inputs = [PromptInput(f"{request_id}-{i}", next(encoded), p) if isinstance(p, str)
              else PromptInput(f"{request_id}-{i}", p) for i, p in enumerate(given)]
    limit = server.max_model_len
    for i, p in enumerate(inputs):
        n = len(p.prompt_token_ids)
        if n >= limit:  # the core checks prompt + max_tokens (1) against the context
            raise APIError(400, f"This model's maximum context length is {limit} tokens: an input may have at "
                           f"most {limit - 1}; input {i} has {n}. Shorten it.", param="input",
                           code="context_length_exceeded")
    try:
        group = await server.async_engine.add_requests(inputs, params)
    except RequestError as e:
        raise APIError(400, str(e), param="input") from None
    except KilnRuntimeError as e:  # overloaded, or the engine core is gone
        raise APIError(503, str(e), type="server_error", code="overloaded") from None

    async def collect() -> JSONResponse:
        vectors: dict[str, list[float]] = {}
        try:
            async for delta in group:
                if delta.finished and delta.embedding is not None:
                    vectors[delta.request_id] = delta.embedding
        except Exception as e:  # the engine failed this request: not the client's fault
            raise APIError(500, str(e), type="server_error") from None
        missing = [p.request_id for p in inputs if p.request_id not in vectors]
        if missing:
            raise APIError(500, f"the engine ended {len(missing)} input(s) without an embedding",
                           type="server_error")
        shaped = [shape(vectors[p.request_id], section, req.dimensions) for p in inputs]
        num_tokens = sum(len(p.prompt_token_ids) for p in inputs)
        return JSONResponse(embedding_response(shaped, req, server.model_name, num_tokens))

    return await until_disconnect(request, collect(), on_close=group.abort)


async def refuse_generation(request: Request) -> None:
    """The generation routes of an embedding artifact: authenticated, then a 400 saying where to go."""
    server = request.app.state.server
    if is_messages_path(request.url.path):
        messages_check_auth(server, request)
    else:
        server.check_auth(request)
    raise APIError(400, EMBED_ONLY, param="model", code="embedding_model")
