"""The router's side of the pods' public gRPC API: one channel per pod, and what a forwarded call carries.

One HTTP/2 channel per pod carries its watcher's event stream and every request the router sends there, each
request a call of its own (this is what spreads a client's requests where a connection-level balancer cannot).

A forwarded call carries the caller's metadata (API key, `x-cache-salt`, anything else the pod may read), less
what belongs to the hop (gRPC's transport headers, the user agent): the pod authenticates the caller and derives
its tenant as if called directly. The trace continues: with tracing on, the router's CLIENT span for the attempt
replaces the caller's `traceparent`, so the pod's span is the router's child; with tracing off the caller's own
context goes through untouched. The deadline is what is left of the caller's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import grpc.aio
from opentelemetry import propagate, trace

from ...protos import inference_pb2_grpc as pb_grpc
from ..common.grpc_server import CHANNEL_OPTIONS
from ..common.tracing import tracer, tracing_enabled

HOP_HEADERS = frozenset({"user-agent", "content-type", "te", "host", "content-length"})
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})


class PodChannels:
    """A channel and stub per pod address, plain or over TLS (`credentials`, the pods' certificate checked against
    `server_name` when given, else the address)."""

    def __init__(self, addresses: Sequence[str], credentials: grpc.ChannelCredentials | None = None,
                 server_name: str = "") -> None:
        self.credentials, self.server_name = credentials, server_name
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.stubs: dict[str, pb_grpc.InferenceStub] = {}
        for address in addresses:
            self.add(address)

    def add(self, address: str) -> pb_grpc.InferenceStub:
        if address not in self.channels:
            self.channels[address] = _channel(address, self.credentials, self.server_name)
            self.stubs[address] = pb_grpc.InferenceStub(self.channels[address])
        return self.stubs[address]

    async def remove(self, address: str, grace_s: float) -> None:
        """Forgets the pod's channel; the calls still on it have `grace_s` to finish before they are cancelled."""
        self.stubs.pop(address, None)
        channel = self.channels.pop(address, None)
        if channel is not None:
            await channel.close(grace=grace_s)

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close(grace=None)


def _channel(address: str, credentials: grpc.ChannelCredentials | None, server_name: str) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    # pods are dialled by IP: a certificate shared by the fleet names the Service instead
    options = [*CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", server_name)] if server_name else [])]
    return grpc.aio.secure_channel(address, credentials, options=options)


def forwarded_metadata(metadata: Iterable[tuple[str, Any]] | None, span: trace.Span | None = None
                       ) -> list[tuple[str, Any]]:
    """The caller's metadata for the pod: the hop's own headers dropped; with `span`, its trace context in place
    of the caller's."""
    kept = [(key, value) for key, value in metadata or ()
            if key not in HOP_HEADERS and not key.startswith(("grpc-", ":")) and not (span and key in TRACE_HEADERS)]
    if span is not None:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        kept += carrier.items()
    return kept


def attempt_span(method: str, pod: str) -> trace.Span | None:
    """A CLIENT span for one attempt at one pod, child of the router's server span for the call (grpc_server.py
    made it current); None when tracing is off. The caller ends it."""
    if not tracing_enabled():
        return None
    return tracer().start_span(f"route {method}", kind=trace.SpanKind.CLIENT,
                               attributes={"pagedserve.router.pod": pod, "server.address": pod})
