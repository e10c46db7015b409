"""What every request passes before its handler: the request body's size and time limits (BodyLimit), and a
pydantic validation error as the OpenAI-style 400 it answers (validation_error)."""
from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .messages_format import anthropic_error, is_messages_path
from .protocol import APIError

MAX_BODY_BYTES = 16 * 2**20
BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this (a stalled upload gets 408)


class BodyLimit:
    """ASGI middleware: a request body may hold at most `max_bytes` and must arrive within `timeout` seconds
    of the request's start. Counted as the body streams in: a declared Content-Length over the limit is
    answered 413 before a byte of it is read, a chunked body once it passes the limit, a stalled one 408 at
    the deadline. A response that starts before its request's body was read to the end (these, a 401, ...)
    closes the connection: the rest of the body is never read, and the client must not wait on it. A client
    that goes away mid-upload ends its request quietly (`ClientDisconnect`, answered by `build_app`)."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        complete = declared in (None, b"0") and b"transfer-encoding" not in headers  # no body to wait for
        received = 0

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not complete:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = self.too_large(int(declared))
            status, body = anthropic_error(error) if is_messages_path(scope["path"]) else (error.status, error.body())
            await JSONResponse(body, status_code=status)(scope, receive, closing_send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout

        async def limited_receive() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.timeout:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self.too_large(received, streamed=True)
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, limited_receive, closing_send)

    def too_large(self, size: int, streamed: bool = False) -> APIError:
        what = f"more than {self.max_bytes} bytes of request body arrived" if streamed else \
            f"request body of {size} bytes"
        return APIError(413, f"{what}; the limit is {self.max_bytes} bytes")


def validation_error(e: ValidationError) -> APIError:
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}")
    # Union members add their type name to the location ("prompt.list[int].0"): keep the field path, and for
    # a value that matches no member say which types would do.
    loc = [str(p) for p in first["loc"] if not _is_union_tag(p)]
    param = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return APIError(400, f"Missing required parameter: {param}", param=param)
    tags = []  # the union members the value was tried against, in declaration order
    for err in e.errors(include_url=False):
        tag = next((p for p in err["loc"] if _is_union_tag(p)), None)
        if err["loc"][:1] == first["loc"][:1] and tag is not None and tag not in tags:
            tags.append(tag)
    if len(tags) > 1:
        return APIError(400, f"{param}: expected one of {', '.join(tags)}", param=param)
    return APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "ContentPart"))
