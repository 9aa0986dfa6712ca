"""Shared test helpers: start real pagedserve processes and wait until their health check says SERVING."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def wait_serving(address: str, timeout: float, proc: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode} before serving")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout}s")


@contextmanager
def pagedserve_process(*args: str, timeout: float = 60.0) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Runs `pagedserve ARGS --listen 127.0.0.1:0`, yields (process, address), stops it with SIGTERM."""
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", *args, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        assert proc.stdout is not None
        port = None
        deadline = time.monotonic() + timeout
        lines = []
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"pagedserve {args} exited early:\n{''.join(lines)}")
            lines.append(line)
            match = re.search(r"listening on .* \(port (\d+)\)", line)
            if match:
                port = int(match.group(1))
        assert port, f"no listening line within {timeout}s:\n{''.join(lines)}"
        address = f"127.0.0.1:{port}"
        wait_serving(address, timeout, proc)
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout:
            proc.stdout.close()
