"""The torch references (the CPU serving path) against plain fp64 attention, and chunking invariants."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_testing import DEVICE, assert_close, dense_attention_fp64, make_paged_kv, strided_queries

from pagedserve.kernels import (
    decode_gather,
    paged_decode_attention_gathered,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

SEQ_LENS = [1, 16, 17, 45]
CASES = [(torch.float32, 1, 16), (torch.float32, 3, 8), (torch.float32, 8, 32), (torch.bfloat16, 3, 16)]


def cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous", "interleaved"])
@pytest.mark.parametrize(("dtype", "group", "block_size"), CASES)
def test_decode_reference_matches_dense(dtype: torch.dtype, group: int, block_size: int, interleaved: bool) -> None:
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    kv = make_paged_kv(SEQ_LENS, 2, 64, block_size, dtype, generator=gen, interleaved=interleaved)
    q = strided_queries(len(SEQ_LENS), 2 * group, 64, dtype, gen)
    scale = 0.3  # logits well beyond N(0, 1): exercises the max subtraction
    out = paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    for seq in range(len(SEQ_LENS)):
        expected = dense_attention_fp64(q[seq : seq + 1].cpu(), kv.keys[seq], kv.values[seq], scale)
        assert_close(out[seq : seq + 1], expected, dtype)


@pytest.mark.parametrize(("dtype", "group", "block_size"), CASES)
def test_prefill_reference_matches_dense(dtype: torch.dtype, group: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(group * 100 + block_size + 1)
    q_lens = [1, 16, 5, 30]  # chunk lengths; the rest of each sequence is cached prefix
    kv = make_paged_kv(SEQ_LENS, 2, 64, block_size, dtype, generator=gen)
    q = strided_queries(sum(q_lens), 2 * group, 64, dtype, gen)
    cu = cu_seqlens(q_lens)
    out = paged_prefill_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.3)
    for seq in range(len(SEQ_LENS)):
        rows = slice(int(cu[seq]), int(cu[seq + 1]))
        expected = dense_attention_fp64(q[rows].cpu(), kv.keys[seq], kv.values[seq], 0.3)
        assert_close(out[rows], expected, dtype)


@pytest.mark.parametrize("num_heads", [None, 6], ids=["bags-per-call", "bags-planned"])
def test_gather_plan_shared_by_layers_with_a_loose_bound(num_heads: int | None) -> None:
    """The executor plans one gather per step (with the scheduler's bound on the lengths, here loose) and
    reuses it for every layer's caches; an empty sequence attends to nothing and gets zeros."""
    gen = torch.Generator().manual_seed(9)
    lens = [17, 0, 45, 3]
    kv = make_paged_kv(lens, 2, 64, 16, torch.float32, generator=gen)
    q = strided_queries(len(lens), 6, 64, torch.float32, gen)
    plan = decode_gather(kv.block_tables, kv.seq_lens, 16, 2, max_seq_len=64, num_heads=num_heads)
    assert (plan.head_rows is None) == (num_heads is None)
    # two "layers": the same block tables, K and V swapped in the second
    for k_cache, v_cache, keys, values in [(kv.k_cache, kv.v_cache, kv.keys, kv.values),
                                           (kv.v_cache, kv.k_cache, kv.values, kv.keys)]:
        out = paged_decode_attention_gathered(q, k_cache, v_cache, plan, 0.3)
        for seq, n in enumerate(lens):
            if n == 0:
                assert torch.equal(out[seq], torch.zeros_like(out[seq]))
                continue
            expected = dense_attention_fp64(q[seq : seq + 1].cpu(), keys[seq], values[seq], 0.3)
            assert_close(out[seq : seq + 1], expected, torch.float32)


def test_decode_reference_equals_last_prefill_row() -> None:
    gen = torch.Generator().manual_seed(7)
    kv = make_paged_kv([33], 2, 64, 16, torch.float32, generator=gen)
    q = strided_queries(33, 6, 64, torch.float32, gen)
    caches = (kv.k_cache, kv.v_cache, kv.block_tables)
    prefill = paged_prefill_attention_ref(q, *caches, cu_seqlens([33]), kv.seq_lens, 0.125)
    decode = paged_decode_attention_ref(q[-1:], *caches, kv.seq_lens, 0.125)
    assert_close(decode, prefill[-1:], torch.float32)


def test_chunked_reference_equals_one_shot() -> None:
    gen = torch.Generator().manual_seed(8)
    kv = make_paged_kv([50], 2, 64, 8, torch.float32, generator=gen)
    q = strided_queries(50, 6, 64, torch.float32, gen)
    caches = (kv.k_cache, kv.v_cache, kv.block_tables)
    one_shot = paged_prefill_attention_ref(q, *caches, cu_seqlens([50]), kv.seq_lens, 0.125)
    for start, end in [(0, 21), (21, 50)]:
        seq_len = torch.tensor([end], dtype=torch.int32, device=DEVICE)
        chunk = paged_prefill_attention_ref(q[start:end], *caches, cu_seqlens([end - start]), seq_len, 0.125)
        assert_close(chunk, one_shot[start:end], torch.float32)


PrefillFn = Callable[..., torch.Tensor]


@pytest.mark.parametrize("prefill", [paged_prefill_attention_ref, paged_prefill_attention], ids=["torch", "triton"])
def test_prefix_hit_equals_one_shot(prefill: PrefillFn) -> None:
    """Sequence B shares sequence A's first two blocks through its block table and prefills only its own
    10 tokens; that must equal a one-shot prefill of B's 42 tokens laid out in private blocks."""
    gen = torch.Generator().manual_seed(9)
    block_size, shared, own = 16, 32, 10
    a = make_paged_kv([40], 2, 64, block_size, torch.float32, generator=gen)
    b_private = make_paged_kv([shared + own], 2, 64, block_size, torch.float32, generator=gen)
    # B's true keys: A's first 32 tokens, then its own 10 (taken from b_private's tail).
    for cache, a_tokens in ((b_private.k_cache, a.keys[0]), (b_private.v_cache, a.values[0])):
        for pos in range(shared):
            block = int(b_private.block_tables[0, pos // block_size])
            cache[block, pos % block_size] = a_tokens[pos].to(DEVICE)
    q = strided_queries(shared + own, 6, 64, torch.float32, gen)
    one_shot = prefill(
        q, b_private.k_cache, b_private.v_cache, b_private.block_tables, cu_seqlens([42]), b_private.seq_lens, 0.125
    )

    # Shared layout: B's table = A's two full blocks + a private block holding B's own tokens.
    k_cache, v_cache = a.k_cache.clone(), a.v_cache.clone()
    used_by_a = set(a.block_tables[0, :3].tolist())
    own_block = next(b for b in range(k_cache.shape[0]) if b not in used_by_a)  # a spare block of A's cache
    own_src = int(b_private.block_tables[0, 2])
    k_cache[own_block] = b_private.k_cache[own_src]
    v_cache[own_block] = b_private.v_cache[own_src]
    table = torch.tensor([[int(a.block_tables[0, 0]), int(a.block_tables[0, 1]), own_block, -1]], dtype=torch.int32)
    seq_len = torch.tensor([shared + own], dtype=torch.int32, device=DEVICE)
    hit = prefill(q[shared:], k_cache, v_cache, table.to(DEVICE), cu_seqlens([own]), seq_len, 0.125)
    assert_close(hit, one_shot[shared:], torch.float32)
