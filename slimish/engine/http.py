"""What every route of the built-in engine shares: parsing a body into a protocol model, the
error replies, the key check and the body-size limit."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slimish.protocol import describe_validation_error
from slimish.serving import load_json

M = TypeVar("M", bound=BaseModel)


class BadRequest(Exception):
    """Carries a ready 400 reply body."""

    def __init__(self, body: Any) -> None:
        self.body = body

    @classmethod
    def of(cls, message: str) -> "BadRequest":
        """The usual body, `{"error": {"message": ...}}`."""
        return cls({"error": {"message": message}})


def error_message(message: str, status: int = 400, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status, headers=headers)


def control(success: bool, message: str, status: int | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message, **extra}, status_code=status or (200 if success else 400)
    )


async def parse(request: Request, model: type[M], empty_ok: bool = True, contract: bool = False) -> M:
    """Body -> model, or a 400 naming the field (malformed JSON included). Errors carry
    `{"error": {"message": ...}}`, except a schema failure of `/generate` (`contract`), which
    SGLang's contract gate words as `{"error": "<text>"}`."""
    raw = await request.body()
    if not raw.strip() and empty_ok:
        data: Any = {}
    else:
        try:
            data = load_json(raw)
        except ValueError as exc:
            raise BadRequest.of(f"body: malformed JSON ({exc})") from None
    try:
        if not isinstance(data, dict):
            raise TypeError(f"body: expected a JSON object, got {type(data).__name__}")
        return model.model_validate(data)
    except (TypeError, ValidationError) as exc:
        message = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        raise (BadRequest({"error": message}) if contract else BadRequest.of(message)) from None


class BodyTooLarge(Exception):
    """Raised from `receive` when a body without a (truthful) Content-Length grows past the limit."""


class BodyLimit:
    """413 for request bodies over `limit` bytes, before they are read into memory: by the
    declared Content-Length, else by counting the chunks as the route reads them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            response = error_message(
                f"body: {int(declared)} bytes; this engine accepts at most {self.limit} (--max-body-bytes)", 413
            )
            return await response(scope, receive, send)
        size = 0

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            if size > self.limit:
                raise BodyTooLarge()
            return message

        await self.app(scope, counted, send)


class KeyCheck:
    """401 for a request without the key its route needs (`key_of(path)`; None: none needed).
    Plain ASGI, as `BodyLimit`: Starlette's function middleware (`@app.middleware`) runs each
    request's route in a task of its own behind memory streams, which cost the engine's event
    loop, and so its scheduler thread, CPU on every /generate."""

    def __init__(self, app: ASGIApp, key_of: Callable[[str], str | None]) -> None:
        self.app, self.key_of = app, key_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (key := self.key_of(scope["path"])):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                response = error_message("Unauthorized: send `Authorization: Bearer <key>`", 401)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
