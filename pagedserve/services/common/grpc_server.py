"""The gRPC server scaffold every service uses: error mapping, health, reflection, graceful stop.

As in KServe's server: a domain error becomes the right status code (bad input -> INVALID_ARGUMENT, out
of capacity -> RESOURCE_EXHAUSTED, not ready -> UNAVAILABLE, no valid key -> UNAUTHENTICATED); anything
else is logged and answered INTERNAL with a generic message, so internals never leak to clients and the
server keeps serving. Bytes that do not parse as the method's request are INVALID_ARGUMENT too (gRPC itself
would answer UNKNOWN with the parser's exception).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from .errors import InvalidRequest, NotReady, OutOfCapacity, Unauthenticated
from .health import HealthServicer
from .tracing import extract_context, init_tracing, shutdown_tracing, tracer, tracing_enabled

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [  # clients of our services: the same message limits
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # a sidecar that restarts is back in seconds: reconnect within a second of it (gRPC's default backoff
    # grows to two minutes)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """A public server receives less than the sidecars (`--max-message-bytes`); what it sends keeps the
    common limit (a unary answer with n samples and logprobs can be large)."""
    return [("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, OutOfCapacity):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, NotReady):
        return grpc.StatusCode.UNAVAILABLE, str(exc) or "not ready"
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc) or "a valid API key is required"
    return grpc.StatusCode.INTERNAL, "internal error"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in %s", method, exc_info=exc)
    await context.abort(code, message)


class HandlerRegistry:
    """Where a service's servicers register (the `server` argument of a generated `add_*Servicer_to_server`):
    each method's handler is wrapped once with the error mapping before the grpc.aio server sees it. Wrapped at
    registration rather than by a server interceptor: grpc.aio runs an interceptor chain as coroutines on every
    call, which cost a routed request ~0.1 ms here."""

    def __init__(self, server: grpc.aio.Server, streams: OpenStreams) -> None:
        self.server, self.streams = server, streams

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers([_MappedHandlers(handler, self.streams) for handler in handlers])

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.server.add_registered_method_handlers(
            service, {name: _wrap(handler, f"/{service}/{name}", self.streams) for name, handler in handlers.items()})


class _MappedHandlers(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, streams: OpenStreams) -> None:
        self.inner, self.streams = inner, streams
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}  # method -> (its, ours)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self.inner.service(details)
        if handler is None:
            return None
        cached = self._wrapped.get(details.method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[details.method] = (handler, _wrap(handler, details.method, self.streams))
        return cached[1]


class _Unparsable(NamedTuple):
    """A request whose bytes are not a message of the method's type. gRPC itself would answer UNKNOWN with
    the parser's exception; the wrapped handler answers INVALID_ARGUMENT instead."""

    error: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Unparsable(str(exc))

    return deserialize


def _parsed(request: Any) -> Any:
    if isinstance(request, _Unparsable):
        raise InvalidRequest(f"request: {request.error}")
    return request


class OpenStreams:
    """The request streams of the server's open bidirectional calls (the sidecars' step streams), so that a
    graceful stop can end them: a client keeps its stream open for as long as the server lives, which would
    hold the stop for its whole grace."""

    def __init__(self) -> None:
        self.open: set[StreamRequests] = set()
        self.stopping = False

    def end(self) -> None:
        """Each stream answers what it has read and then ends UNAVAILABLE; one waiting for a message ends now."""
        self.stopping = True
        for stream in self.open:
            if stream.reading is not None:
                stream.reading.cancel()


