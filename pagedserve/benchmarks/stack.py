"""`pagedserve serve` started for a benchmark (bench serve, offline --serve, soak): on a free loopback port,
with the benchmark's engine flags, waited for until SERVING, its output to the benchmark's log."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from typing import Any

from ..services.common.processes import ServiceProcess, stop_service, wait_serving


def free_port() -> int:
    """A loopback port free now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_stack(args: argparse.Namespace, log: Any, http_port: int = 0) -> ServiceProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--model", args.model, "--port", str(port), "--device",
           getattr(args, "device", "cpu"), "--status-interval", "5",
           "--max-streams-per-tenant", "1000000",  # one client sends the whole load: not what is measured
           "--http-port", str(http_port)]
    for flag in ("kv_cache_mib", "max_num_seqs", "max_num_batched_tokens", "preemption_mode", "block_size",
                 "threads", "ttft_slo_ms", "tpot_slo_ms"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if getattr(args, "reserve_growth", None) is False:
        cmd.append("--no-reserve-growth")
    for flag in ("dtype", "kv_cache_dtype"):  # bench offline's; the other benchmarks keep the defaults
        if getattr(args, flag, None) is not None:
            cmd += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stack = ServiceProcess(proc, f"127.0.0.1:{port}")
    try:
        wait_serving(stack.address, 900, proc)
    except BaseException:
        stop_service(stack, grace=60)
        raise
    return stack
