"""`pagedserve health` over TLS, the router's readiness probe where it serves TLS (a kubelet's gRPC probe speaks
none): it verifies the server against the CA and the certificate's name, presents its own certificate under mutual
TLS, and reports a handshake it cannot complete as a failed check. The server is a real gRPC health server in its own
process, serving mutual TLS with the test CA's certificate (names: localhost, 127.0.0.1)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import free_port
from tls_testing import Certs, make_certs

SERVER = """
import sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
ca, cert, key, port = sys.argv[1:]
server = grpc.server(futures.ThreadPoolExecutor(2))
servicer = health.HealthServicer()
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
read = lambda p: open(p, "rb").read()
server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials(
    [(read(key), read(cert))], root_certificates=read(ca), require_client_auth=True))
server.start()
print("serving", flush=True)
server.wait_for_termination()
"""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def address(certs: Certs) -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(certs.ca), str(certs.server_cert),
                               str(certs.server_key), str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "serving"
        yield f"127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def health(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedserve", "health", *map(str, args), "--timeout", "5"],
                          capture_output=True, text=True, timeout=60)


def test_the_probe_checks_over_mutual_tls_against_the_certificate_name(certs: Certs, address: str) -> None:
    mine = ("--tls-cert", certs.client_cert, "--tls-key", certs.client_key)
    # the address is 0.0.0.0-like in a pod; the name checked is the one the certificate carries
    ok = health(address, "--tls-ca", certs.ca, "--server-name", "localhost", *mine)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("SERVING"), ok


def test_a_handshake_the_probe_cannot_complete_fails_the_check(certs: Certs, address: str) -> None:
    mine = ("--tls-cert", certs.client_cert, "--tls-key", certs.client_key)
    for args in ((address, "--tls-ca", certs.ca, "--server-name", "localhost"),  # no client certificate
                 (address, "--tls-ca", certs.ca, "--server-name", "elsewhere.example", *mine),  # a name not in it
                 (address, "--tls-ca", certs.stranger_cert, "--server-name", "localhost", *mine),  # another CA
                 (address,)):  # plaintext to a TLS server
        failed = health(*args)
        assert failed.returncode == 1 and "UNREACHABLE: UNAVAILABLE" in failed.stdout, (args, failed)


def test_tls_flags_without_a_ca_and_unreadable_files_are_named(certs: Certs, tmp_path: Path) -> None:
    lone = health("127.0.0.1:1", "--server-name", "localhost")
    assert lone.returncode == 1 and "need --tls-ca" in lone.stderr
    missing = health("127.0.0.1:1", "--tls-ca", tmp_path / "absent.pem")
    assert missing.returncode == 1 and "--tls-ca" in missing.stderr and "cannot read it" in missing.stderr
