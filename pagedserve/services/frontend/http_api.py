"""The OpenAI-compatible HTTP API: `POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent
events with `stream: true`), `GET /v1/models`, and `GET /health`; the second front door of the engine the gRPC
API serves (generation.py does the work for both; openai_protocol.py is the wire format).

As on gRPC: every /v1 route needs a listed key (`Authorization: Bearer KEY`) when a keys file is set, checked
before the body is parsed, and a route added later is closed by default (`_V1Route`); the key's tenant owns
its prefix cache and its stream count, shared with gRPC; every error is answered in OpenAI's JSON shape with
its HTTP status, an unexpected one logged and answered 500 with a generic message. A client that disconnects
cancels its request's task, which aborts the request and frees its blocks at once, whether it is waiting for
its answer or reading a stream (Starlette alone notices a gone client only at its next write).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from ..common.errors import ExceedsCapacity, InvalidRequest, NotReady, OutOfCapacity, Unauthenticated, UnknownModel
from .generation import Chunk, Serving, Usage
from .openai_protocol import ChatBody, CompletionBody, Json, Responses

log = logging.getLogger(__name__)
T = TypeVar("T")
B = TypeVar("B", bound=BaseModel)
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


class _V1Route(APIRoute):
    """Every /v1 route: the caller's key first (before the body is read), then the handler; any exception
    becomes an OpenAI error, as one interceptor maps them for gRPC (grpc_server.py)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                _serving(request).tenant(request.headers.items())
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


def _sse(body: Json) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


# ---- the routes -------------------------------------------------------------------------------------------


async def _body(request: Request, model: type[B]) -> B:
    """The body as JSON whatever its Content-Type says (curl's -d sends a form type); ValidationError if not."""
    return model.model_validate_json(await request.body())


def _serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


async def _answer(request: Request, body: CompletionBody | ChatBody, prompt: list[int], max_tokens: int,
                  top_logprobs: int, want_logprobs: bool) -> Response:
    serving = _serving(request)
    params = body.params(max_tokens, top_logprobs, serving.limits.max_n)
    request_id = uuid.uuid4().hex
    responses = Responses(request_id, serving.backend.info.model, isinstance(body, ChatBody),
                          serving.backend.tokenizer, want_logprobs)

    async def items() -> AsyncIterator[Chunk | Usage]:
        with serving.hold(request.headers.items()) as salt:
            async for item in serving.generate(request_id, prompt, params, salt, body.stops(), want_logprobs,
                                               unary=not body.stream):
                yield item

    generation = items()
    if not body.stream:
        chunks: list[Chunk] = []

        async def collect() -> Usage:
            async for item in generation:
                if isinstance(item, Usage):
                    return item
                chunks.append(item)
            raise AssertionError("a generation ends with its usage")

        usage = await unless_disconnected(request, collect())
        return JSONResponse(responses.whole(chunks, usage))
    # the first item before the 200: refusals (limits, a full queue, a lost sidecar) get their own status
    first = await unless_disconnected(request, anext(generation))
    return EventStream(_events(responses, body, first, generation, want_logprobs),
                       headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


async def _events(responses: Responses, body: CompletionBody | ChatBody, first: Chunk | Usage,
                  rest: AsyncIterator[Chunk | Usage], want_logprobs: bool) -> AsyncIterator[str]:
    include_usage = body.include_usage
    try:
        if responses.chat:
            yield _sse(responses.chunk(responses.role_choices(body.num_samples), None, include_usage))
        item = first
        while not isinstance(item, Usage):
            if item.text or item.finish_reason is not None or want_logprobs:
                yield _sse(responses.chunk([responses.stream_choice(item)], None, include_usage))
            item = await anext(rest)
        if include_usage:
            yield _sse(responses.chunk([], item, include_usage))
    except Exception as exc:  # after the 200 the error goes into the stream, where OpenAI's clients raise it
        yield _sse(error_of(exc)[1])
    yield "data: [DONE]\n\n"


v1 = APIRouter(route_class=_V1Route)


@v1.get("/v1/models")
async def list_models(request: Request) -> Response:
    info = _serving(request).backend.info
    return JSONResponse({"object": "list", "data": [{
        "id": info.model, "object": "model", "created": request.app.state.created, "owned_by": "pagedserve",
        "max_model_len": info.max_model_len}]})


@v1.post("/v1/completions")
async def completions(request: Request) -> Response:
    serving, body = _serving(request), await _body(request, CompletionBody)
    body.check_supported()
    serving.check_model(body.model)
    prompt = body.single_prompt()
    ids = serving.text_prompt(prompt) if isinstance(prompt, str) else list(prompt)
    max_tokens = serving.limits.default_max_tokens if body.max_tokens is None else body.max_tokens
    return await _answer(request, body, ids, max_tokens, body.logprobs or 0, body.logprobs is not None)


@v1.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    serving, body = _serving(request), await _body(request, ChatBody)
    body.check_supported()
    serving.check_model(body.model)
    prompt = serving.chat_prompt(body.turns())
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = serving.max_tokens_that_fit(len(prompt), body.num_samples)
    return await _answer(request, body, prompt, max_tokens, body.top_logprobs or 0, bool(body.logprobs))


def build_app(serving: Serving, max_body_bytes: int) -> Any:
    """The ASGI app: /v1 routes and /health over `serving`, bodies limited to `max_body_bytes`."""
    # FastAPI's own OpenTelemetry: a server span per request through the process's tracer provider (tracing.py),
    # continuing the caller's traceparent. Without its per-operation spans, that server span is the current one
    # in the handler and while a stream's body is sent, so the generation's attributes and the engine steps'
    # links land on it; never an exporter of its own (the environment's OTLP endpoint is tracing.py's).
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry={"operation_spans": False, "auto_configure": False})
    app.state.serving, app.state.created = serving, int(time.time())
    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine serves; 503 while loading, or while a sidecar is lost (the pod's probes)."""
        if not serving.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        status = serving.backend.loop.status
        if not status["available"] or not serving.backend.loop.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "serving"})

    async def http_error(request: Request, exc: Exception) -> Response:  # unknown paths and methods
        return error_response(exc)

    app.add_exception_handler(HTTPException, http_error)
    return BodyLimit(app, max_body_bytes)

