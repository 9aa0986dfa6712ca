"""The prefill kernel against its torch reference, one axis varied at a time around a base case."""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
from kernel_testing import DEVICE, assert_close, make_paged_kv, strided_queries

from pagedserve.kernels import paged_prefill_attention, paged_prefill_attention_ref

NUM_KV_HEADS = 2
BASE = {"dtype": torch.float16, "group": 3, "block_size": 16, "head_dim": 64}
VARIANTS = {
    "base": {},
    "fp32": {"dtype": torch.float32},
    "bf16": {"dtype": torch.bfloat16},
    "mha": {"group": 1},
    "gqa8": {"group": 8},
    "block8": {"block_size": 8},
    "block32": {"block_size": 32},
    "dim128": {"head_dim": 128},
    "dim80": {"head_dim": 80},
    "interleaved-kv": {"interleaved": True},
}


def chunks(block_size: int) -> list[tuple[int, int]]:
    """(cached prefix length, chunk length) per sequence."""
    return [
        (0, 1),  # one-token prompt
        (0, block_size),  # exactly one block
        (block_size, block_size + 1),  # prefix-cache hit of one block, chunk one past a block
        (5, 2 * block_size + 3),  # a later chunk starting mid-block
        (70, 1),  # a one-token chunk after more than one key tile
        (0, 70),  # several row tiles
    ]


def cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("name", VARIANTS)
def test_matches_reference(name: str) -> None:
    case = {**BASE, "interleaved": False, **VARIANTS[name]}
    dtype, group, block_size, head_dim = case["dtype"], case["group"], case["block_size"], case["head_dim"]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    prefixes, q_lens = zip(*chunks(block_size), strict=True)
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    kv = make_paged_kv(
        seq_lens, NUM_KV_HEADS, head_dim, block_size, dtype, generator=gen, interleaved=bool(case["interleaved"])
    )
    q = strided_queries(sum(q_lens), NUM_KV_HEADS * group, head_dim, dtype, gen)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens(list(q_lens)), kv.seq_lens, 1 / math.sqrt(head_dim))

    out = paged_prefill_attention(*args)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, paged_prefill_attention_ref(*args), dtype)


def test_chunked_equals_one_shot() -> None:
    """A chunk over a cache holding its prefix gives the one-shot prefill's rows for those tokens."""
    gen = torch.Generator().manual_seed(5)
    seq_len, split = 90, 37
    kv = make_paged_kv([seq_len], NUM_KV_HEADS, 64, 16, torch.float32, generator=gen)
    q = strided_queries(seq_len, 6, 64, torch.float32, gen)
    caches = (kv.k_cache, kv.v_cache, kv.block_tables)
    one_shot = paged_prefill_attention(q, *caches, cu_seqlens([seq_len]), kv.seq_lens, 0.125, max_query_len=seq_len)
    for start, end in [(0, split), (split, seq_len)]:
        chunk_len = torch.tensor([end], dtype=torch.int32, device=DEVICE)
        out = paged_prefill_attention(q[start:end], *caches, cu_seqlens([end - start]), chunk_len, 0.125)
        assert_close(out, one_shot[start:end], torch.float32)


def test_launcher_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(6)
    kv = make_paged_kv([5], NUM_KV_HEADS, 64, 16, torch.float16, generator=gen)
    q = strided_queries(5, 4, 64, torch.float16, gen)
    with pytest.raises(AssertionError, match="cu_seqlens_q"):
        paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens([5]).long(), kv.seq_lens, 0.1)
    with pytest.raises(AssertionError, match="cu_seqlens_q"):
        paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens([2, 3]), kv.seq_lens, 0.1)


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_match_reference(seed: int) -> None:
    """Combinations the one-axis variants above do not reach: random shape, dtype, prefixes and chunks."""
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    group, block_size, head_dim = rng.choice([1, 2, 3, 4, 8]), rng.choice([8, 16, 32]), rng.choice([64, 128])
    prefixes = [rng.choice([0, rng.randint(1, 80)]) for _ in range(rng.randint(1, 4))]
    q_lens = [rng.randint(1, 40) for _ in prefixes]
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    kv = make_paged_kv(seq_lens, NUM_KV_HEADS, head_dim, block_size, dtype, generator=gen)
    q = strided_queries(sum(q_lens), NUM_KV_HEADS * group, head_dim, dtype, gen)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens(q_lens), kv.seq_lens, head_dim**-0.5)
    assert_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args), dtype)
