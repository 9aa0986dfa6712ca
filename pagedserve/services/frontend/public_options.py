"""The public API's security and limit flags: `pagedserve frontend` reads them, `pagedserve serve` passes
them on. Files are loaded at startup, so a bad certificate or keys file stops the process with a clear
message instead of failing every call later (docs/reliability.md)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import grpc

from ..common.cache_salt import load_secret
from ..common.tls import server_credentials
from .auth import ApiKeys
from .limits import ApiLimits

MiB = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 4 * MiB  # gRPC's own default: a prompt at a 128k context is well under 1 MiB
PATH_FLAGS = ("tls_cert", "tls_key", "tls_client_ca", "api_keys_file", "cache_salt_secret_file")
LIMIT_FLAGS = ("max_prompt_tokens", "max_new_tokens", "max_n", "max_streams_per_tenant", "max_message_bytes")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_public_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security and limits of the public API")
    group.add_argument("--tls-cert", metavar="PEM", help="serve over TLS with this certificate (chain)")
    group.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    group.add_argument("--tls-client-ca", metavar="PEM",
                       help="mutual TLS: require client certificates signed by this CA")
    group.add_argument("--api-keys-file", metavar="FILE",
                       help="`KEY TENANT` per line: calls need a listed key, and the tenant owns its prefix cache "
                            "(without it every caller is trusted: only on a network you trust)")
    group.add_argument("--cache-salt-secret-file", metavar="FILE",
                       help="the fleet's key of the tenants' cache salts (at least 32 bytes, the same file on every "
                            "pod and router, so a router can predict keyed tenants' prefix hits); without it a "
                            "random secret per process")
    group.add_argument("--max-prompt-tokens", type=positive_int, help="longest prompt (default: the context)")
    group.add_argument("--max-new-tokens", type=positive_int, help="largest max_tokens (default: the context)")
    group.add_argument("--max-n", type=positive_int, default=16, help="most parallel samples per request")
    group.add_argument("--max-streams-per-tenant", type=positive_int, default=128,
                       help="requests in flight per tenant; past it RESOURCE_EXHAUSTED")
    group.add_argument("--max-message-bytes", type=positive_int, default=DEFAULT_MAX_MESSAGE_BYTES,
                       help="largest request message the public API accepts")


def public_flags(args: argparse.Namespace) -> list[str]:
    """The same flags as arguments for a `pagedserve frontend` command line (only those set)."""
    out: list[str] = []
    for name in (*PATH_FLAGS, *LIMIT_FLAGS):
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


@dataclass(frozen=True)
class PublicSettings:
    credentials: grpc.ServerCredentials | None
    keys: ApiKeys | None
    limits: ApiLimits
    max_message_bytes: int
    cache_salt_secret: bytes


def load_public_settings(args: argparse.Namespace) -> PublicSettings:
    """Reads the certificate, keys and salt secret files; raises ValueError (TlsConfigError, KeysFileError,
    CacheSaltSecretError) naming the flag."""
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    keys = ApiKeys.load(args.api_keys_file) if args.api_keys_file else None
    limits = ApiLimits(args.max_prompt_tokens, args.max_new_tokens, args.max_n, args.max_streams_per_tenant)
    return PublicSettings(credentials, keys, limits, args.max_message_bytes, load_secret(args.cache_salt_secret_file))
