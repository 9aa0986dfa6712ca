"""Checks and helpers shared by the launchers and references."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..services.common.kv_geometry import blocks_for

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CacheShape(NamedTuple):
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> CacheShape:
    """Validate a layer's K and V caches: [num_blocks, block_size, num_kv_heads, head_dim] each.

    Any strides are accepted except on head_dim, which must be contiguous (the kernels load whole
    head vectors with unit stride).
    """
    assert k_cache.dim() == 4, f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {k_cache.shape}"
    assert v_cache.shape == k_cache.shape, f"v_cache {v_cache.shape} != k_cache {k_cache.shape}"
    assert v_cache.dtype == k_cache.dtype, f"v_cache {v_cache.dtype} != k_cache {k_cache.dtype}"
    assert v_cache.device == k_cache.device, "k_cache and v_cache live on different devices"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches must be contiguous along head_dim"
    return CacheShape(*k_cache.shape)


def check_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int) -> None:
    assert block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}"
    assert seq_lens.dtype == torch.int32, f"seq_lens must be int32, got {seq_lens.dtype}"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, (
        f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
    )
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert seq_lens.shape == (num_seqs,), f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}"


def sequence_blocks(block_tables: torch.Tensor, seq: int, seq_len: int, block_size: int) -> torch.Tensor:
    """The physical block ids holding sequence `seq`'s first `seq_len` tokens (entries past them unread)."""
    return block_tables[seq, : blocks_for(seq_len, block_size)].long()


def gather_kv(
    cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> torch.Tensor:  # -> [seq_len, num_kv_heads, head_dim]
    """Copy one sequence's keys (or values) out of the paged cache into a contiguous tensor."""
    blocks = cache.index_select(0, block_ids)  # [num_used, block_size, num_kv_heads, head_dim]
    return blocks.flatten(0, 1)[:seq_len]


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs serially)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
