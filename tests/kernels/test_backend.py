"""The explicit backend choice, and importing the package where Triton or a GPU is missing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedserve import kernels


def test_torch_backend_is_the_references() -> None:
    backend = kernels.get_backend("torch")
    assert backend.name == "torch"
    assert backend.decode_attention is kernels.paged_decode_attention_ref
    assert backend.prefill_attention is kernels.paged_prefill_attention_ref
    assert backend.cache_write is kernels.cache_write_ref
    assert backend.copy_blocks is kernels.copy_blocks_ref


def test_triton_backend_is_the_kernels_where_they_can_run() -> None:
    # The conftest provides a GPU or the interpreter, so Triton can run in this process.
    backend = kernels.get_backend("triton")
    assert backend.name == "triton"
    assert backend.decode_attention is kernels.paged_decode_attention
    assert backend.prefill_attention is kernels.paged_prefill_attention
    assert backend.cache_write is kernels.cache_write
    assert backend.copy_blocks is kernels.copy_blocks


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.get_backend("cuda")  # type: ignore[arg-type]


def run_python(code: str, env_overrides: dict[str, str | None]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    for key, value in env_overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


def test_package_imports_and_serves_on_torch_without_triton() -> None:
    code = """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from pagedserve import kernels
        assert not kernels.TRITON_AVAILABLE
        kv = torch.randn(4, 8, 1, 16)
        out = kernels.get_backend("torch").decode_attention(
            torch.randn(1, 2, 16), kv, kv.clone(), torch.tensor([[2, 0]], dtype=torch.int32),
            torch.tensor([9], dtype=torch.int32), 0.25)
        assert out.shape == (1, 2, 16) and torch.isfinite(out).all()
        try:
            kernels.get_backend("triton")
        except RuntimeError as error:
            print(error)
        else:
            raise SystemExit("get_backend('triton') did not raise")
    """
    result = run_python(code, {})
    assert result.returncode == 0, result.stderr
    assert "triton package is not installed" in result.stdout


def test_triton_backend_refused_without_gpu_or_interpreter() -> None:
    code = """
        from pagedserve import kernels
        print(kernels.triton_unavailable_reason())
    """
    result = run_python(code, {"TRITON_INTERPRET": None})
    assert result.returncode == 0, result.stderr
    if torch.cuda.is_available():
        assert result.stdout.strip() == "None"
    else:
        assert "no CUDA GPU" in result.stdout
