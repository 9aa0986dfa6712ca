"""API keys: the server decides who is calling, and the tenant decides the prefix-cache namespace.

The keys file has one `KEY TENANT` pair per line (blank lines and `#` comments skipped). Several keys may
name one tenant (rotation: old and new key share the tenant's cache). With a file, every call outside
health and reflection needs a listed key in `authorization: Bearer KEY` or `x-api-key: KEY` metadata,
or is answered UNAUTHENTICATED. Without one, the server trusts its network: the tenant is whatever key
the client sends, as an unchecked label (docs/reliability.md).

The cache salt is keyed with a secret over the tenant and an optional `x-cache-salt` the client sends: the
client can split its own tenant's cache further, never reach another tenant's (common/cache_salt.py).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from ..common.cache_salt import Metadata

MIN_KEY_CHARS = 16  # a short key can be guessed; the file is refused rather than served
# probes and tools must work without a key: these services say nothing about any tenant
OPEN_SERVICES = (f"/{health_pb2.DESCRIPTOR.services_by_name['Health'].full_name}/", f"/{reflection.SERVICE_NAME}/")


class KeysFileError(ValueError):
    """A malformed keys file: the message names the line, never a key."""


@dataclass(frozen=True)
class ApiKeys:
    entries: tuple[tuple[bytes, str], ...]  # (sha256 of a key, its tenant)

    @staticmethod
    def parse(text: str, source: str = "the keys file") -> ApiKeys:
        entries: list[tuple[bytes, str]] = []
        seen: dict[bytes, int] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            if len(fields) != 2:
                raise KeysFileError(f"{source}, line {number}: expected `KEY TENANT`, found {len(fields)} fields")
            key, tenant = fields
            if len(key) < MIN_KEY_CHARS or not key.isascii() or not key.isprintable():
                raise KeysFileError(f"{source}, line {number}: a key must be at least {MIN_KEY_CHARS} printable"
                                    " ASCII characters")
            digest = _digest(key)
            if digest in seen:
                raise KeysFileError(f"{source}, line {number}: the same key as line {seen[digest]}")
            seen[digest] = number
            entries.append((digest, tenant))
        if not entries:
            raise KeysFileError(f"{source}: no keys (every call would be refused)")
        return ApiKeys(tuple(entries))

    @staticmethod
    def load(path: str) -> ApiKeys:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"--api-keys-file {path}: cannot read it ({exc})") from None
        return ApiKeys.parse(text, f"--api-keys-file {path}")

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self.entries}

    def tenant_for(self, key: str) -> str | None:
        """The key's tenant, or None. Compares digests (equal lengths) with every key, without stopping at a
        match, so the time taken says neither which key matched nor how long the keys are."""
        presented = _digest(key)
        found = None
        for digest, tenant in self.entries:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def presented_key(metadata: Metadata) -> str:
    """The key in `authorization: Bearer KEY` (preferred) or `x-api-key: KEY`; "" when there is none."""
    headers = {k.lower(): _text(v) for k, v in metadata or ()}
    scheme, _, credential = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and credential.strip():
        return credential.strip()
    return headers.get("x-api-key", "").strip() or headers.get("authorization", "").strip()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a listed key, except health and reflection: a method added later is
    closed by default. The servicer reads the tenant again (another constant-time pass, microseconds)."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys
        self._refusals: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        if self.keys.tenant_for(presented_key(details.invocation_metadata)) is not None:
            return handler
        refusal = self._refusals.get(details.method)
        if refusal is None:
            refusal = self._refusals[details.method] = _refusal(handler)
        return refusal


UNAUTHENTICATED = "a valid API key is required (authorization: Bearer KEY, or x-api-key: KEY)"


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers UNAUTHENTICATED without reading the request."""
    def keep_bytes(data: bytes) -> bytes:  # no parsing for strangers
        return data

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
        yield  # an async generator, like the handler it stands in for

    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, keep_bytes, serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, keep_bytes, serialize)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, keep_bytes, serialize)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, keep_bytes, serialize)
