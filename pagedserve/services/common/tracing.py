"""OpenTelemetry tracing across the three processes, exported over OTLP/gRPC when configured.

Tracing is on when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` is set (e.g. `http://127.0.0.1:4317`); then each
service exports its spans under `service.name` = `pagedserve-<service>`, batched. Otherwise no span is made
(the per-step RPCs are latency-critical). Context crosses processes in the W3C `traceparent` gRPC metadata:
`TracingClientInterceptor` injects it on our sidecar calls and every server span (grpc_server.py) extracts it,
so a client's own trace continues into the frontend's Generate span. The sidecars' step streams carry many
steps in one call, so each step message carries its own `traceparent` instead (`client_span`, `message_span`):
each engine step's Execute and Step are children of that step's span, in the executor's and block manager's
traces.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import propagate, trace

TRACER_NAME = "pagedserve"
_provider: Any = None  # the SDK TracerProvider once configured, for the final flush


def init_tracing(service: str) -> bool:
    """Exports this process's spans over OTLP if `OTEL_EXPORTER_OTLP_ENDPOINT` is set; returns whether it does."""
    global _provider
    if _provider is not None:
        return True
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _provider = TracerProvider(resource=Resource.create({"service.name": f"pagedserve-{service}"}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    return True


def tracing_enabled() -> bool:
    return _provider is not None


def shutdown_tracing() -> None:
    """Flushes the spans still batched; call once, when the service stops."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def extract_context(metadata: Sequence[tuple[str, Any]] | None) -> Any:
    """The caller's trace context from gRPC invocation metadata (an empty context when it sent none)."""
    return propagate.extract({key: value for key, value in metadata or () if isinstance(value, str)})


class TracingClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    """A CLIENT span per unary call, its context sent along in the metadata."""

    def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        with tracer().start_as_current_span(details.method.lstrip("/"), kind=trace.SpanKind.CLIENT):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            metadata = [*(details.metadata or ()), *carrier.items()]
            return continuation(_CallDetails(details, metadata), request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = metadata


def traced_channel(channel: grpc.Channel) -> grpc.Channel:
    """The channel with client spans and context propagation when tracing is on; as it is otherwise."""
    return grpc.intercept_channel(channel, TracingClientInterceptor()) if tracing_enabled() else channel


def client_span(method: str) -> tuple[Any, str]:
    """A CLIENT span for one message of a step stream, child of the current span, and the traceparent to send
    in the message; (None, "") when tracing is off. The caller ends the span when the answer comes."""
    if not tracing_enabled():
        return None, ""
    span = tracer().start_span(method, kind=trace.SpanKind.CLIENT)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier.get("traceparent", "")


@contextmanager
def message_span(method: str, traceparent: str) -> Iterator[None]:
    """A SERVER span for one message of a step stream ("/package.Service/Method", as the client names it),
    continuing the trace its traceparent names."""
    if not tracing_enabled():
        yield
        return
    context = propagate.extract({"traceparent": traceparent} if traceparent else {})
    with tracer().start_as_current_span(method.lstrip("/"), context=context, kind=trace.SpanKind.SERVER,
                                        record_exception=False):
        yield