class StreamRequests:
    """A bidirectional call's requests as its handler reads them: parsed (InvalidRequest for bytes that are
    not a message), and ended with NotReady (UNAVAILABLE) once the service stops."""

    def __init__(self, requests: AsyncIterator[Any], streams: OpenStreams) -> None:
        self.requests, self.streams = requests, streams
        self.reading: asyncio.Task[Any] | None = None  # the task waiting for the next message, if one is

    def __aiter__(self) -> StreamRequests:
        return self

    async def __anext__(self) -> Any:
        if self.streams.stopping:
            raise NotReady("the service is stopping")
        self.reading = asyncio.current_task()
        try:
            request = await self.requests.__anext__()
        except asyncio.CancelledError:
            if self.streams.stopping:  # cancelled by OpenStreams.end
                raise NotReady("the service is stopping") from None
            raise
        finally:
            self.reading = None
        return _parsed(request)


async def _mapped(call: Callable[[], Awaitable[Any]], context: grpc.aio.ServicerContext, method: str) -> Any:
    """A handler's call, with a domain error answered as its status (anything unexpected: INTERNAL)."""
    try:
        return await call()
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception as exc:
        await _abort(context, exc, method)


def _wrap(handler: grpc.RpcMethodHandler, method: str, streams: OpenStreams) -> grpc.RpcMethodHandler:
    deserializer = _tolerant(handler.request_deserializer)
    if handler.stream_stream is not None:
        inner_bidi = handler.stream_stream

        async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # no span for the call: it carries many steps, and the servicer traces each (its traceparent)
            reading = StreamRequests(requests, streams)
            streams.open.add(reading)
            try:
                async for response in inner_bidi(reading, context):
                    yield response
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:
                await _abort(context, exc, method)
            finally:
                streams.open.discard(reading)

        return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, handler.response_serializer)
    if handler.unary_unary is not None:
        inner_unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with _server_span(method, context):
                return await _mapped(lambda: inner_unary(_parsed(request), context), context, method)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, handler.response_serializer)
    if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
        inner_stream = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with _server_span(method, context):  # one generator between the handler and gRPC: each costs a message
                try:
                    async for response in inner_stream(_parsed(request), context):
                        yield response
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    await _abort(context, exc, method)

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, handler.response_serializer)
    if handler.unary_stream is not None:  # a stream written with context.write (health's Watch): awaited
        inner_writer = handler.unary_stream

        async def unary_stream_writer(request: Any, context: grpc.aio.ServicerContext) -> None:
            with _server_span(method, context):
                await _mapped(lambda: inner_writer(_parsed(request), context), context, method)

        return grpc.unary_stream_rpc_method_handler(unary_stream_writer, deserializer, handler.response_serializer)
    return handler


def _server_span(method: str, context: grpc.aio.ServicerContext) -> Any:
    """A SERVER span for one call, continuing the caller's trace (tracing.py); none when tracing is off."""
    if not tracing_enabled():
        return contextlib.nullcontext()
    return tracer().start_as_current_span(
        method.lstrip("/"), context=extract_context(context.invocation_metadata()), kind=trace.SpanKind.SERVER,
        record_exception=False,
    )


