"""Start pagedserve services as real processes for benchmarks, and stop them by their PID."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@contextmanager
def spawn_service(args: Sequence[str], timeout: float = 120.0) -> Iterator[str]:
    """Runs `pagedserve ARGS --listen 127.0.0.1:0` until SERVING and yields its address."""
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", *args, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        address = _await_listening(proc, timeout)
        _await_serving(address, timeout)
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _await_listening(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode} before listening")
        match = re.search(r"listening on .* \(port (\d+)\)", line)
        if match:
            return f"127.0.0.1:{match.group(1)}"
    raise TimeoutError("service did not report its port")


def _await_serving(address: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout}s")
