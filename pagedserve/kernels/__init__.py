"""Paged-KV-cache kernels: Triton kernels for the GPU and torch references that are also the CPU path.

Importing this package never needs a GPU, nor Triton itself; pick the implementation explicitly with
`get_backend("triton" | "cpu" | "torch")`. See docs/kernels.md for layouts and the split-K heuristic.
"""

from ._triton import TRITON_AVAILABLE
from .backend import KernelBackend, get_backend, triton_unavailable_reason
from .block_copy import copy_blocks, copy_blocks_ref, swap_blocks
from .cache_write import cache_write, cache_write_ref
from .cpu_native import cpu_unavailable_reason, paged_decode_attention_cpu, paged_prefill_attention_cpu
from .paged_decode_attention import (
    DecodeGather,
    choose_num_splits,
    decode_gather,
    paged_decode_attention,
    paged_decode_attention_gathered,
    paged_decode_attention_ref,
    use_split_k,
)
from .paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

__all__ = [
    "TRITON_AVAILABLE",
    "DecodeGather",
    "KernelBackend",
    "cache_write",
    "cache_write_ref",
    "choose_num_splits",
    "copy_blocks",
    "copy_blocks_ref",
    "cpu_unavailable_reason",
    "decode_gather",
    "get_backend",
    "paged_decode_attention",
    "paged_decode_attention_cpu",
    "paged_decode_attention_gathered",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_cpu",
    "paged_prefill_attention_ref",
    "swap_blocks",
    "triton_unavailable_reason",
    "use_split_k",
]
