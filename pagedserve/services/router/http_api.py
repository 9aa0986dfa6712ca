"""The router's OpenAI-compatible HTTP API (`--http-listen`): the pods' routes, each request forwarded whole to one
pod chosen per request, as servicer.py does for gRPC.

`POST /v1/completions` and `/v1/chat/completions`: the body read only for its prompt (http_prompt.py), hashed as a
gRPC request of the same prompt (request_blocks.py), a pod chosen among those that serve HTTP (fleet.py,
choice.py), and the body sent unchanged with the caller's headers (http_upstream.py). The pod's answer comes back as
the pod wrote it: its status, content type and bytes; a stream's events each as they arrive. The caller leaving
closes the pod's connection, which aborts the request there and frees its blocks (the pod's http_api cancels on a
disconnect). A connection that fails, or a 503, before any byte of the answer is sent once more, to another pod.

The router's own answers are OpenAI's error objects (frontend/http_api.py's): no pod to route to (503, naming each
pod's state, or that no routable pod serves HTTP), a key not listed when the router has keys (401, checked before
the body is read), a body over `--max-message-bytes` (413). Each forwarded answer names its pod and the prefix the
router predicted there (`x-pagedserve-pod`, `x-pagedserve-predicted-cached-tokens`), to compare with the pod's
`usage.prompt_tokens_details.cached_tokens`; the router reads that usage from a whole answer, and from a stream
that asked for it (`stream_options.include_usage`), to count it (telemetry.py) as it counts gRPC's `Usage`.
`GET /v1/models` is answered by any pod that serves HTTP; `/health` is 200 while one is routable and the router's
tokenizer is settled (as gRPC health), else 503.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from ...protos import inference_pb2 as pb
from ..common.errors import NotReady, Unauthenticated
from ..common.openai_http import (
    CLIENT_CLOSED,
    BodyLimit,
    ClientGone,
    EventStream,
    GuardedRoute,
    error_of,
    error_response,
    unless_disconnected,
)
from ..frontend.auth import UNAUTHENTICATED, ApiKeys, presented_key
from .fleet import NO_POD, Fleet, Ticket
from .http_prompt import CHAT_COMPLETIONS, COMPLETIONS, read_prompt
from .http_upstream import PodHttp, answer_headers, forwarded_headers
from .request_blocks import UNKNOWN, RequestHasher
from .telemetry import RouterMetrics
from .upstream import attempt_span

POD_HEADER = "x-pagedserve-pod"
PREDICTED_HEADER = "x-pagedserve-predicted-cached-tokens"
EVENT_STREAM = "text/event-stream"
# the status an answer ended with, in gRPC's names: one `code` label for both doors (telemetry.py)
CODES = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
         413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", CLIENT_CLOSED: "CANCELLED", 500: "INTERNAL",
         503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


@dataclass
class HttpRouting:
    """What the routes share: the fleet, the pods' HTTP side, the hasher, the metrics, the router's keys."""

    fleet: Fleet
    pods: PodHttp
    hasher: RequestHasher
    metrics: RouterMetrics
    keys: ApiKeys | None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._turns = itertools.count()  # /v1/models: the pods in turn

    def http_pods(self, exclude: Collection[str] = ()) -> list[str]:
        """The routable pods that serve HTTP (less `exclude`); NotReady naming why when there is none."""
        routable = self.fleet.routable(exclude)
        if not routable:
            raise NotReady(self.fleet.why_none(exclude))
        pods = [pod for pod in routable if self.pods.serves_http(pod)]
        if not pods:
            raise NotReady(f"{NO_POD}: no routable pod serves the HTTP API ({', '.join(routable)}: started without "
                           "--http-listen)")
        return pods

    def next_turn(self, pods: list[str]) -> str:
        return pods[next(self._turns) % len(pods)]


def _routing(request: Request) -> HttpRouting:
    routing: HttpRouting = request.app.state.routing
    return routing


class _Attempts:
    """One request's way through the fleet: its prompt hashed once (timed with the first choice as the decision), at
    most two pods tried, the second only after the first failed before answering."""

    def __init__(self, routing: HttpRouting, path: str, body: bytes, headers: list[tuple[str, str]]) -> None:
        self.routing = routing
        self._started = time.perf_counter()
        self.read = read_prompt(path, body)
        request = self.read.request
        self.prompt = UNKNOWN if request is None else routing.hasher.blocks(request, headers, routing.fleet.identity)
        self.tried: list[str] = []

    def next_pod(self) -> tuple[str, int]:
        """The pod for the next attempt and the cached tokens predicted there; NotReady when there is none."""
        routing = self.routing
        try:
            pods = routing.http_pods(self.tried)
            choice = routing.fleet.choose(self.prompt, routing.clock(), exclude=[
                pod for pod in routing.fleet.pods if pod not in pods])
        except NotReady:
            if not self.tried:
                routing.metrics.unroutable.inc()
            raise
        if not self.tried:
            routing.metrics.decision_seconds.observe(time.perf_counter() - self._started)
        else:
            routing.metrics.retries.inc()
        self.tried.append(choice.pod)
        return choice.pod, choice.predicted_cached_tokens

    def may_retry(self) -> bool:
        """After the first attempt only, and only with another pod to try."""
        if len(self.tried) != 1:
            return False
        try:
            return bool(self.routing.http_pods(self.tried))
        except NotReady:
            return False


class _Attempt:
    """One pod's attempt at a request: it holds the fleet's ticket and the span until `end`, called once."""

    def __init__(self, routing: HttpRouting, pod: str, predicted: int, new_tokens: int, path: str) -> None:
        self.routing, self.pod, self.predicted, self.path = routing, pod, predicted, path
        self.ticket: Ticket | None = routing.fleet.send(pod, new_tokens, routing.clock())
        self.span = attempt_span(f"POST {path}", pod)

    async def post(self, body: bytes, headers: list[tuple[str, str]]) -> aiohttp.ClientResponse:
        """Sends the request to the pod; returns once its answer begins (status and headers)."""
        pods = self.routing.pods
        return await pods.session.post(pods.url(self.pod, self.path), data=body, allow_redirects=False,
                                       headers=forwarded_headers(headers, self.span), **pods.request_options)

    def end(self, code: str, usage: pb.Usage | None = None) -> None:
        if self.ticket is None:
            return
        self.routing.metrics.ended(self.pod, code, self.predicted, usage)
        if self.span is not None:
            if usage is not None:
                self.span.set_attribute("pagedserve.cached_prompt_tokens", usage.cached_prompt_tokens)
            self.span.set_attribute("http.response.status_code_name", code)
            self.span.end()
        self.routing.fleet.finish(self.ticket)
        self.ticket = None

    def headers(self) -> dict[str, str]:
        return {POD_HEADER: self.pod, PREDICTED_HEADER: str(self.predicted)}


async def _forward(request: Request, path: str) -> Response:
    routing, body, headers = _routing(request), await request.body(), request.headers.items()
    attempts = _Attempts(routing, path, body, headers)
    while True:
        pod, predicted = attempts.next_pod()
        attempt = _Attempt(routing, pod, predicted, max(0, attempts.prompt.num_tokens - predicted), path)
        try:
            upstream = await unless_disconnected(request, attempt.post(body, headers))
        except ClientGone:
            attempt.end("CANCELLED")
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:  # refused, reset, or gone before its answer began
            attempt.end("UNAVAILABLE")
            if attempts.may_retry():
                continue
            raise NotReady(f"pod {pod} failed before answering: {_why(exc)}") from None
        if upstream.status == 503 and attempts.may_retry():  # the pod is stopping or lost a sidecar
            upstream.close()
            attempt.end("UNAVAILABLE")
            continue
        if upstream.content_type == EVENT_STREAM:
            return _Relay(upstream, attempt, attempts.read.include_usage)
        return await _whole(request, upstream, attempt)


async def _whole(request: Request, upstream: aiohttp.ClientResponse, attempt: _Attempt) -> Response:
    """A whole answer, read and passed on; its usage counted when it is a 200's."""
    code, usage = CODES.get(upstream.status, "UNKNOWN"), None
    try:
        content = await unless_disconnected(request, upstream.read())
        if upstream.status == 200:
            usage = _usage(content)
        return Response(content, status_code=upstream.status,
                        headers=answer_headers(upstream.headers.items()) | attempt.headers())
    except ClientGone:
        code = "CANCELLED"
        raise
    except aiohttp.ClientError as exc:  # the pod went away mid-answer: too late to try another
        code = "UNAVAILABLE"
        raise NotReady(f"pod {attempt.pod} failed while answering: {_why(exc)}") from None
    finally:
        upstream.close()
        attempt.end(code, usage)


