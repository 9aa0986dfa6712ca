"""Whole-block copies inside the device caches (copy-on-write) and swaps to and from a CPU block pool.

Layouts:
    caches         a list of tensors [num_blocks, block_size, num_kv_heads, head_dim], all of one shape,
                   dtype and device and contiguous: typically [k_cache_0, v_cache_0, k_cache_1, ...]
    block_mapping  [num_pairs, 2] int64, rows (src_block_id, dst_block_id)

`copy_blocks` applies every pair to every cache in one launch: the kernel reads the caches' base
addresses from a pointer table (as in the Triton grouped-GEMM tutorial) instead of launching once per
layer. A dst block must not also be a src block of the same batch; the block manager never emits that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._triton import tl, triton

COPY_BLOCK = 1024  # elements per program
_SAME_WIDTH_INT = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}  # a copy only moves bits


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr: tl.tensor,  # [num_caches] int64 base addresses
    block_mapping_ptr: tl.tensor,  # [num_pairs, 2] int64
    block_numel: tl.tensor,  # elements per block (block_size * num_kv_heads * head_dim)
    ELEMENT_TYPE: tl.constexpr,  # an integer type as wide as the cache dtype
    COPY_BLOCK: tl.constexpr,
) -> None:
    pair = tl.program_id(0).to(tl.int64)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    base = tl.load(cache_ptrs_ptr + cache).to(tl.pointer_type(ELEMENT_TYPE))
    src = tl.load(block_mapping_ptr + 2 * pair)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)
    offs = chunk * COPY_BLOCK + tl.arange(0, COPY_BLOCK)
    mask = offs < block_numel
    data = tl.load(base + src * block_numel + offs, mask=mask)
    tl.store(base + dst * block_numel + offs, data, mask=mask)


def _check_copy_inputs(caches: Sequence[torch.Tensor], block_mapping: torch.Tensor) -> None:
    assert len(caches) > 0, "no caches given"
    first = caches[0]
    for cache in caches:
        assert cache.shape == first.shape, f"cache shapes differ: {tuple(cache.shape)} vs {tuple(first.shape)}"
        assert cache.dtype == first.dtype and cache.device == first.device, "caches differ in dtype or device"
        assert cache.is_contiguous(), "caches must be contiguous (blocks are copied as flat ranges)"
    assert block_mapping.dtype == torch.int64, f"block_mapping must be int64, got {block_mapping.dtype}"
    assert block_mapping.dim() == 2 and block_mapping.shape[1] == 2, (
        f"block_mapping must be [num_pairs, 2], got {tuple(block_mapping.shape)}"
    )
    assert block_mapping.is_contiguous(), "block_mapping must be contiguous"


def copy_blocks(
    caches: Sequence[torch.Tensor],  # each [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst), on the caches' device
) -> None:
    """Copy block src to block dst in every cache, in place, in one kernel launch."""
    _check_copy_inputs(caches, block_mapping)
    assert block_mapping.device == caches[0].device, "block_mapping must be on the caches' device"
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    block_numel = caches[0][0].numel()
    cache_ptrs = torch.tensor([cache.data_ptr() for cache in caches], dtype=torch.int64, device=caches[0].device)
    element_type = getattr(tl, _SAME_WIDTH_INT[caches[0].element_size()])
    assert len(caches) < 2**16, "too many caches for one launch (grid axis 1 is capped at 65535)"
    grid = (num_pairs, len(caches), triton.cdiv(block_numel, COPY_BLOCK))
    _copy_blocks_kernel[grid](
        cache_ptrs, block_mapping, block_numel, ELEMENT_TYPE=element_type, COPY_BLOCK=COPY_BLOCK, num_warps=4
    )


def copy_blocks_ref(
    caches: Sequence[torch.Tensor],  # each [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Torch reference and CPU path: one gather-scatter per cache."""
    _check_copy_inputs(caches, block_mapping)
    mapping = block_mapping.to(caches[0].device)
    src, dst = mapping[:, 0], mapping[:, 1]
    for cache in caches:
        cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks(
    src_cache: torch.Tensor,  # [num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [num_dst_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src_block_id, dst_block_id)
) -> None:
    """Copy blocks between two caches that may sit on different devices (swap out: GPU to CPU pool,
    swap in: CPU pool to GPU), in place. Call it once per layer and per K/V cache."""
    assert src_cache.shape[1:] == dst_cache.shape[1:], (
        f"block shapes differ: {tuple(src_cache.shape[1:])} vs {tuple(dst_cache.shape[1:])}"
    )
    assert src_cache.dtype == dst_cache.dtype, f"dtypes differ: {src_cache.dtype} vs {dst_cache.dtype}"
    assert block_mapping.dtype == torch.int64 and block_mapping.dim() == 2 and block_mapping.shape[1] == 2, (
        f"block_mapping must be [num_pairs, 2] int64, got {tuple(block_mapping.shape)} {block_mapping.dtype}"
    )
    if block_mapping.shape[0] == 0:
        return
    src = block_mapping[:, 0].to(src_cache.device)
    dst = block_mapping[:, 1].to(dst_cache.device)
    blocks = src_cache.index_select(0, src)  # [num_pairs, block_size, num_kv_heads, head_dim]
    dst_cache.index_copy_(0, dst, blocks.to(dst_cache.device))
