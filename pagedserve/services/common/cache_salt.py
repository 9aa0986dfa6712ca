"""The tenant's cache salt: what roots a tenant's block-hash chains, computed alike by every pod and router.

A pod derives the salt from who is calling (the tenant its keys file gives the caller's key) and an optional
`x-cache-salt` header (the client may split its own tenant's cache further, never reach another tenant's),
keyed with a secret so that no one without it can compute a tenant's namespace (and probe its cache). A router
predicts a pod's prefix hits only if it derives the same salt, so the secret is the fleet's: the bytes of
`--cache-salt-secret-file`, given to every pod and router. Without that file each process draws its own secret,
and a router can predict only the anonymous namespace (no tenant, no header: salt b"").
No grpc here: the router's core and the pods' front doors both import it.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections.abc import Iterable
from pathlib import Path

CACHE_SALT_HEADER = "x-cache-salt"
MIN_SECRET_BYTES = 32  # a blake2b key of 256 bits; a shorter file is refused rather than used
Metadata = Iterable[tuple[str, str | bytes]] | None


class CacheSaltSecretError(ValueError):
    """An unreadable or too short secret file: the message names the flag and the path, never the bytes."""


def load_secret(path: str | None, flag: str = "--cache-salt-secret-file") -> bytes:
    """The file's bytes (at least MIN_SECRET_BYTES; used whole, as a blake2b key of at most 64 bytes after a
    digest), or a random per-process secret when no file is given."""
    if not path:
        return secrets.token_bytes(MIN_SECRET_BYTES)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CacheSaltSecretError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if len(data) < MIN_SECRET_BYTES:
        raise CacheSaltSecretError(f"{flag} {path}: holds {len(data)} bytes; the secret needs at least "
                                   f"{MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom > FILE`)")
    return hashlib.blake2b(data, person=b"pagedserve-salt").digest()  # any length in, a 64-byte key out


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def client_salt(metadata: Metadata) -> str:
    """The caller's own `x-cache-salt` header ("" when it sends none)."""
    return next((_text(v) for k, v in metadata or () if k.lower() == CACHE_SALT_HEADER), "")


@functools.lru_cache(maxsize=4096)  # derived per request, on pods and routers; a tenant's requests recur
def tenant_salt(secret: bytes, tenant: str, salt: str) -> bytes:
    """The cache salt of (tenant, client salt), keyed with the secret; b"" when both are empty (the anonymous
    namespace). Length-prefixed, so no (tenant, salt) pair can spell another's."""
    if not tenant and not salt:
        return b""
    data = len(tenant.encode()).to_bytes(4, "big") + tenant.encode() + salt.encode()
    return hashlib.blake2b(data, key=secret, digest_size=16).digest()