class _Relay(EventStream):
    """The pod's stream passed on. However it ends, the pod's request is closed and the attempt ended, even when the
    client leaves before the first byte (the body's generator then never starts, so its `finally` never runs)."""

    def __init__(self, upstream: aiohttp.ClientResponse, attempt: _Attempt, include_usage: bool) -> None:
        super().__init__(_events(upstream, attempt, include_usage), status_code=upstream.status,
                         headers=answer_headers(upstream.headers.items()) | attempt.headers())
        self.upstream, self.attempt = upstream, attempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.upstream.close()
            self.attempt.end("CANCELLED")  # a no-op when the stream ended it


async def _events(upstream: aiohttp.ClientResponse, attempt: _Attempt, include_usage: bool) -> AsyncIterator[bytes]:
    """The pod's stream, each piece as it arrives. Its usage, when the caller asked for it, is the last event's."""
    code, usage = CODES.get(upstream.status, "UNKNOWN"), None
    tail = b""  # the stream's last bytes: its usage event, maybe cut between two reads
    try:
        async for data in upstream.content.iter_any():
            tail = (tail + data)[-_USAGE_EVENT_BYTES:]
            yield data
        if include_usage:
            usage = _stream_usage(tail)
    except aiohttp.ClientError as exc:  # the pod went away mid-stream: an error event, as a pod ends a failed one
        code = "UNAVAILABLE"
        failure = error_of(NotReady(f"pod {attempt.pod} failed while streaming: {_why(exc)}"))[1]
        yield (b"" if tail.endswith(b"\n\n") else b"\n\n") + f"data: {json.dumps(failure)}\n\ndata: [DONE]\n\n".encode()
    except (asyncio.CancelledError, GeneratorExit):  # the caller left
        code = "CANCELLED"
        raise
    finally:
        upstream.close()
        attempt.end(code, usage)


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


