"""Certificates for TLS tests, made with the `openssl` command: a CA, a server certificate for localhost and
127.0.0.1, a client certificate signed by the CA, and a client certificate signed by no one we trust; and checks
that a handshake was refused as a handshake, not failed some other way."""

from __future__ import annotations

import ssl
import subprocess
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# gRPC's words (in an UNAVAILABLE status's details) for a connection the server closed during the handshake (it
# refused the client's certificate, or its plain text), and for a server certificate the client refused. A port
# where nothing listens says "Connection refused" instead.
SERVER_CLOSED = "Socket closed"
CLIENT_REFUSED = "Tls handshake failed"
# what an HTTPS client sees when a handshake is refused: a TLS error, or the server closing the connection before
# any answer (http.client's RemoteDisconnected is a ConnectionResetError); never ConnectionRefusedError
HANDSHAKE_FAILURES = (ssl.SSLError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]  # fast to make, unlike RSA


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # self-signed: not from the CA the server trusts
    stranger_key: Path

    def client(self, with_cert: bool = True) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.client_key.read_bytes() if with_cert else None,
            certificate_chain=self.client_cert.read_bytes() if with_cert else None,
        )

    def stranger(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), self.stranger_key.read_bytes(),
                                            self.stranger_cert.read_bytes())


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _signed(folder: Path, name: str, subject: str, extensions: str, ca: Path, ca_key: Path) -> tuple[Path, Path]:
    key, csr, cert, ext = (folder / f"{name}.{s}" for s in ("key", "csr", "pem", "ext"))
    ext.write_text(extensions + "\n")
    _openssl("req", *EC_KEY, "-keyout", key, "-out", csr, "-subj", subject)
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "2",
             "-extfile", ext)
    return cert, key


def make_certs(folder: Path) -> Certs:
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    _openssl("req", "-x509", *EC_KEY, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=pagedserve test CA")
    server = _signed(folder, "server", "/CN=localhost",
                     "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth", ca, ca_key)
    client = _signed(folder, "client", "/CN=tenant-client", "extendedKeyUsage=clientAuth", ca, ca_key)
    stranger, stranger_key = folder / "stranger.pem", folder / "stranger.key"
    _openssl("req", "-x509", *EC_KEY, "-keyout", stranger_key, "-out", stranger, "-days", "2", "-subj", "/CN=stranger")
    return Certs(ca, *server, *client, stranger, stranger_key)


def grpc_handshake_refusal(channel: grpc.Channel, words: str) -> str:
    """Checks that a health check over `channel` fails UNAVAILABLE in the TLS handshake, its details holding
    `words` (SERVER_CLOSED or CLIENT_REFUSED); returns the details."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.RpcError as exc:
        details = exc.details() or ""
        assert exc.code() == grpc.StatusCode.UNAVAILABLE and words in details, (exc.code(), details)
        return details
    raise AssertionError("the health check was answered: the handshake was not refused")


def https_handshake_refusal(call: Callable[[], object]) -> OSError:
    """Checks that `call` (an HTTPS request through urllib) fails as a refused handshake does (one of
    HANDSHAKE_FAILURES, unwrapped from urllib's URLError); an HTTP answer fails the check, though urllib's
    HTTPError is an OSError too (a 401 or a 503 is a server that completed the handshake). Returns the failure."""
    failure: object
    try:
        call()
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"an HTTP answer ({exc.code}), not a refused handshake") from exc
    except urllib.error.URLError as exc:
        failure = exc.reason
    except OSError as exc:
        failure = exc
    else:
        raise AssertionError("the request succeeded: the handshake was not refused")
    assert isinstance(failure, HANDSHAKE_FAILURES), f"{failure!r} is not a TLS or connection failure"
    return failure
