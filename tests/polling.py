"""Waiting in tests: poll a condition until it holds, and pick a free loopback port. Shared by the stack,
tracing and Kubernetes tests (tests/ is on sys.path through tests/conftest.py)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from typing import Any


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30.0, poll_s: float = 0.1) -> Any:
    """Polls `condition()` until it is truthy and returns its value; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"never happened within {timeout:.0f} s: {what}"
        time.sleep(poll_s)
    return value


PORTS = range(10_000, 20_000)  # below Linux's ephemeral range (32768-60999 by default)
_port_choice = random.Random()  # its own: a test that seeds `random` must not make every pick the same


def free_port() -> int:
    """A loopback port free now, to give a server that binds it later. Not one the kernel hands out: a port from
    the ephemeral range (bind to port 0) can be taken meanwhile by any process's outgoing connection or its
    listener on port 0, and the server then fails with "Address already in use"."""
    while True:
        port = _port_choice.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
