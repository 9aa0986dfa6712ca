"""The CPU backend's per-token layer ops in C (`cpu_layer_ops.c`): checked here, then one pass each.

Each takes and gives what its torch reference in layer_ops.py does (CPU tensors), with results within a few ulp
of it; the cache write matches `cache_write_ref` bit for bit, into an fp32 cache or a bf16 one (rounded as torch
rounds). Per step at 64 sequences of SmolLM2-135M (docs/performance.md) they replace ~20 torch ops a layer.

A bf16 model's tensors go to the bf16 kernels (loaded as bf16, computed in fp32, each result rounded once), the
norms and SiLU * up; its rotary embedding and cache write are torch's here (a prefill's: a step of decodes does
both inside `decode_attention_layer_bf16`, cpu_decode.py).
"""

from __future__ import annotations

import torch

from .cache_write import cache_write_ref, check_cache_write_inputs
from .cpu_native import check_cpu_activations, check_cpu_caches, check_fp32_cpu, native_library
from .layer_ops import rotary_ref


def _rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if everything but its first dimension is contiguous (rows any distance apart), else a copy.
    (Strides compared directly: a view to ask would cost as much as the check, on every call of every layer.)"""
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return tensor.contiguous()
        expected *= size
    return tensor


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[num_tokens, hidden] -> [num_tokens, hidden]: rms_norm_ref in one pass (fp32, or bf16 computed in fp32)."""
    dtype = check_cpu_activations(x=x, weight=weight)
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [num_tokens, hidden] and weight [hidden], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    x, weight = _rows_contiguous(x), weight.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    library = native_library()
    norm = library.rms_norm_f32 if dtype == torch.float32 else library.rms_norm_bf16
    norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
         torch.get_num_threads())
    return out


def add_rms_norm_cpu(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """add_rms_norm_ref in one call: x += delta (x contiguous, changed in place; a bf16 sum rounded), then
    rms_norm_cpu(x)."""
    dtype = check_cpu_activations(x=x, delta=delta, weight=weight)
    if x.dim() != 2 or delta.shape != x.shape or weight.shape != (x.shape[1],) or not x.is_contiguous():
        raise ValueError(f"x must be [num_tokens, hidden] and contiguous, delta the same shape and weight [hidden],"
                         f" got {tuple(x.shape)}, {tuple(delta.shape)}, {tuple(weight.shape)}")
    delta, weight = _rows_contiguous(delta), weight.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    library = native_library()
    norm = library.add_rms_norm_f32 if dtype == torch.float32 else library.add_rms_norm_bf16
    norm(x.data_ptr(), delta.data_ptr(), delta.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
         eps, torch.get_num_threads())
    return out


def rotary_cpu(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[num_tokens, heads, head_dim] -> the same, contiguous: rotary_ref in one pass (fp32; bf16: rotary_ref)."""
    cos, sin = rope
    if x.dtype == torch.bfloat16:
        return rotary_ref(x, rope)
    check_fp32_cpu(x=x, cos=cos, sin=sin)
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    if head_dim % 2 or cos.shape != (num_tokens, 1, half) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{num_tokens}, 1, {half}] for x {tuple(x.shape)}, got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    x, cos, sin = _rows_contiguous(x), cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape)
    native_library().rotary_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                                num_tokens, num_heads, head_dim, torch.get_num_threads())
    return out


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * intermediate] -> [num_tokens, intermediate]: silu_and_mul_ref in one pass (a new
    tensor; `gate_up` is left as it was), fp32 or bf16 (computed in fp32)."""
    dtype = check_cpu_activations(gate_up=gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [num_tokens, 2 * intermediate], got {tuple(gate_up.shape)}")
    gate_up = _rows_contiguous(gate_up)
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=dtype)
    library = native_library()
    silu_and_mul = library.silu_and_mul_f32 if dtype == torch.float32 else library.silu_and_mul_bf16
    silu_and_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.shape[0], out.shape[1],
                 torch.get_num_threads())
    return out


def cache_write_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 or bf16, contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] the same
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative: padding, skipped
) -> None:
    """cache_write_ref as plain row copies (rounded into a bf16 cache); a slot past the cache raises before
    anything is written. A bf16 model's keys and values: cache_write_ref itself."""
    check_cache_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    if key.dtype == torch.bfloat16 and value.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16:
        cache_write_ref(key, value, k_cache, v_cache, slot_mapping)
        return
    check_fp32_cpu(key=key, value=value)
    _, kv_bf16 = check_cpu_caches(k_cache, v_cache)
    key, value, slots = _rows_contiguous(key), _rows_contiguous(value), slot_mapping.contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    status = native_library().cache_write_f32(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        kv_bf16, slots.data_ptr(), key.shape[0], key.shape[1] * key.shape[2], num_slots)
    if status:
        raise ValueError(f"slot_mapping names a slot past the cache's {num_slots}")
