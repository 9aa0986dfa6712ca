"""Run pagedserve services as child processes: start, wait until they listen and report SERVING, stop.

Used by `pagedserve serve`, the benchmarks and the integration tests. A child is stopped by its own PID
(SIGTERM, then SIGKILL after a grace period), never by name, and stops by itself once this process is gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .grpc_server import CHANNEL_OPTIONS, PARENT_PID_ENV

LISTENING = re.compile(r"listening on (\S+) \(port (\d+)\)")


@dataclass
class ServiceProcess:
    proc: subprocess.Popen[str]
    address: str
    output: list[str] = field(default_factory=list)  # the lines it printed (stdout and stderr), the latest kept


def start_service(
    args: Sequence[str], listen: str = "127.0.0.1:0", timeout: float = 300.0, until_serving: bool = True,
    echo: str = "",
) -> ServiceProcess:
    """Starts `pagedserve ARGS --listen LISTEN`, waits until it listens (and, by default, is SERVING). With
    `echo`, each line it prints once listening also goes to this process's stderr under that name (a
    supervisor's log holds its children's: their warnings and tracebacks)."""
    # the child stops by itself if this process dies without stopping it (grpc_server.PARENT_PID_ENV)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid())}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", *args, "--listen", listen],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    service = ServiceProcess(proc, "")
    try:
        service.address = await_listening(service, listen, timeout)
        threading.Thread(target=_drain, args=(service, echo), daemon=True).start()
        if until_serving:
            wait_serving(service.address, timeout, proc)
    except BaseException:
        stop_service(service)
        raise
    return service


def stop_service(service: ServiceProcess, grace: float = 15.0) -> int:
    proc = service.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextmanager
def running_service(
    args: Sequence[str], listen: str = "127.0.0.1:0", timeout: float = 300.0
) -> Iterator[ServiceProcess]:
    service = start_service(args, listen, timeout)
    try:
        yield service
    finally:
        stop_service(service)


def wait_serving(
    address: str, timeout: float, proc: subprocess.Popen[str] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Polls the health service (no API key needed) until SERVING; over TLS with `credentials`."""
    deadline = time.monotonic() + timeout
    # reconnecting within 0.1-1 s: a process started before the one it waits for (a pod's containers, `serve`'s
    # frontend) would otherwise notice it up to gRPC's growing backoff late
    channel = (grpc.insecure_channel(address, options=CHANNEL_OPTIONS) if credentials is None
               else grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS))
    with channel:
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


def await_listening(service: ServiceProcess, listen: str, timeout: float) -> str:
    """The address the child printed in its "listening on" line (its output kept until then)."""
    proc = service.proc
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"pagedserve exited with {proc.returncode} before listening:\n{''.join(service.output)}")
        service.output.append(line)
        match = LISTENING.search(line)
        if match:
            return listen if listen.startswith("unix:") else f"127.0.0.1:{match.group(2)}"
    raise TimeoutError(f"no 'listening on' line within {timeout}s:\n{''.join(service.output)}")


KEPT_LINES = 2000  # of a child's output, for the errors that quote it: a long-lived child's log is not kept whole


def _drain(service: ServiceProcess, echo: str) -> None:
    """Keeps reading the child's output so it never blocks on a full pipe (and echoes it)."""
    assert service.proc.stdout is not None
    output = service.output
    for line in service.proc.stdout:
        output.append(line)
        if len(output) > 2 * KEPT_LINES:
            del output[:KEPT_LINES]
        if echo:
            sys.stderr.write(f"{echo} | {line}")
            sys.stderr.flush()