_USAGE_EVENT_BYTES = 4096  # the usage event and [DONE] that follows it: a few hundred bytes


def _usage(content: bytes) -> pb.Usage | None:
    try:
        usage = json.loads(content).get("usage")
        details = usage.get("prompt_tokens_details") or {}
        return pb.Usage(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                        cached_prompt_tokens=details.get("cached_tokens") or 0)
    except (ValueError, AttributeError, KeyError, TypeError):
        return None


def _stream_usage(tail: bytes) -> pb.Usage | None:
    """The usage in the last `data: {...}` event of a stream's tail (the event before `data: [DONE]`)."""
    events = [event for event in tail.split(b"\n\n") if event.startswith(b"data: {")]
    return _usage(events[-1].removeprefix(b"data: ")) if events else None


# ---- the routes -------------------------------------------------------------------------------------------


class _RouterRoute(GuardedRoute):
    """Every /v1 route of the router: the caller's key checked first when the router has keys, then the handler,
    as on a pod (openai_http.py)."""

    def authenticate(self, request: Request) -> None:
        keys = _routing(request).keys
        if keys is not None and keys.tenant_for(presented_key(request.headers.items())) is None:
            raise Unauthenticated(UNAUTHENTICATED)


v1 = APIRouter(route_class=_RouterRoute)


@v1.post(COMPLETIONS)
async def completions(request: Request) -> Response:
    return await _forward(request, COMPLETIONS)


@v1.post(CHAT_COMPLETIONS)
async def chat_completions(request: Request) -> Response:
    return await _forward(request, CHAT_COMPLETIONS)


@v1.get("/v1/models")
async def list_models(request: Request) -> Response:
    """Any pod's answer (every pod has the fleet's identity); a second pod when the first cannot be reached."""
    routing = _routing(request)
    failed: list[str] = []
    headers = forwarded_headers(request.headers.items())
    while True:
        pods = routing.http_pods(failed)
        pod = routing.next_turn(pods)
        try:
            async with routing.pods.session.get(routing.pods.url(pod, "/v1/models"), headers=headers,
                                                **routing.pods.request_options) as upstream:
                content = await unless_disconnected(request, upstream.read())
                return Response(content, status_code=upstream.status,
                                headers=answer_headers(upstream.headers.items()) | {POD_HEADER: pod})
        except (aiohttp.ClientError, TimeoutError) as exc:
            if failed or len(pods) == 1:
                raise NotReady(f"pod {pod} failed before answering: {_why(exc)}") from None
            failed.append(pod)


def build_app(routing: HttpRouting, max_body_bytes: int, settled: Callable[[], bool] = lambda: True) -> Any:
    """The ASGI app: the /v1 routes and /health over `routing`, bodies limited to `max_body_bytes`; /health waits for
    `settled()` (the router's tokenizer adopted or known unusable), as gRPC health does."""
    # FastAPI's own server span per request, continuing the caller's traceparent: each attempt's span is its child
    app = FastAPI(title="pagedserve router", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry={"operation_spans": False, "auto_configure": False})
    app.state.routing = routing
    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        """200 while a pod that serves HTTP is routable and the tokenizer settled; 503 naming why not."""
        try:
            routing.http_pods()
        except NotReady as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc)}, status_code=503)
        if not settled():  # before that, requests would be routed by load with nothing predicted
            return JSONResponse({"status": "unavailable", "reason": "the router's tokenizer is not settled yet"},
                                status_code=503)
        return JSONResponse({"status": "serving"})

    async def http_error(request: Request, exc: Exception) -> Response:  # unknown paths and methods
        return error_response(exc)

    app.add_exception_handler(HTTPException, http_error)
    return BodyLimit(app, max_body_bytes)
