"""Paged attention for one layer of a mixed batch: prefill chunks first, then one token per decode.

Every step writes the new tokens' K/V into the paged cache first, so both kernels read all keys through
the block tables (cached prefix, earlier chunks and the chunk itself alike).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from ...kernels import DecodeGather, KernelBackend, decode_gather, paged_decode_attention_gathered


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of the batch goes and what it may attend to. Tokens [0, num_prefill_tokens)
    belong to prefill chunks (sequence by sequence); each later token is one decoding sequence."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each token's K/V (< 0: padding)
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32: context length after the chunk
    max_prefill_query_len: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32: context length including the new token
    max_decode_seq_len: int
    decode_gather: DecodeGather | None = None  # the torch path's gather plan, built once for every layer

    @property
    def num_decodes(self) -> int:
        return int(self.decode_seq_lens.shape[0])


def int_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D int32 or int64 tensor of `values`, packed by `array` and shared by `torch.frombuffer`: `torch.tensor`
    of a list inspects each element (the 5120 entries of 256 block tables: ~490 us on a slow 2-core host, against
    ~220 us through `array`)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    packed = torch.frombuffer(array("i" if dtype == torch.int32 else "q", values), dtype=dtype)
    return packed if device.type == "cpu" else packed.to(device)


def padded_tables(tables: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[len(tables), longest] int32, each table's blocks then zeros: one flat copy and one masked fill, not a
    padded list per row."""
    lengths = list(map(len, tables))
    width = max(lengths, default=0) or 1
    flat = int_tensor(list(chain.from_iterable(tables)), torch.int32, torch.device("cpu"))
    if len(flat) == width * len(tables):  # every table as long as the longest: no padding
        padded = flat.view(len(tables), width)
    else:
        padded = torch.zeros(len(tables), width, dtype=torch.int32)
        padded[torch.arange(width) < int_tensor(lengths, torch.int64, torch.device("cpu"))[:, None]] = flat
    return padded if device.type == "cpu" else padded.to(device)


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    slot_mapping: Sequence[int],
    device: torch.device,
    *,
    gather_geometry: tuple[int, int, int] | None = None,
    decode_block_tables: torch.Tensor | None = None,
) -> AttentionMetadata:
    """From per-sequence lists in which the caller placed every sequence with query_len > 1 first.
    A single-token chunk takes the decode kernel: one query at the end of its context is exactly a decode.
    `gather_geometry` (block_size, num_kv_heads, num_heads) is given on the torch path: decodes then read the
    cache through a `DecodeGather` planned here once, not once per layer. `decode_block_tables`: the decodes'
    tables padded already (a step that runs the last one's batch again), read by the kernels, never written."""
    num_prefills = sum(1 for q in query_lens if q > 1)
    assert all(q > 1 for q in query_lens[:num_prefills]), "multi-token chunks must precede single tokens"
    prefill_q = list(query_lens[:num_prefills])
    cu = [0]
    for q in prefill_q:
        cu.append(cu[-1] + q)
    decode_lens = list(seq_lens[num_prefills:])
    if decode_block_tables is None:
        decode_block_tables = padded_tables(block_tables[num_prefills:], device)
    decode_seq_lens = int_tensor(decode_lens, torch.int32, device)
    max_decode_seq_len = max(decode_lens, default=0)
    gather = None
    if gather_geometry is not None and decode_lens:
        block_size, num_kv_heads, num_heads = gather_geometry
        gather = decode_gather(decode_block_tables, decode_seq_lens, block_size, num_kv_heads, max_decode_seq_len,
                               num_heads)
    return AttentionMetadata(
        slot_mapping=int_tensor(slot_mapping, torch.int64, device),
        num_prefill_tokens=cu[-1],
        prefill_block_tables=padded_tables(block_tables[:num_prefills], device),
        prefill_cu_seqlens_q=int_tensor(cu, torch.int32, device),
        prefill_seq_lens=int_tensor(seq_lens[:num_prefills], torch.int32, device),
        max_prefill_query_len=max(prefill_q, default=0),
        decode_block_tables=decode_block_tables,
        decode_seq_lens=decode_seq_lens,
        max_decode_seq_len=max_decode_seq_len,
        decode_gather=gather,
    )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    backend: KernelBackend,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    backend.cache_write(k, v, k_cache, v_cache, meta.slot_mapping)
    p = meta.num_prefill_tokens
    if p == q.shape[0]:
        return backend.prefill_attention(
            q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
            scale, max_query_len=meta.max_prefill_query_len,
        )
    if p == 0:
        return _decode_attention(q, k_cache, v_cache, meta, backend, scale)
    out = torch.empty_like(q)
    out[:p] = backend.prefill_attention(
        q[:p], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
        scale, max_query_len=meta.max_prefill_query_len,
    )
    out[p:] = _decode_attention(q[p:], k_cache, v_cache, meta, backend, scale)
    return out


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, backend: KernelBackend,
    scale: float,
) -> torch.Tensor:
    if meta.decode_gather is not None:
        return paged_decode_attention_gathered(q, k_cache, v_cache, meta.decode_gather, scale)
    return backend.decode_attention(
        q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
        max_seq_len=meta.max_decode_seq_len,
    )
