"""Decode attention over a paged KV cache: one query token per sequence.

Layouts (the executor's contract):
    q            [num_seqs, num_heads, head_dim]                       head_dim contiguous
    k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]      head_dim contiguous
    block_tables [num_seqs, max_blocks] int32   entries past a sequence's last block are never read
    seq_lens     [num_seqs] int32               tokens in the cache, the current one included
    out          [num_seqs, num_heads, head_dim] in q's dtype

One program handles one (sequence, KV head) pair and all `num_heads // num_kv_heads` query heads of
that group, so each K/V tile is read once per group and the group's rows share one `tl.dot`. With
split-K (flash-decoding), program (seq, kv_head, split) covers one contiguous key range and writes an
unnormalized partial result; `_paged_decode_reduce_kernel` merges the splits by their softmax maxima.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._common import ATTENTION_DTYPES, check_block_tables, check_kv_cache, num_sms
from ._triton import tl, triton

# Keys per tile; a tile may span several cache blocks (each row gathers its own block id). 32 keeps every
# sm_90 build of the kernel free of register spills at 4 warps (64 spills for head_dim 128).
BLOCK_N = 32
NUM_WARPS = 4
MIN_TOKENS_PER_SPLIT = 256  # below this a split's work is dwarfed by writing and reducing its partials
MAX_SPLITS = 32


def use_split_k(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> bool:
    """Split the keys when the plain grid leaves SMs idle and the contexts are long enough to share.

    The unsplit grid has one program per (sequence, KV head). When that is less than one program per
    SM, most of the GPU's bandwidth sits unused while each program walks a long context alone; splitting
    the context multiplies the programs. Short contexts are never split: each split must keep at least
    MIN_TOKENS_PER_SPLIT keys, or the extra partial writes and the reduce launch cost more than they save.
    """
    return num_seqs * num_kv_heads < num_sms and max_seq_len >= 2 * MIN_TOKENS_PER_SPLIT


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Number of key splits: 1 unless `use_split_k`; else about two programs per SM, capped so that every
    split keeps MIN_TOKENS_PER_SPLIT keys and the reduce stays within MAX_SPLITS partials."""
    if not use_split_k(num_seqs, num_kv_heads, max_seq_len, num_sms):
        return 1
    programs = num_seqs * num_kv_heads
    wanted = -(-2 * num_sms // programs)
    return max(2, min(wanted, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


@triton.jit
def _paged_decode_attention_kernel(
    # [num_seqs, num_heads, HEAD_DIM], or when IS_SPLIT partial_out [num_seqs, num_heads, num_splits, HEAD_DIM]
    out_ptr: tl.tensor,
    partial_max_ptr: tl.tensor,  # [num_seqs, num_heads, num_splits] fp32, log2 domain (split only)
    partial_sum_ptr: tl.tensor,  # [num_seqs, num_heads, num_splits] fp32 (split only)
    q_ptr: tl.tensor,  # [num_seqs, num_heads, HEAD_DIM]
    k_cache_ptr: tl.tensor,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr: tl.tensor,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    block_tables_ptr: tl.tensor,  # [num_seqs, max_blocks] int32
    seq_lens_ptr: tl.tensor,  # [num_seqs] int32
    scale: tl.tensor,
    num_heads: tl.tensor,
    num_splits: tl.tensor,
    partition_size: tl.tensor,  # keys per split, a multiple of BLOCK_N; the last split takes the remainder
    stride_q_seq: tl.tensor,
    stride_q_head: tl.tensor,
    stride_o_seq: tl.tensor,
    stride_o_head: tl.tensor,
    stride_k_block: tl.tensor,
    stride_k_slot: tl.tensor,
    stride_k_head: tl.tensor,
    stride_v_block: tl.tensor,
    stride_v_slot: tl.tensor,
    stride_v_head: tl.tensor,
    stride_bt_seq: tl.tensor,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP_SIZE rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "tf32x3": fp32 accuracy on tensor cores; ignored for 16-bit
) -> None:
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)
    end = tl.where(split == num_splits - 1, seq_len, end)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP_SIZE
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP_SIZE + offs_g  # [BLOCK_G] query heads of this group

    q_offs = seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp(x) == exp2(x * log2(e))
    block_table = block_tables_ptr + seq * stride_bt_seq

    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n  # [BLOCK_N] key positions
        mask_n = pos < end
        block_ids = tl.load(block_table + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        slots = pos % BLOCK_SIZE
        # Skip the head_dim mask when it is all true: per-element predicates cost registers.
        kv_mask = mask_n[:, None] if BLOCK_D == HEAD_DIM else mask_n[:, None] & mask_d[None, :]
        k_rows = k_cache_ptr + block_ids * stride_k_block + (slots * stride_k_slot + kv_head * stride_k_head)
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every tile holds at least one valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_rows = v_cache_ptr + block_ids * stride_v_block + (slots * stride_v_slot + kv_head * stride_v_head)
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = mask_g[:, None] & mask_d[None, :]
    if IS_SPLIT:
        # Unnormalized partials; an empty split leaves m_i = -inf and l_i = 0, which the reduce skips.
        rows = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(partial_max_ptr + rows, m_i, mask=mask_g)
        tl.store(partial_sum_ptr + rows, l_i, mask=mask_g)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (padding) yields zeros, not NaN
        o_offs = seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr: tl.tensor,  # [num_seqs, num_heads, HEAD_DIM]
    partial_out_ptr: tl.tensor,  # [num_seqs, num_heads, num_splits, HEAD_DIM] fp32, contiguous
    partial_max_ptr: tl.tensor,  # [num_seqs, num_heads, num_splits] fp32, contiguous
    partial_sum_ptr: tl.tensor,  # [num_seqs, num_heads, num_splits] fp32, contiguous
    num_heads: tl.tensor,
    num_splits: tl.tensor,
    stride_o_seq: tl.tensor,
    stride_o_head: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
) -> None:
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    rows = (seq * num_heads + head) * num_splits + offs_s  # [BLOCK_SPLITS]

    split_max = tl.load(partial_max_ptr + rows, mask=mask_s, other=float("-inf"))  # [BLOCK_SPLITS]
    split_sum = tl.load(partial_sum_ptr + rows, mask=mask_s, other=0.0)  # [BLOCK_SPLITS]
    m_max = tl.max(split_max, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # all splits empty: avoid exp2(-inf - -inf)
    weights = tl.exp2(split_max - m_max)  # [BLOCK_SPLITS]; 0 for empty splits
    acc = tl.load(
        partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_SPLITS, BLOCK_D]
    total = tl.sum(weights * split_sum, 0)
    out = tl.sum(weights[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    o_offs = seq * stride_o_seq + head * stride_o_head + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of each sequence's single query token over its cached keys and values.

    `max_seq_len` (an upper bound of `seq_lens`, known to the scheduler) sizes the split-K partition;
    without it the launcher reads `seq_lens.max()`, a device sync. Underestimating it only unbalances
    the splits: the last split always runs to the end of its sequence. `num_splits` forces the split
    count (1 disables split-K); by default `choose_num_splits` decides.
    """
    assert q.dim() == 3, f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}"
    num_seqs, num_heads, head_dim = q.shape
    cache = check_kv_cache(k_cache, v_cache)
    check_block_tables(block_tables, seq_lens, num_seqs)
    assert q.dtype in ATTENTION_DTYPES, f"unsupported dtype {q.dtype}"
    assert k_cache.dtype == q.dtype, f"cache dtype {k_cache.dtype} != q dtype {q.dtype}"
    assert q.stride(-1) == 1, "q must be contiguous along head_dim"
    assert head_dim == cache.head_dim, f"q head_dim {head_dim} != cache head_dim {cache.head_dim}"
    assert num_heads % cache.num_kv_heads == 0, f"{num_heads} heads not divisible by {cache.num_kv_heads}"
    assert q.device == k_cache.device == block_tables.device == seq_lens.device, "tensors on different devices"
    group_size = num_heads // cache.num_kv_heads

    if num_splits is None or num_splits > 1:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item()) if num_seqs > 0 else 0
        if num_splits is None:
            num_splits = choose_num_splits(num_seqs, cache.num_kv_heads, max_seq_len, num_sms(q.device))
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out

    is_split = num_splits > 1
    if is_split:
        assert max_seq_len is not None
        partition_size = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), BLOCK_N) * BLOCK_N
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
        first_out, stride_o = partial_out, (0, 0)
    else:
        partition_size = 2**31 - 1
        partial_max = partial_sum = out  # unused placeholders
        first_out, stride_o = out, (out.stride(0), out.stride(1))

    grid = (num_seqs, cache.num_kv_heads, num_splits)
    _paged_decode_attention_kernel[grid](
        first_out, partial_max, partial_sum,
        q, k_cache, v_cache, block_tables, seq_lens,
        scale, num_heads, num_splits, partition_size,
        q.stride(0), q.stride(1), *stride_o,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_G=triton.next_power_of_2(group_size),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=cache.block_size,
        BLOCK_N=BLOCK_N,
        IS_SPLIT=is_split,
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
    )  # fmt: skip
    if is_split:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out, partial_out, partial_max, partial_sum,
            num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


class DecodeGather(NamedTuple):
    """Where the torch path reads each sequence's keys and values: computed once per step (it depends only on
    the block tables) and shared by every layer, whose caches all have the same geometry."""

    rows: torch.Tensor  # [num_seqs * num_kv_heads * max_len] int64: rows of cache.flatten(0, 2), (seq, head, pos)
    mask: torch.Tensor  # [num_seqs, 1, 1, max_len] fp32: 0 where position < seq_len, else -inf (added to scores)
    empty: torch.Tensor | None  # [num_seqs, 1, 1] bool: seq_len == 0 (None when no sequence is empty)
    num_kv_heads: int
    max_len: int
    # [num_seqs * num_heads, max_len] int64: `rows` repeated for each query head of a group (the value bags);
    # None when the plan was made without num_heads (then each call repeats them)
    head_rows: torch.Tensor | None = None


def decode_gather(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_size: int,
    num_kv_heads: int,
    max_seq_len: int | None = None,
    num_heads: int | None = None,
) -> DecodeGather:
    """The gather plan of `paged_decode_attention_gathered`. `max_seq_len`, when given, must be at least the
    longest sequence; it only saves a reduction. `num_heads` (query heads), when given, plans the value
    bags too, so that no layer repeats the rows for its query heads.

    A padding position (past its sequence's length) reads the sequence's last token instead: a slot the model
    has written (finite), which the mask then hides. No slot past a sequence is ever read.
    """
    num_seqs = block_tables.shape[0]
    check_block_tables(block_tables, seq_lens, num_seqs)
    lens = seq_lens.long()
    max_len = int(lens.max()) if max_seq_len is None and num_seqs else (max_seq_len or 0)
    steps = torch.arange(max_len, device=block_tables.device)
    positions = torch.minimum(steps[None, :], (lens - 1).clamp(min=0)[:, None])  # [num_seqs, max_len]
    slots = block_tables.long().gather(1, positions // block_size).clamp(min=0) * block_size + positions % block_size
    heads = torch.arange(num_kv_heads, device=block_tables.device)
    rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]  # [num_seqs, num_kv_heads, max_len]
    # An additive float mask, built once: a boolean one would be converted in every layer.
    mask = torch.zeros(num_seqs, 1, 1, max_len, device=block_tables.device)
    mask.masked_fill_((steps[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
    empty = (lens == 0)[:, None, None] if bool((lens == 0).any()) else None
    head_rows = None if num_heads is None else _head_rows(rows, num_heads)
    return DecodeGather(rows.flatten(), mask, empty, num_kv_heads, max_len, head_rows)


def _head_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:  # -> [num_seqs * num_heads, max_len]
    num_seqs, num_kv_heads, max_len = rows.shape
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads not divisible by {num_kv_heads}"
    group = num_heads // num_kv_heads
    return rows[:, :, None, :].expand(num_seqs, num_kv_heads, group, max_len).reshape(-1, max_len)


def paged_decode_attention_gathered(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    gather: DecodeGather,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """The CPU serving path, in fp32 whatever the cache dtype. Keys: every sequence's keys gathered into one
    contiguous padded batch [num_seqs * num_kv_heads, max_len, head_dim] (one index_select), then one batched
    matmul with the group's query heads as rows, the mask and a softmax. Values are not gathered: in fp32,
    `embedding_bag` sums the value rows weighted by the probabilities straight out of the cache (one bag per
    query head). Both are cheaper than a gather and SDPA, whose CPU kernel pays per (sequence, head) for a
    single query row: 2.3 -> 1.6 ms per layer at 64 sequences of ~80 tokens (SmolLM2-135M, one thread)."""
    num_seqs, num_heads, head_dim = q.shape
    cache = check_kv_cache(k_cache, v_cache)
    assert cache.num_kv_heads == gather.num_kv_heads, f"cache has {cache.num_kv_heads} KV heads, plan {gather}"
    assert num_heads % cache.num_kv_heads == 0, f"{num_heads} heads not divisible by {cache.num_kv_heads}"
    if gather.max_len == 0:
        return torch.zeros_like(q)
    max_len, group = gather.max_len, num_heads // cache.num_kv_heads
    batch = num_seqs * cache.num_kv_heads
    keys = k_cache.flatten(0, 2).index_select(0, gather.rows).view(batch, max_len, head_dim).float()
    queries = (q.float() * scale).reshape(batch, group, head_dim)
    scores = torch.bmm(queries, keys.transpose(1, 2))  # [num_seqs * num_kv_heads, group, max_len]
    scores.view(num_seqs, cache.num_kv_heads, group, max_len).add_(gather.mask)
    probs = torch.softmax(scores, dim=-1).view(num_seqs * num_heads, max_len)
    if v_cache.dtype == torch.float32:
        head_rows = gather.head_rows
        if head_rows is None or head_rows.shape[0] != num_seqs * num_heads:
            head_rows = _head_rows(gather.rows.view(num_seqs, cache.num_kv_heads, max_len), num_heads)
        out = F.embedding_bag(head_rows, v_cache.flatten(0, 2), per_sample_weights=probs, mode="sum")
    else:  # embedding_bag would sum in the cache's 16-bit dtype
        values = v_cache.flatten(0, 2).index_select(0, gather.rows).view(batch, max_len, head_dim).float()
        out = torch.bmm(probs.view(batch, group, max_len), values)
    out = out.view(num_seqs, num_heads, head_dim)
    if gather.empty is not None:  # all keys masked: the softmax gives NaN, attention over nothing is 0
        out = out.masked_fill(gather.empty, 0.0)
    return out.to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    max_seq_len: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Torch reference and CPU path: `decode_gather` then `paged_decode_attention_gathered`, batched over the
    whole batch. The executor builds the gather once per step and calls the second half per layer."""
    cache = check_kv_cache(k_cache, v_cache)
    assert q.shape[0] == block_tables.shape[0], f"{q.shape[0]} queries for {block_tables.shape[0]} block tables"
    gather = decode_gather(block_tables, seq_lens, cache.block_size, cache.num_kv_heads, max_seq_len, q.shape[1])
    return paged_decode_attention_gathered(q, k_cache, v_cache, gather, scale)
