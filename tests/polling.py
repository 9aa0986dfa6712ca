"""Waiting in tests: poll a condition until it holds, and pick a free loopback port. Shared by the stack,
tracing and Kubernetes tests (tests/ is on sys.path through tests/conftest.py)."""

from __future__ import annotations

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
