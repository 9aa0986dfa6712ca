"""TLS credentials from PEM files, for the public API's server and its clients (the sidecars stay plain).

Files are read once at startup; a missing or non-PEM file is a clear error naming the flag, not a
handshake that fails later for every client.
"""

from __future__ import annotations

from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """A TLS flag is missing its partner or names a file that is not PEM."""


def read_pem(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """None without a certificate (plain gRPC); with `client_ca`, clients must present a certificate it signed."""
    if not cert and not key:
        if client_ca:
            raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if not cert or not key:
        raise TlsConfigError("--tls-cert and --tls-key go together")
    pair = (read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))
    if client_ca:
        return grpc.ssl_server_credentials([pair], root_certificates=read_pem(client_ca, "--tls-client-ca"),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials([pair])


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    """A client's TLS: `ca` to verify the server (default: the system's roots), `cert`/`key` for mutual TLS."""
    if bool(cert) != bool(key):
        raise TlsConfigError("--tls-cert and --tls-key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "--tls-ca") if ca else None,
        private_key=read_pem(key, "--tls-key") if key else None,
        certificate_chain=read_pem(cert, "--tls-cert") if cert else None,
    )
