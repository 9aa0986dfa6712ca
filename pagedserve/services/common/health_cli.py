"""`pagedserve health ADDRESS`: one gRPC health check, exit 0 when SERVING (the pods' exec probes).

Kubernetes 1.20 has no gRPC probe, and the sidecars listen on unix sockets, so the kubelet runs this.
It imports grpc alone, so a probe costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="unix:PATH or HOST:PORT")
    parser.add_argument("--service", default="", help="the service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")


def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The server's health status name, or UNREACHABLE: CODE."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return f"UNREACHABLE: {exc.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(args: argparse.Namespace) -> None:
    status = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {status}")
    sys.exit(0 if status == "SERVING" else 1)
