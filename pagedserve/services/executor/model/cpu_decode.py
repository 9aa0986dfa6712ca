"""A step of decodes on the `cpu` kernel backend, with the per-layer glue taken out of the forward pass.

Each of a layer's four GEMMs streams megabytes of weights, and the op after it finds Python's and torch's
code and data out of cache: on a 2-core AVX2 machine a 64-row RMSNorm through its checked wrapper cost ~190
us after a GEMM, against ~11 us for its C kernel called with raw pointers while warm (docs/performance.md).
So for a step of decodes only, over a paged cache, this forward checks its inputs and allocates its buffers
once per step, not once per layer, and calls each C kernel with raw pointers: a layer is four GEMMs and
four C calls (the residual add with its norm, twice; rotary, cache write and attention in one; SiLU * up, which
the gate/up GEMM does itself where its weight is packed for it: every fp32 model whose intermediate size fits).
The kernels, their order and their arithmetic are those of `LlamaForCausalLM.forward` on the cpu backend,
so the hidden states are equal bit for bit (tests/executor/test_cpu_decode.py).

A bf16 model's step runs the bf16 kernels (cpu_layer_ops.c: bf16 loaded, fp32 arithmetic, bf16 stored) on its
bf16 residual stream, GEMM inputs and cache, with the rotated queries and the attention in fp32 between; its
prefills run the model's forward, whose rotary embedding is torch's in bf16, so its decodes are not that forward's
bit for bit (tests/executor/test_bf16_cpu.py bounds them against transformers in bf16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from ....kernels import KernelBackend
from ....kernels._common import check_block_tables
from ....kernels.backend import CPU_BACKEND
from ....kernels.cpu_native import check_cpu_caches, check_status, native_library
from ....kernels.linear_ops import linear_packed, linear_silu_and_mul_packed
from ..attention import AttentionMetadata

if TYPE_CHECKING:
    from .llama import DecoderLayer, KVCache, LlamaForCausalLM, Metadata


def applies(backend: KernelBackend, meta: Metadata, kv_caches: list[KVCache], x: torch.Tensor) -> bool:
    """Whether this forward can run the step: the cpu backend exactly as built (not one with ops replaced, such
    as the benchmark's timers), fp32 or bf16, a paged cache, and decodes only."""
    return (backend == CPU_BACKEND and isinstance(meta, AttentionMetadata) and meta.num_prefill_tokens == 0
            and meta.decode_gather is None and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"
            and bool(kv_caches) and isinstance(kv_caches[0], tuple))


def decode_forward(
    model: LlamaForCausalLM,
    x: torch.Tensor,  # [num_seqs, hidden]: the embedded tokens, the residual stream (added to in place)
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [num_seqs, 1, head_dim // 2]
    meta: AttentionMetadata,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:  # [num_seqs, hidden], after the final norm
    config, lib, threads = model.config, native_library(), torch.get_num_threads()
    layers = cast("list[DecoderLayer]", list(model.layers))
    n, hidden = x.shape
    if not x.is_contiguous():
        raise ValueError("the residual stream must be contiguous: the norms add to it in place")
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    cos, sin = (t.float().contiguous() for t in rope)  # a bf16 model's tables widened: the kernels rotate in fp32
    slots, tables, lens = meta.slot_mapping.contiguous(), meta.decode_block_tables.contiguous(), meta.decode_seq_lens
    check_block_tables(tables, lens, n)
    if cos.shape != (n, 1, head_dim // 2) or slots.shape != (n,) or slots.dtype != torch.int64:
        raise ValueError(f"rope tables {tuple(cos.shape)} and slots {tuple(slots.shape)} do not fit {n} decodes")
    kv_bf16 = _cache_dtype(kv_caches, kv_heads, head_dim, x.dtype)
    num_blocks, block_size = kv_caches[0][0].shape[:2]
    bf16 = x.dtype == torch.bfloat16
    # one buffer per kind, reused by every layer: each is read by the GEMM or kernel right after it is written
    normed = torch.empty(n, hidden, dtype=x.dtype)
    qk = torch.empty(n, heads + kv_heads, head_dim)  # fp32: the rotated q and k
    attended = torch.empty(n, heads * head_dim)  # fp32: the attention's output, the o_proj's input in fp32
    attended_in = torch.empty(n, heads * head_dim, dtype=x.dtype) if bf16 else attended  # the o_proj's input
    activated = torch.empty(n, config.intermediate_size, dtype=x.dtype)
    x_ptr, normed_ptr, activated_ptr = (t.data_ptr() for t in (x, normed, activated))
    rope_args = (cos.data_ptr(), sin.data_ptr(), qk.data_ptr())
    batch_args = (slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), attended.data_ptr(),
                  *((attended_in.data_ptr(),) if bf16 else ()), n, heads, kv_heads, head_dim,
                  layers[0].self_attn.scale, threads)
    cache_args = (num_blocks, block_size) if bf16 else (kv_bf16, num_blocks, block_size)
    matmul, gated_matmul = _matmul(model.backend), _gated_matmul(model.backend)
    rms_norm, add_rms_norm, decode_attention, silu_and_mul = (
        (lib.rms_norm_bf16, lib.add_rms_norm_bf16, lib.decode_attention_layer_bf16, lib.silu_and_mul_bf16) if bf16
        else (lib.rms_norm_f32, lib.add_rms_norm_f32, lib.decode_attention_layer_f32, lib.silu_and_mul_f32))
    qkv_width, inter = config.q_size + 2 * config.kv_size, config.intermediate_size  # the GEMMs' outputs: contiguous
    delta: torch.Tensor | None = None
    for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        attention, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        if delta is None:
            rms_norm(x_ptr, hidden, norm.weight.data_ptr(), normed_ptr, n, hidden, norm.eps, threads)
        else:
            add_rms_norm(x_ptr, delta.data_ptr(), hidden, norm.weight.data_ptr(), normed_ptr, n, hidden, norm.eps,
                         threads)
        qkv = matmul(normed, attention.qkv_proj)
        check_status(decode_attention(qkv.data_ptr(), qkv_width, *rope_args, k_cache.data_ptr(), v_cache.data_ptr(),
                                      *cache_args, *batch_args))
        out = matmul(attended_in, attention.o_proj)
        norm = layer.post_attention_layernorm
        add_rms_norm(x_ptr, out.data_ptr(), hidden, norm.weight.data_ptr(), normed_ptr, n, hidden, norm.eps, threads)
        fused = gated_matmul(normed, mlp.gate_up_proj)  # SiLU * up in the gate/up matmul, where it packs so
        if fused is None:
            gate_up = matmul(normed, mlp.gate_up_proj)
            silu_and_mul(gate_up.data_ptr(), 2 * inter, activated_ptr, n, inter, threads)
        delta = matmul(activated if fused is None else fused, mlp.down_proj)
    assert delta is not None, "a model without layers"
    return model.norm(x, delta)


def _cache_dtype(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> int:
    """The caches' `kv_bf16` argument, once every layer's is checked: the model's heads, one dtype for all, and
    bf16 under a bf16 model (the bf16 kernels write bf16 caches only)."""
    kv_dtypes = set()
    for k_cache, v_cache in kv_caches:
        cache, kv_bf16 = check_cpu_caches(k_cache, v_cache)
        kv_dtypes.add(kv_bf16)
        if (cache.num_kv_heads, cache.head_dim) != (kv_heads, head_dim):
            raise ValueError(f"a layer's cache {tuple(k_cache.shape)} does not hold the model's {kv_heads} KV heads "
                             f"of {head_dim}")
    if len(kv_dtypes) != 1:
        raise ValueError("the layers' caches must all have one dtype")
    (kv_bf16,) = kv_dtypes
    if dtype == torch.bfloat16 and not kv_bf16:
        raise ValueError("a bf16 model's decode step needs bf16 caches")
    return kv_bf16


def _gated_matmul(backend: KernelBackend) -> Any:
    """The gate/up matmul with SiLU * up fused (a function returning None where the layer is not packed for it, as
    is every layer where the backend has no such op): `LlamaForCausalLM.forward`'s arithmetic either way."""
    if backend.linear_silu_and_mul is linear_silu_and_mul_packed:
        return lambda x, linear: linear.packed.silu_and_mul(x, linear.weight)
    return lambda x, linear: None


def _matmul(backend: KernelBackend) -> Any:
    """The backend's matmul without its per-call checks (the shapes are the model's own, fixed above): over the
    packed weight (the plain one may be released), or F.linear."""
    if backend.linear is linear_packed:
        return lambda x, linear: linear.packed.matmul(x, linear.weight, linear.bias)
    return lambda x, linear: F.linear(x, linear.weight, linear.bias)
