"""Limits of the public API, checked before a request reaches the engine: one client cannot ask for more
than an operator allows, nor hold more than its share of streams.

The engine's own checks (context length, KV blocks) still apply; these are the operator's, tighter ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..common.errors import InvalidRequest, OutOfCapacity
from .request import GenerationParams

DEFAULT_MAX_TOKENS = 16  # when a request does not say


@dataclass(frozen=True)
class ApiLimits:
    max_prompt_tokens: int | None = None  # None: the model's context decides
    max_new_tokens: int | None = None  # None: the model's context decides
    max_n: int = 16
    max_streams_per_tenant: int = 128

    @property
    def default_max_tokens(self) -> int:
        return min(DEFAULT_MAX_TOKENS, self.max_new_tokens or DEFAULT_MAX_TOKENS)

    def check(self, num_prompt_tokens: int, params: GenerationParams) -> None:
        if self.max_prompt_tokens is not None and num_prompt_tokens > self.max_prompt_tokens:
            raise InvalidRequest(f"prompt: {num_prompt_tokens} tokens exceed this server's limit of "
                                 f"{self.max_prompt_tokens}")
        if self.max_new_tokens is not None and params.max_tokens > self.max_new_tokens:
            raise InvalidRequest(f"max_tokens: {params.max_tokens} exceeds this server's limit of "
                                 f"{self.max_new_tokens}")


class StreamCounter:
    """Requests in flight per tenant. Touched only on the API's event loop, so a dict is enough."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._counts: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        return self._counts.get(tenant, 0)

    @contextmanager
    def hold(self, tenant: str) -> Iterator[None]:
        """One stream for the duration of the block; released however it ends (done, error, cancel)."""
        count = self._counts.get(tenant, 0)
        if count >= self.limit:
            raise OutOfCapacity(f"this tenant already has {count} requests in flight, the limit per tenant; "
                                "retry when one ends")
        self._counts[tenant] = count + 1
        try:
            yield
        finally:
            remaining = self._counts[tenant] - 1
            if remaining:
                self._counts[tenant] = remaining
            else:
                del self._counts[tenant]  # no entry per tenant ever seen: the dict stays as small as the load
