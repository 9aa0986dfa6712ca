"""The decode kernel against its torch reference, one axis varied at a time around a base case."""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import DEVICE, assert_close, make_paged_kv, strided_queries

from pagedserve.kernels import paged_decode_attention, paged_decode_attention_ref
from pagedserve.kernels.paged_decode_attention import (
    BLOCK_N,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    use_split_k,
)

NUM_KV_HEADS = 2
BASE = {"dtype": torch.float16, "group": 3, "block_size": 16, "head_dim": 64, "num_splits": 1}
VARIANTS = {
    "base": {},
    "fp32": {"dtype": torch.float32},
    "bf16": {"dtype": torch.bfloat16},
    "mha": {"group": 1},
    "gqa8": {"group": 8},
    "block8": {"block_size": 8},
    "block32": {"block_size": 32},
    "dim128": {"head_dim": 128},
    "dim80": {"head_dim": 80},  # not a power of two: masked lanes
    "interleaved-kv": {"interleaved": True},
    "split3": {"num_splits": 3},
    "split4-bf16-gqa8": {"num_splits": 4, "dtype": torch.bfloat16, "group": 8},
    "split2-fp32-block8": {"num_splits": 2, "dtype": torch.float32, "block_size": 8},
}


@pytest.mark.parametrize("name", VARIANTS)
def test_matches_reference(name: str) -> None:
    case = {**BASE, "interleaved": False, **VARIANTS[name]}
    dtype, group, block_size, head_dim = case["dtype"], case["group"], case["block_size"], case["head_dim"]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    # One token, exactly one block, one past a block, and several key tiles with a ragged tail.
    seq_lens = [1, block_size, block_size + 1, 2 * BLOCK_N + 3]
    kv = make_paged_kv(
        seq_lens, NUM_KV_HEADS, head_dim, block_size, dtype, generator=gen, interleaved=bool(case["interleaved"])
    )
    q = strided_queries(len(seq_lens), NUM_KV_HEADS * group, head_dim, dtype, gen)
    scale = 1 / math.sqrt(head_dim)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)

    out = paged_decode_attention(*args, num_splits=int(case["num_splits"]))
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, paged_decode_attention_ref(*args), dtype)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_empty_sequences_give_zeros(num_splits: int) -> None:
    gen = torch.Generator().manual_seed(1)
    kv = make_paged_kv([0, 70, 0], NUM_KV_HEADS, 64, 16, torch.float32, generator=gen)
    q = strided_queries(3, 4, 64, torch.float32, gen)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    out = paged_decode_attention(*args, num_splits=num_splits)
    expected = paged_decode_attention_ref(*args)
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0)
    assert_close(out, expected, torch.float32)


def test_split_k_survives_an_underestimated_max_seq_len() -> None:
    """The last split runs to the end of its sequence, so a stale max_seq_len never drops keys."""
    gen = torch.Generator().manual_seed(2)
    kv = make_paged_kv([200, 9], NUM_KV_HEADS, 64, 16, torch.float32, generator=gen)
    q = strided_queries(2, 2, 64, torch.float32, gen)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    out = paged_decode_attention(*args, num_splits=2, max_seq_len=1)
    assert_close(out, paged_decode_attention_ref(*args), torch.float32)


def test_heuristic_splits_only_long_contexts_on_an_underfilled_gpu() -> None:
    h200_sms = 132
    assert use_split_k(num_seqs=1, num_kv_heads=8, max_seq_len=4096, num_sms=h200_sms)
    assert not use_split_k(num_seqs=64, num_kv_heads=8, max_seq_len=32768, num_sms=h200_sms)  # grid is full
    assert not use_split_k(num_seqs=1, num_kv_heads=8, max_seq_len=300, num_sms=h200_sms)  # too short
    assert choose_num_splits(1, 8, 4096, h200_sms) == 4096 // MIN_TOKENS_PER_SPLIT  # capped by length
    assert choose_num_splits(1, 8, 32768, h200_sms) == MAX_SPLITS
    assert choose_num_splits(16, 8, 32768, h200_sms) == 3  # 128 programs -> about two per SM
    assert choose_num_splits(256, 8, 512, h200_sms) == 1


@given(
    num_seqs=st.integers(1, 512),
    num_kv_heads=st.integers(1, 64),
    max_seq_len=st.integers(1, 200_000),
    num_sms=st.integers(1, 200),
)
def test_heuristic_invariants(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> None:
    num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms)
    assert 1 <= num_splits <= MAX_SPLITS
    assert (num_splits > 1) == use_split_k(num_seqs, num_kv_heads, max_seq_len, num_sms)
    if num_splits > 1:
        assert max_seq_len // num_splits >= MIN_TOKENS_PER_SPLIT


def test_launcher_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([5], NUM_KV_HEADS, 64, 16, torch.float16, generator=gen)
    q = strided_queries(1, 4, 64, torch.float16, gen)
    with pytest.raises(AssertionError, match="int32"):
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.seq_lens, 0.1)
    with pytest.raises(AssertionError, match="dtype"):
        paged_decode_attention(q.float(), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1)
    with pytest.raises(AssertionError, match="divisible"):
        q3 = torch.zeros(1, 3, 64, dtype=torch.float16, device=DEVICE)
        paged_decode_attention(q3, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1)


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_match_reference(seed: int) -> None:
    """Combinations the one-axis variants above do not reach: random shape, dtype, split and lengths."""
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    group, block_size = rng.choice([1, 2, 3, 4, 8]), rng.choice([8, 16, 32])
    head_dim, num_splits = rng.choice([64, 128]), rng.choice([1, 2, 3, 5])
    seq_lens = [rng.randint(1, 150) for _ in range(rng.randint(1, 5))]
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(seq_lens, NUM_KV_HEADS, head_dim, block_size, dtype, generator=gen)
    q = strided_queries(len(seq_lens), NUM_KV_HEADS * group, head_dim, dtype, gen)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
    assert_close(paged_decode_attention(*args, num_splits=num_splits), paged_decode_attention_ref(*args), dtype)
