"""`pagedserve health ADDRESS`: one gRPC health check, exit 0 when SERVING (the pods' exec probes).

Kubernetes 1.20 has no gRPC probe, and the sidecars listen on unix sockets, so the kubelet runs this. With
`--tls-ca` it checks over TLS (a kubelet's gRPC probe cannot): the router's probe where it serves TLS.
It imports grpc alone, so a probe costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .tls import channel_credentials


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="unix:PATH or HOST:PORT")
    parser.add_argument("--service", default="", help="the service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    parser.add_argument("--tls-ca", metavar="PEM", help="check over TLS, verifying the server with this CA")
    parser.add_argument("--server-name", default="",
                        help="with --tls-ca: the name the certificate must carry (default: ADDRESS's host)")
    parser.add_argument("--tls-cert", metavar="PEM", help="mutual TLS: the client certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="mutual TLS: its private key")


def check(address: str, service: str = "", timeout: float = 3.0, tls: TlsOptions | None = None) -> str:
    """The server's health status name, or UNREACHABLE: CODE."""
    with _channel(address, tls) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return f"UNREACHABLE: {exc.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


@dataclass(frozen=True)
class TlsOptions:
    ca: str
    server_name: str = ""
    cert: str | None = None
    key: str | None = None


def _channel(address: str, tls: TlsOptions | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(address, channel_credentials(tls.ca, tls.cert, tls.key), options=options)


def main(args: argparse.Namespace) -> None:
    if not args.tls_ca and (args.server_name or args.tls_cert or args.tls_key):
        sys.exit("--server-name, --tls-cert and --tls-key need --tls-ca (they are TLS's)")
    tls = TlsOptions(args.tls_ca, args.server_name, args.tls_cert, args.tls_key) if args.tls_ca else None
    try:
        status = check(args.address, args.service, args.timeout, tls)
    except ValueError as exc:  # TlsConfigError: a missing or non-PEM file, named
        sys.exit(str(exc))
    print(f"{args.address}: {status}")
    sys.exit(0 if status == "SERVING" else 1)