class GrpcService:
    """A grpc.aio server with health (NOT_SERVING until `mark_serving`) and reflection; over TLS when given
    server credentials. Servicers register with `handlers` (the error mapping); `interceptors` see each call
    before its handler and answer by handlers of their own, never by raising (auth.py's refusals)."""

    def __init__(
        self, listen: str, service_names: Iterable[str], interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None, max_receive_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.listen = listen
        self.service_names = list(service_names)
        self.credentials = credentials
        self.streams = OpenStreams()
        self.server = grpc.aio.server(interceptors=list(interceptors), options=server_options(max_receive_bytes))
        self.handlers = HandlerRegistry(self.server, self.streams)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.handlers)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        self.port = 0
        # called first at a stop: what ends the service's endless streams (a stream of events has no requests
        # for OpenStreams to end, and would hold the stop for its whole grace)
        self.on_stop: list[Callable[[], None]] = []

    async def start(self) -> None:
        if self.credentials is None:
            self.port = self.server.add_insecure_port(self.listen)
        else:
            self.port = self.server.add_secure_port(self.listen, self.credentials)
        if self.port == 0 and not self.listen.startswith("unix:"):
            raise OSError(f"cannot listen on {self.listen}")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def mark_serving(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def mark_not_serving(self) -> None:
        """Up, but unable to serve for now (a frontend that lost a sidecar)."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set_health(self, status: int) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        for callback in self.on_stop:
            callback()
        self.streams.end()
        await self.server.stop(grace)


class Listener(Protocol):
    """What serve_until_signalled starts and stops: a GrpcService, or an HttpService (http_server.py)."""

    listen: str

    async def start(self) -> None: ...

    async def mark_serving(self) -> None: ...

    async def stop(self, grace: float = 5.0) -> None: ...


# Every step allocates thousands of short-lived containers (per-sequence inputs, outputs, messages). At the
# default young-generation threshold (700) the frontend at 256 sequences ran several collections a step and a
# full one (walking every live token list, 20-30 ms) every few hundred steps: a quarter of its CPU (bench
# overhead: 4.0-4.6 -> 3.1 ms a step). Objects that die young now die before a collection sees them.
GC_THRESHOLDS = (20_000, 20, 10)

# Set by processes.start_service to the supervisor's PID: a child whose supervisor died without stopping it (a
# SIGKILL, or a SIGTERM that skips Python's finalizers) sees itself re-parented and stops as on SIGTERM, where it
# would otherwise hold its port, its memory and the GPU until someone found it.
PARENT_PID_ENV = "PAGEDSERVE_PARENT_PID"


async def _stop_when_orphaned(parent: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.warning("the supervising process %d is gone: stopping", parent)
    stop.set()


async def serve_until_signalled(
    service: GrpcService, warm_up: Callable[[], Awaitable[None]] | None = None, also: Sequence[Listener] = ()
) -> None:
    """Starts, warms up, reports SERVING, and stops gracefully on SIGTERM or SIGINT. `also`: more servers of
    the same process (another listener with other settings, the HTTP API), started before the warm-up and
    stopped with the first."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.environ.pop(PARENT_PID_ENV, None)  # popped: what this process starts has other supervisors
    orphan_watch = asyncio.ensure_future(_stop_when_orphaned(int(parent), stop)) if parent else None
    await service.start()
    # the address is known (and health answers NOT_SERVING) before the warm-up, which may take a while;
    # supervisors read the first such line as the service's address
    print(f"listening on {service.listen} (port {service.port})", flush=True)
    started: list[Listener] = [service]
    try:
        for other in also:
            await other.start()
            started.append(other)
            log.info("also listening on %s", other.listen)
        if warm_up is not None:
            warming = asyncio.ensure_future(warm_up())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({warming, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not warming.done():  # SIGTERM while loading a model or waiting for the sidecars: leave now
                log.info("stopping during the warm-up")
                await asyncio.gather(*(each.stop(grace=0) for each in started))
                shutdown_tracing()
                os._exit(0)  # the warm-up's thread (a load, a wait) cannot be interrupted, and exit would join it
            stopping.cancel()
            warming.result()  # its error, if it failed
    except BaseException:  # a port taken, a failed warm-up: what did start stops before the error is raised
        await asyncio.gather(*(each.stop(grace=0) for each in started))
        raise
    # Everything alive now (modules, the model, tables) lives as long as the process: moved out of the
    # collector's generations, full collections stop walking it, which kept stalling steps by 10-25 ms.
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    for each in (service, *also):
        await each.mark_serving()
    log.info("serving %s on %s", ", ".join(service.service_names), service.listen)
    await stop.wait()
    log.info("stopping")
    if orphan_watch is not None:
        orphan_watch.cancel()
    await asyncio.gather(*(each.stop() for each in (service, *also)))
    shutdown_tracing()


def run(main: Coroutine[Any, Any, None], service: str) -> None:
    """Runs a service's main coroutine on uvloop, with tracing when OTLP is configured (tracing.py)."""
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if init_tracing(service):
        log.info("exporting traces to %s", os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
    uvloop.run(main)
