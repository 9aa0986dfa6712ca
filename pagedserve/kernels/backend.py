"""The explicit choice between the Triton kernels and their torch references.

The executor asks for one backend once (`get_backend("triton")` on CUDA; on the CPU `get_backend("cpu")`,
the torch references with attention and the per-token layer ops in C, where a C compiler builds
them, else `get_backend("torch")`) and calls it for every layer. There is no silent fallback: asking for a
backend where it cannot run raises at once, with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ._triton import TRITON_AVAILABLE
from .block_copy import copy_blocks, copy_blocks_ref
from .cache_write import cache_write, cache_write_ref
from .cpu_layer_ops import add_rms_norm_cpu, cache_write_cpu, rms_norm_cpu, rotary_cpu, silu_and_mul_cpu
from .cpu_native import cpu_unavailable_reason, paged_decode_attention_cpu, paged_prefill_attention_cpu
from .layer_ops import add_rms_norm_ref, rms_norm_ref, rotary_ref, silu_and_mul_ref
from .linear_ops import (
    PACKED_LINEAR_AVAILABLE,
    PackedWeight,
    linear_packed,
    linear_ref,
    linear_silu_and_mul_packed,
)
from .logits_ops import first_max_and_log_sum_cpu, first_max_and_log_sum_ref
from .paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from .paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

BackendName = Literal["triton", "cpu", "torch"]


class DecodeAttentionFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        scale: float,
        *,
        max_seq_len: int | None = None,
    ) -> torch.Tensor: ...  # [num_seqs, num_heads, head_dim]


class PrefillAttentionFn(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        scale: float,
        *,
        max_query_len: int | None = None,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


class CacheWriteFn(Protocol):
    def __call__(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None: ...


class CopyBlocksFn(Protocol):
    def __call__(self, caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None: ...


class RmsNormFn(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


class AddRmsNormFn(Protocol):  # x += delta in place (the residual stream), then rms_norm(x)
    def __call__(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


class RotaryFn(Protocol):
    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...


class SiluAndMulFn(Protocol):
    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class LinearFn(Protocol):  # x [..., in] @ weight [out, in].T + bias; `packed` is the backend's copy, if it keeps one
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight,
                 out: torch.Tensor | None = None) -> torch.Tensor: ...  # the result: in `out` where it can be


class LinearSiluAndMulFn(Protocol):  # silu(x @ gate.T) * (x @ up.T), the weight [2 x intermediate, in] gate first
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight) -> torch.Tensor: ...


class FirstMaxAndLogSumFn(Protocol):  # logits [rows, vocab] -> first argmax, max, log(sum(exp(x - max)))
    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class KernelBackend:
    """The paged-cache ops and the per-token layer ops the model calls; shapes as in each op's module."""

    name: BackendName
    decode_attention: DecodeAttentionFn
    prefill_attention: PrefillAttentionFn
    cache_write: CacheWriteFn
    copy_blocks: CopyBlocksFn
    rms_norm: RmsNormFn = rms_norm_ref
    add_rms_norm: AddRmsNormFn = add_rms_norm_ref
    rotary: RotaryFn = rotary_ref
    silu_and_mul: SiluAndMulFn = silu_and_mul_ref
    first_max_and_log_sum: FirstMaxAndLogSumFn = first_max_and_log_sum_ref  # sampling's, on the logits
    linear: LinearFn = linear_ref  # every linear layer's and the LM head's
    # an MLP's gate/up layer and its activation in one op; None: `linear`, then `silu_and_mul`
    linear_silu_and_mul: LinearSiluAndMulFn | None = None


TRITON_BACKEND = KernelBackend(
    name="triton",
    decode_attention=paged_decode_attention,
    prefill_attention=paged_prefill_attention,
    cache_write=cache_write,
    copy_blocks=copy_blocks,
)
TORCH_BACKEND = KernelBackend(
    name="torch",
    decode_attention=paged_decode_attention_ref,
    prefill_attention=paged_prefill_attention_ref,
    cache_write=cache_write_ref,
    copy_blocks=copy_blocks_ref,
)

# the torch references, but attention, the cache write and the per-token layer ops in C, and the linear layers
# through cpu_gemm.c (fp32, the gate/up layer with SiLU * up fused) or oneDNN (bf16) with packed weights (torch
# builds without oneDNN keep F.linear)
CPU_BACKEND = dataclasses.replace(
    TORCH_BACKEND, name="cpu", decode_attention=paged_decode_attention_cpu,
    prefill_attention=paged_prefill_attention_cpu, cache_write=cache_write_cpu,
    rms_norm=rms_norm_cpu, add_rms_norm=add_rms_norm_cpu, rotary=rotary_cpu, silu_and_mul=silu_and_mul_cpu,
    first_max_and_log_sum=first_max_and_log_sum_cpu, linear=linear_packed if PACKED_LINEAR_AVAILABLE else linear_ref,
    linear_silu_and_mul=linear_silu_and_mul_packed if PACKED_LINEAR_AVAILABLE else None,
)


def triton_unavailable_reason() -> str | None:
    """Why the Triton backend cannot run here, or None when it can (a CUDA GPU, or the interpreter)."""
    if not TRITON_AVAILABLE:
        return "the triton package is not installed"
    from ._triton import triton

    if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
        return "no CUDA GPU is visible (set TRITON_INTERPRET=1 only to test kernels on the CPU)"
    return None


def get_backend(name: BackendName) -> KernelBackend:
    """The backend called `name`; raises RuntimeError when "triton" or "cpu" cannot run on this machine."""
    if name == "torch":
        return TORCH_BACKEND
    if name == "cpu":
        reason = cpu_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"kernel backend 'cpu' is unavailable: {reason}; use get_backend('torch')")
        return CPU_BACKEND
    if name == "triton":
        reason = triton_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"kernel backend 'triton' is unavailable: {reason}; use get_backend('torch')")
        return TRITON_BACKEND
    raise ValueError(f"unknown kernel backend {name!r}: expected 'triton', 'cpu' or 'torch'")
