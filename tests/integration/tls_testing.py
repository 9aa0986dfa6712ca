"""Certificates for TLS tests, made with the `openssl` command: a CA, a server certificate for localhost and
127.0.0.1, a client certificate signed by the CA, and a client certificate signed by no one we trust."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc

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
