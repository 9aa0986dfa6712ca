"""The OpenAI-compatible HTTP API: `POST /v1/completions`, `POST /v1/chat/completions` (streamed as server-sent
events with `stream: true`), `GET /v1/models`, and `GET /health`; the second front door of the engine the gRPC
API serves (generation.py does the work for both; openai_bodies.py and openai_protocol.py are the wire
format).

As on gRPC: every /v1 route needs a listed key (`Authorization: Bearer KEY`) when a keys file is set, checked
before the body is parsed, and a route added later is closed by default (`_V1Route`); the key's tenant owns
its prefix cache and its stream count, shared with gRPC; every error is answered in OpenAI's JSON shape with
its HTTP status, an unexpected one logged and answered 500 with a generic message. A client that disconnects
cancels its request's task, which aborts the request and frees its blocks at once, whether it is waiting for
its answer or reading a stream. The errors, the body limit and the disconnects are common/openai_http.py's,
shared with the router's HTTP API.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from ..common.openai_http import (
    BodyLimit,
    EventStream,
    GuardedRoute,
    Json,
    error_of,
    error_response,
    unless_disconnected,
)
from .generation import Chunk, Serving, Usage
from .openai_bodies import ChatBody, CompletionBody
from .openai_protocol import Responses

B = TypeVar("B", bound=BaseModel)


class _V1Route(GuardedRoute):
    """Every /v1 route of a pod: the caller's key (its tenant) first, then the handler (openai_http.py)."""

    def authenticate(self, request: Request) -> None:
        _serving(request).tenant(request.headers.items())


# ---- streams ------------------------------------------------------------------------------------------------


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
        """The chunks, then the usage on its own (OpenAI's last chunk has no choices)."""
        with serving.hold(request.headers.items()) as salt:
            async for item in serving.generate(request_id, prompt, params, salt, body.stops(), want_logprobs,
                                               unary=not body.stream):
                if isinstance(item, Chunk) and item.usage is not None:
                    usage, item.usage = item.usage, None
                    yield item
                    yield usage
                else:
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

