"""What a pod's and a router's OpenAI-compatible HTTP APIs share (frontend/http_api.py, router/http_api.py): every
error as OpenAI's JSON error object with its HTTP status, the body limit (`--max-message-bytes`, checked before
anything is parsed), and a client's disconnect noticed at once, whether it is waiting for its answer or reading a
stream (Starlette alone notices a gone client only at its next write).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from .errors import ExceedsCapacity, InvalidRequest, NotReady, OutOfCapacity, Unauthenticated, UnknownModel

log = logging.getLogger(__name__)
T = TypeVar("T")
Json = dict[str, Any]
UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}  # how pydantic names union members in `loc`
CLIENT_CLOSED = 499  # nginx's status for a client that left before its answer: written to no one


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


# ---- errors ------------------------------------------------------------------------------------------------


def error_of(exc: BaseException) -> tuple[int, Json]:
    """The HTTP status and OpenAI error object of an exception; unexpected ones are logged, never described."""
    status, kind, code, param = 500, "server_error", None, None
    message = str(exc)
    if isinstance(exc, Unauthenticated):
        status, kind, code = 401, "invalid_request_error", "invalid_api_key"
    elif isinstance(exc, UnknownModel):
        status, kind, code, param = 404, "invalid_request_error", "model_not_found", "model"
    elif isinstance(exc, InvalidRequest | ExceedsCapacity):  # a retry of the same request cannot succeed
        status, kind = 400, "invalid_request_error"
        field, sep, _ = message.partition(": ")
        param = field if sep and " " not in field else None
    elif isinstance(exc, OutOfCapacity):  # the queue or the tenant's streams are full: retry later
        status, kind, code = 429, "rate_limit_exceeded", "rate_limit_exceeded"
    elif isinstance(exc, NotReady):
        status, kind, message = 503, "server_error", message or "not ready"
    elif isinstance(exc, ValidationError):
        status, kind, (message, param) = 400, "invalid_request_error", _validation_message(exc)
    elif isinstance(exc, HTTPException):
        status, kind, message = exc.status_code, "invalid_request_error", str(exc.detail)
    else:
        log.error("unhandled error in the HTTP API", exc_info=exc)
        message = "internal error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    error = exc.errors()[0]
    if error["type"] == "json_invalid":
        return f"request body: not valid JSON ({error.get('ctx', {}).get('error', 'malformed')})", None
    # a union's member is named in `loc` ("prompt", "list[int]", 0): only field names and indexes are kept
    path = [p for p in error["loc"] if isinstance(p, int) or (p.isidentifier() and p.islower() and p not in UNION_TAGS)]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return (f"{param}: {error['msg']}", param) if param else (f"request body: {error['msg']}", None)


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_of(exc)
    return JSONResponse(body, status_code=status)


class GuardedRoute(APIRoute):
    """A /v1 route: `authenticate` first (before the body is read), then the handler; any exception becomes an
    OpenAI error, as one interceptor maps them for gRPC (grpc_server.py), and a client gone is CLIENT_CLOSED."""

    def authenticate(self, request: Request) -> None:
        """Raises Unauthenticated for a caller the server refuses; a subclass says who that is."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                self.authenticate(request)
                return await handler(request)
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED)
            except Exception as exc:
                return error_response(exc)

        return guarded


class BodyLimit:
    """Reads a request's body before the app does, up to `max_bytes` (`--max-message-bytes`, as gRPC's limit):
    past it, 413 without parsing anything."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        messages: list[Message] = []
        size, received = (int(declared) if declared.isdigit() else 0), 0
        while size <= self.max_bytes:
            message = await receive()
            messages.append(message)
            received += len(message.get("body", b""))
            size = max(size, received)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        if size > self.max_bytes:
            exc = HTTPException(413, f"request body: larger than this server's limit of {self.max_bytes} bytes")
            return await error_response(exc)(scope, receive, send)

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


# ---- disconnects and streams --------------------------------------------------------------------------------


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work` while watching the connection; a client that leaves cancels it (raising ClientGone)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()


class EventStream(StreamingResponse):
    """Server-sent events that stop (cancelling the body, hence the request) as soon as the client leaves."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            stream.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):  # OSError: a write to a closed connection
                await stream
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
