"""Scatter the step's new keys and values into a layer's paged KV cache.

Layouts:
    key, value    [num_tokens, num_kv_heads, head_dim]                 head_dim contiguous
    k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]     head_dim contiguous
    slot_mapping  [num_tokens] int64   slot = block_id * block_size + offset; negative = padding, skipped
"""

from __future__ import annotations

import torch

from ._common import check_kv_cache
from ._triton import tl, triton


@triton.jit
def _cache_write_kernel(
    key_ptr: tl.tensor,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    value_ptr: tl.tensor,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    k_cache_ptr: tl.tensor,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache_ptr: tl.tensor,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    slot_mapping_ptr: tl.tensor,  # [num_tokens] int64
    stride_key_tok: tl.tensor,
    stride_key_head: tl.tensor,
    stride_value_tok: tl.tensor,
    stride_value_head: tl.tensor,
    stride_k_block: tl.tensor,
    stride_k_slot: tl.tensor,
    stride_k_head: tl.tensor,
    stride_v_block: tl.tensor,
    stride_v_slot: tl.tensor,
    stride_v_head: tl.tensor,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
) -> None:
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]

    key_offs = token * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :]
    k_offs = block_id * stride_k_block + offset * stride_k_slot + offs_h[:, None] * stride_k_head + offs_d[None, :]
    tl.store(k_cache_ptr + k_offs, tl.load(key_ptr + key_offs, mask=mask), mask=mask)

    value_offs = token * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :]
    v_offs = block_id * stride_v_block + offset * stride_v_slot + offs_h[:, None] * stride_v_head + offs_d[None, :]
    tl.store(v_cache_ptr + v_offs, tl.load(value_ptr + value_offs, mask=mask), mask=mask)


def check_cache_write_inputs(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    cache = check_kv_cache(k_cache, v_cache)
    assert key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)}"
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert key.shape[1:] == (cache.num_kv_heads, cache.head_dim), (
        f"key heads/dim {tuple(key.shape[1:])} != cache {(cache.num_kv_heads, cache.head_dim)}"
    )
    assert key.dtype == value.dtype, f"key {key.dtype} != value {value.dtype}"  # the cache may be narrower
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "key and value must be contiguous along head_dim"
    assert slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"
    assert slot_mapping.shape == (key.shape[0],), f"slot_mapping must be [{key.shape[0]}], got {slot_mapping.shape}"
    assert key.device == value.device == k_cache.device == slot_mapping.device, "tensors on different devices"


def cache_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write token t's key and value to slot `slot_mapping[t]` of the caches, in place."""
    check_cache_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _cache_write_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )  # fmt: skip


def cache_write_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Torch reference and CPU path: one indexed copy per cache (any strides; contiguous caches are faster),
    rounded to the cache's dtype where it is narrower than the keys'."""
    check_cache_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    valid = slot_mapping >= 0
    if not bool(valid.all()):  # padding present: drop it (boolean indexing copies, so only when needed)
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    if k_cache.is_contiguous() and v_cache.is_contiguous():  # slots are rows of the flat view: one index_copy_
        k_cache.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value)
        return
    block_size = k_cache.shape[1]
    index = (slot_mapping // block_size, slot_mapping % block_size)
    k_cache.index_put_(index, key)
    v_cache.index_put_(index, value)
