"""Kernel tests run compiled on a GPU and under the Triton interpreter on the CPU.

TRITON_INTERPRET must be set before any `@triton.jit` decorator runs (it picks the interpreter at
decoration time), hence at import of this conftest, before any test module imports the kernels.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

INTERPRETER_UNUSABLE: str | None = None
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules and type(sys.modules["triton"].language.max).__name__ != "InterpretedFunction":
        # Triton's own library functions (tl.max, tl.sum, ...) were decorated for compilation when it was
        # imported, so the interpreter can no longer run any kernel in this process.
        INTERPRETER_UNUSABLE = (
            "triton was imported before tests/kernels/conftest.py could enable its interpreter (a test package "
            "collected earlier imports pagedserve.kernels). Set TRITON_INTERPRET=1 when no CUDA GPU is visible "
            "in tests/conftest.py, before anything imports triton."
        )


@pytest.fixture(autouse=True)
def _usable_triton() -> None:
    if INTERPRETER_UNUSABLE is not None:
        pytest.fail(INTERPRETER_UNUSABLE)


def _patch_interpreter_bf16_dot() -> None:
    """Make the interpreter's `tl.dot` compute bfloat16 operands by value.

    The interpreter stores bfloat16 as raw uint16 bits and its `create_dot` multiplies those bits
    (triton-lang/triton#11584; upstream declines: bf16 arithmetic is unsupported in the interpreter).
    A GPU's bf16 MMA multiplies exactly into fp32, so widening both operands to fp32 here matches it.
    Only the interpreter's emulation changes; the kernels under test are untouched.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(handle: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if handle.dtype != tl.bfloat16:
            return handle
        widened = (handle.data.astype(np.uint32) << 16).view(np.float32)  # bf16 is fp32's top half
        return interpreter.TensorHandle(widened, tl.float32)

    def create_dot(
        self: interpreter.InterpreterBuilder,
        a: interpreter.TensorHandle,
        b: interpreter.TensorHandle,
        d: interpreter.TensorHandle,
        input_precision: object,
        max_num_imprecise_acc: object,
    ) -> interpreter.TensorHandle:
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_bf16_dot()
