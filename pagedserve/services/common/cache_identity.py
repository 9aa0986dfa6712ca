"""What shapes a pod's KV cache, so that a router computes the cache namespace exactly as the pod does.

The pod's frontend roots every block-hash chain at `prefix_hash.cache_namespace(...)` over these fields and
the tenant's salt. A router predicts a pod's prefix hits only if it hashes from the same root, so it learns
every field from the pod itself (never from its own guesses: a tokenizer loaded from another path has
another `name_or_path`) and refuses a pod whose identity differs from the fleet's, naming the field.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, fields

from ..block_manager.prefix_hash import cache_namespace

_LONG_FIELD_CHARS = 64  # longer values (chat templates) are named by a digest in messages


@dataclass(frozen=True)
class CacheIdentity:
    """Everything but the tenant that shapes a block's key: the same fields, in the same roles, as the pod's."""

    model_digest: str  # weights digest, or id plus revision
    tokenizer: str
    chat_template: str
    kv_dtype: str
    block_size: int
    adapter: str = ""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"CacheIdentity.block_size must be positive, got {self.block_size}")

    def namespace(self, tenant_salt: bytes) -> bytes:
        """The root of the chains of the tenant whose salt is `tenant_salt` (b"": the anonymous namespace)."""
        return _namespace(self, tenant_salt)

    def differences(self, other: CacheIdentity) -> list[str]:
        """One line per field that differs, e.g. "kv_dtype: 'bf16' here, 'fp8' there"; [] when none does."""
        lines = []
        for spec in fields(self):
            mine, theirs = getattr(self, spec.name), getattr(other, spec.name)
            if mine != theirs:
                lines.append(f"{spec.name}: {_shown(mine)} here, {_shown(theirs)} there")
        return lines


def _shown(value: object) -> str:
    text = repr(value)
    if len(text) <= _LONG_FIELD_CHARS:
        return text
    return f"<{len(str(value))} characters, blake2b {hashlib.blake2b(str(value).encode(), digest_size=8).hexdigest()}>"


@functools.lru_cache(maxsize=4096)  # asked per request, by pods and routers alike; a tenant's requests recur
def _namespace(identity: CacheIdentity, tenant_salt: bytes) -> bytes:
    return cache_namespace(model=identity.model_digest, tokenizer=identity.tokenizer,
                           chat_template=identity.chat_template, adapter=identity.adapter, kv_dtype=identity.kv_dtype,
                           block_size=identity.block_size, tenant_salt=tenant_salt)
