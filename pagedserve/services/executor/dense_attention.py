"""Dense attention over each sequence's contiguous K/V (the virtual and static layouts): no block table.

The batch is flat as on the paged path (prefill chunks first, then one token per decode); each sequence's
rows attend to its own region with torch's scaled_dot_product_attention, one call per sequence and layer.
A chunk that follows tokens already in the region needs a mask aligned to its bottom right (query i sits at
position start + i); SDPA's `is_causal` aligns to the top left, right only when the chunk starts at 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


class DenseLayer(NamedTuple):
    """What a layer receives instead of paged (k_cache, v_cache): its index into each sequence's region."""

    layer: int


@dataclass(frozen=True)
class DenseAttentionMetadata:
    regions: list[torch.Tensor]  # per sequence: [num_layers, 2, capacity, num_kv_heads, head_dim]
    starts: list[int]  # position of each sequence's first row
    query_lens: list[int]
    offsets: list[int]  # each sequence's first row in the flat batch
    masks: list[torch.Tensor | None]  # [query_len, start + query_len] bool (True: may attend) for a chunk after
    # cached tokens; None for a chunk from position 0 (causal) or a single token (sees everything)


def build_dense_metadata(
    regions: list[torch.Tensor], starts: list[int], query_lens: list[int], device: torch.device
) -> DenseAttentionMetadata:
    offsets: list[int] = []
    masks: list[torch.Tensor | None] = []
    at = 0
    for start, n in zip(starts, query_lens, strict=True):
        offsets.append(at)
        at += n
        if n > 1 and start > 0:
            query_pos = torch.arange(start, start + n, device=device)[:, None]
            masks.append(torch.arange(start + n, device=device)[None, :] <= query_pos)
        else:
            masks.append(None)
    return DenseAttentionMetadata(regions, starts, query_lens, offsets, masks)


def dense_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    meta: DenseAttentionMetadata,
    layer: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Writes the rows' K/V into their regions, then attends over each region's [0, start + query_len)."""
    out = torch.empty_like(q)
    for region, start, n, at, mask in zip(meta.regions, meta.starts, meta.query_lens, meta.offsets, meta.masks,
                                          strict=True):
        end = start + n
        cache = region[layer]  # [2, capacity, num_kv_heads, head_dim]
        cache[0, start:end] = k[at : at + n]
        cache[1, start:end] = v[at : at + n]
        keys = cache[0, :end].transpose(0, 1)  # [num_kv_heads, end, head_dim], a view of the region
        values = cache[1, :end].transpose(0, 1)
        query = q[at : at + n].transpose(0, 1)  # [num_heads, n, head_dim]
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=mask is None and n > 1, scale=scale, enable_gqa=True
        )  # [num_heads, n, head_dim]
        out[at : at + n] = attended.transpose(0, 1)
    return out
