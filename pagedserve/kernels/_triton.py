"""Triton when it is installed, otherwise a placeholder that keeps the op files importable.

Each op file holds its Triton kernel next to its torch reference, and the reference is the CPU serving
path, so it must import on machines without Triton (macOS, minimal CPU images). The placeholder's `jit`
returns the function undecorated and `tl.constexpr` and `tl.tensor` exist for the annotations; nothing else is needed
at import time. Launchers are reached only through `get_backend("triton")`, which refuses to hand them
out when `TRITON_AVAILABLE` is false, so a placeholder kernel is never launched.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised by a subprocess test that hides triton
    TRITON_AVAILABLE = False

    def _jit_placeholder(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    triton = types.SimpleNamespace(jit=_jit_placeholder)
    tl = types.SimpleNamespace(constexpr=object, tensor=object)

__all__ = ["TRITON_AVAILABLE", "tl", "triton"]
