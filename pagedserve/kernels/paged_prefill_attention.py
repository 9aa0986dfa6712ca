"""Causal prefill attention for chunks of new tokens, reading every key through the paged cache.

Layouts:
    q             [num_tokens, num_heads, head_dim]                    head_dim contiguous
    k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]     head_dim contiguous
    block_tables  [num_seqs, max_blocks] int32
    cu_seqlens_q  [num_seqs + 1] int32   sequence i's queries are q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]
    seq_lens      [num_seqs] int32       context length after this chunk (cached prefix + earlier chunks +
                                         this chunk), whose K/V the executor wrote to the cache beforehand
    out           [num_tokens, num_heads, head_dim] in q's dtype

Query i of a chunk of q_len tokens sits at absolute position seq_len - q_len + i and attends to the keys
at positions <= its own, so a chunked or prefix-hit prefill computes exactly what a one-shot prefill does.

A program owns BLOCK_M rows of one (sequence, KV head): the rows enumerate (token, query head of the
group) pairs, row r being token r // GROUP_SIZE and head r % GROUP_SIZE, so the group's query heads share
every K/V tile, as in decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import ATTENTION_DTYPES, check_block_tables, check_kv_cache, gather_kv, sequence_blocks
from ._triton import tl, triton

# (token, head) rows per program and keys per tile. At 8 warps the 16-bit sm_90 builds do not spill
# registers up to head_dim 128 (64 x 64 tiles, or 4 warps, do); fp32 spills a little with any tile.
BLOCK_M = 64
BLOCK_N = 32
NUM_WARPS = 8


@triton.jit
def _paged_prefill_attention_kernel(
    out_ptr: tl.tensor,  # [num_tokens, num_heads, HEAD_DIM]
    q_ptr: tl.tensor,  # [num_tokens, num_heads, HEAD_DIM]
    k_cache_ptr: tl.tensor,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr: tl.tensor,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    block_tables_ptr: tl.tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q_ptr: tl.tensor,  # [num_seqs + 1] int32
    seq_lens_ptr: tl.tensor,  # [num_seqs] int32
    scale: tl.tensor,
    stride_q_tok: tl.tensor,
    stride_q_head: tl.tensor,
    stride_o_tok: tl.tensor,
    stride_o_head: tl.tensor,
    stride_k_block: tl.tensor,
    stride_k_slot: tl.tensor,
    stride_k_head: tl.tensor,
    stride_v_block: tl.tensor,
    stride_v_slot: tl.tensor,
    stride_v_head: tl.tensor,
    stride_bt_seq: tl.tensor,
    GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "tf32x3": fp32 accuracy on tensor cores; ignored for 16-bit
) -> None:
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    num_rows = q_len * GROUP_SIZE
    if tile * BLOCK_M >= num_rows:
        return  # the grid is sized for the longest chunk in the batch
    context_len = tl.load(seq_lens_ptr + seq) - q_len  # keys before this chunk

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = rows < num_rows
    mask_d = offs_d < HEAD_DIM
    tokens = rows // GROUP_SIZE  # [BLOCK_M] index within the chunk
    heads = kv_head * GROUP_SIZE + rows % GROUP_SIZE  # [BLOCK_M]
    q_pos = context_len + tokens  # [BLOCK_M] absolute positions

    q_offs = (q_start + tokens).to(tl.int64)[:, None] * stride_q_tok + heads[:, None] * stride_q_head
    q = tl.load(q_ptr + q_offs + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp(x) == exp2(x * log2(e))
    block_table = block_tables_ptr + seq * stride_bt_seq
    # Keys up to the last valid row's position; rows past the chunk clamp to it and are never stored.
    kv_end = context_len + (tl.minimum(tile * BLOCK_M + BLOCK_M, num_rows) - 1) // GROUP_SIZE + 1

    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + offs_n  # [BLOCK_N] key positions
        mask_n = pos < kv_end
        block_ids = tl.load(block_table + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        slots = pos % BLOCK_SIZE
        # Skip the head_dim mask when it is all true: per-element predicates cost registers.
        kv_mask = mask_n[:, None] if BLOCK_D == HEAD_DIM else mask_n[:, None] & mask_d[None, :]
        k_rows = k_cache_ptr + block_ids * stride_k_block + (slots * stride_k_slot + kv_head * stride_k_head)
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        # Finite: key 0 is visible to every row in the first tile, so m_i is finite from then on.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_rows = v_cache_ptr + block_ids * stride_v_block + (slots * stride_v_slot + kv_head * stride_v_head)
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = (q_start + tokens).to(tl.int64)[:, None] * stride_o_tok + heads[:, None] * stride_o_head
    out_mask = mask_m[:, None] & mask_d[None, :]
    tl.store(out_ptr + o_offs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_prefill_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
) -> int:  # -> group_size
    assert q.dim() == 3, f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}"
    num_heads, head_dim = q.shape[1:]
    cache = check_kv_cache(k_cache, v_cache)
    num_seqs = seq_lens.shape[0]
    check_block_tables(block_tables, seq_lens, num_seqs)
    assert q.dtype in ATTENTION_DTYPES, f"unsupported dtype {q.dtype}"
    assert k_cache.dtype in ATTENTION_DTYPES, f"unsupported cache dtype {k_cache.dtype}"
    assert q.stride(-1) == 1, "q must be contiguous along head_dim"
    assert head_dim == cache.head_dim, f"q head_dim {head_dim} != cache head_dim {cache.head_dim}"
    assert num_heads % cache.num_kv_heads == 0, f"{num_heads} heads not divisible by {cache.num_kv_heads}"
    assert cu_seqlens_q.dtype == torch.int32, f"cu_seqlens_q must be int32, got {cu_seqlens_q.dtype}"
    assert cu_seqlens_q.shape == (num_seqs + 1,), (
        f"cu_seqlens_q must be [{num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}"
    )
    assert q.device == k_cache.device == block_tables.device == cu_seqlens_q.device == seq_lens.device, (
        "tensors on different devices"
    )
    return num_heads // cache.num_kv_heads


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new query tokens over all its cached keys.

    `max_query_len` (the longest chunk, known to the scheduler) sizes the grid; without it the launcher
    reads it from `cu_seqlens_q`, a device sync. It must not be smaller than the true maximum. Rows of
    `q` past `cu_seqlens_q[-1]` (padding) are left unwritten in the output.
    """
    group_size = _check_prefill_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    assert k_cache.dtype == q.dtype, f"cache dtype {k_cache.dtype} != q dtype {q.dtype}"  # the reference widens
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if num_seqs > 0 else 0
    if num_seqs == 0 or max_query_len == 0:
        return out
    head_dim = q.shape[2]
    num_kv_heads = k_cache.shape[2]

    grid = (triton.cdiv(max_query_len * group_size, BLOCK_M), num_seqs, num_kv_heads)
    _paged_prefill_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP_SIZE=group_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Torch reference and CPU path: per sequence, gather its blocks and run masked SDPA in fp32.

    `max_query_len` is accepted for signature parity with the Triton launcher and not needed here.
    """
    group_size = _check_prefill_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        assert seq_len >= q_len, f"sequence {seq}: seq_len {seq_len} < query length {q_len}"
        block_ids = sequence_blocks(block_tables, seq, seq_len, block_size)
        # With a batch dimension of 1, as dense implementations call SDPA: the CPU kernel's blocking, hence
        # its rounding, differs between 3-d and 4-d inputs (3e-6 apart), and this way a whole prompt's
        # attention equals transformers' to the bit.
        k = gather_kv(k_cache, block_ids, seq_len).transpose(0, 1)[None].float()  # [1, kv_heads, seq_len, dim]
        v = gather_kv(v_cache, block_ids, seq_len).transpose(0, 1)[None].float()
        q_seq = q[q_start:q_end].transpose(0, 1)[None].float()  # [1, num_heads, q_len, head_dim]
        if q_len == seq_len:  # a whole prompt: the plain causal kernel
            o = F.scaled_dot_product_attention(q_seq, k, v, is_causal=True, scale=scale, enable_gqa=group_size > 1)
        else:  # a chunk after cached keys: query i sits at position seq_len - q_len + i
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
            o = F.scaled_dot_product_attention(
                q_seq, k, v, attn_mask=visible, scale=scale, enable_gqa=group_size > 1
            )  # [1, num_heads, q_len, head_dim]
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out
