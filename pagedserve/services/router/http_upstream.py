"""The router's side of the pods' OpenAI-compatible HTTP APIs: where each pod serves it, one pooled HTTP client for
all of them, and which headers a forwarded request and its answer carry.

A pod's HTTP address is its gRPC address's host and the `http_port` its ListModels names (0: it serves no HTTP API,
and takes no HTTP request from the router). With the router's pod credentials (`--pod-tls-*`) the pods are reached
over HTTPS with the same CA and client certificate as their gRPC port: a pod serves both under one certificate.

A forwarded request carries the caller's headers (API key, `x-cache-salt`, anything else the pod may read) less the
hop-by-hop ones (RFC 9110 7.6.1) and those the client library sets for its own connection; the trace continues as
on gRPC (upstream.py): with tracing on, the router's span for the attempt replaces the caller's `traceparent`. The
answer's headers are the pod's, less those the router's own server writes for its connection. Bodies pass through
as bytes: nothing is decompressed or re-encoded, and no cookie is kept between callers.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import aiohttp
from opentelemetry import propagate, trace

from ...protos import inference_pb2 as pb
from .upstream import TRACE_HEADERS

HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "content-length", "expect"})
ANSWER_HOP_HEADERS = HOP_HEADERS | {"date", "server"}  # the router's server writes its own
CONNECT_TIMEOUT_S = 5.0  # no overall limit: a request may wait its turn and generate for minutes


class PodHttp:
    """Each pod's HTTP port (from its ListModels) and the one HTTP client the router reaches them with."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None, server_name: str = "") -> None:
        self.ports: dict[str, int] = {}
        self.scheme = "https" if ssl_context is not None else "http"
        self._ssl = ssl_context
        # each request's options: the name the pods' certificate is checked against (`--pod-tls-server-name`)
        self.request_options: dict[str, Any] = {"server_hostname": server_name} if server_name else {}
        self._session: aiohttp.ClientSession | None = None

    def on_model(self, pod: str, model: pb.ModelInfo) -> None:
        """A pod was accepted (watcher.py): its HTTP port, which a pod restarted at the same address may change."""
        self.ports[pod] = model.http_port

    def serves_http(self, pod: str) -> bool:
        return bool(self.ports.get(pod))

    def url(self, pod: str, path: str) -> str:
        host = pod.rpartition(":")[0]  # an IPv6 host keeps its brackets
        return f"{self.scheme}://{host}:{self.ports[pod]}{path}"

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled client, made on first use (on the running loop). No limit on connections: each request in
        flight holds one (HTTP/1.1), and a cap would queue requests here unseen by the choice."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl if self._ssl is not None else True)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
                auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def forwarded_headers(headers: Iterable[tuple[str, str]], span: trace.Span | None = None) -> list[tuple[str, str]]:
    """The caller's headers for the pod: hop-by-hop ones dropped (and any the caller's `connection` names); with
    `span`, its trace context in place of the caller's."""
    pairs = [(key.lower(), value) for key, value in headers]
    named = {token.strip().lower() for key, value in pairs if key == "connection" for token in value.split(",")}
    kept = [(key, value) for key, value in pairs
            if key not in HOP_HEADERS and key not in named and not (span and key in TRACE_HEADERS)]
    if span is not None:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        kept += carrier.items()
    return kept


def answer_headers(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The pod's answer headers the router passes on."""
    return {key.lower(): value for key, value in headers if key.lower() not in ANSWER_HOP_HEADERS}
