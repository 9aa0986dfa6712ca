"""The CPU's prefill attention in C against plain fp64 attention and the torch path; a row's bits whatever the
chunking, batch and threads; a bf16 cache; the inputs it refuses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from kernel_testing import assert_close, dense_attention_fp64, make_paged_kv, strided_queries

from pagedserve.kernels import paged_prefill_attention_cpu, paged_prefill_attention_ref


def cu_seqlens(q_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize(
    ("group", "head_dim", "block_size", "seq_lens", "q_lens"),
    [
        (3, 64, 16, [128, 128, 45, 1], [128, 128, 45, 1]),  # SmolLM2's heads: whole prompts, one of a token
        (1, 64, 16, [80, 17, 33], [30, 17, 1]),  # chunks after cached keys; a one-token chunk
        (4, 32, 8, [9, 70], [9, 64]),
        (2, 128, 32, [100, 31], [37, 31]),
        (8, 16, 1, [5, 40], [5, 40]),  # more query heads to a KV head than rows to a tile
        (5, 24, 8, [19, 4], [19, 2]),  # AVX2: three vectors a row; AVX-512: the plain values
        (2, 20, 16, [30, 7], [12, 7]),  # not a multiple of any vector width: the plain values
        (1, 48, 16, [23, 200], [23, 150]),  # keys past two vectors of positions, chunk past PF_TOKENS
    ],
)
def test_matches_dense_attention(group: int, head_dim: int, block_size: int, seq_lens: list[int],
                                 q_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + block_size)
    kv = make_paged_kv(seq_lens, 3, head_dim, block_size, torch.float32, generator=gen)  # free slots hold NaN
    q = strided_queries(sum(q_lens), 3 * group, head_dim, torch.float32, gen)  # a view, as the model's
    cu = cu_seqlens(q_lens)
    out = paged_prefill_attention_cpu(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.3)
    for seq in range(len(seq_lens)):
        rows = slice(int(cu[seq]), int(cu[seq + 1]))
        expected = dense_attention_fp64(q[rows], kv.keys[seq], kv.values[seq], 0.3)  # 0.3: beyond N(0, 1)
        assert_close(out[rows], expected, torch.float32)
    reference = paged_prefill_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.3)
    torch.testing.assert_close(out, reference, atol=2e-6 * max(1, head_dim // 64), rtol=1e-5)


def test_a_rows_bits_do_not_depend_on_the_chunking_the_batch_or_the_threads() -> None:
    """A prompt of 150 tokens in one chunk, in chunks of 1, 16, 37 and 96 tokens (each after the keys of the ones
    before), beside another sequence or alone, on 1 to 3 threads: every row the same bits."""
    gen = torch.Generator().manual_seed(11)
    kv = make_paged_kv([150, 60], 3, 64, 16, torch.float32, generator=gen)
    q = strided_queries(210, 9, 64, torch.float32, gen)
    table, lens = kv.block_tables, kv.seq_lens
    whole = paged_prefill_attention_cpu(q, kv.k_cache, kv.v_cache, table, cu_seqlens([150, 60]), lens, 0.125)
    for chunk in (1, 16, 37, 96):
        for start in range(0, 150, chunk):
            end = min(start + chunk, 150)
            part = paged_prefill_attention_cpu(q[start:end], kv.k_cache, kv.v_cache, table[:1],
                                               cu_seqlens([end - start]), torch.tensor([end], dtype=torch.int32), 0.125)
            assert torch.equal(part, whole[start:end]), (chunk, start)
    for threads in (1, 3):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            again = paged_prefill_attention_cpu(q, kv.k_cache, kv.v_cache, table, cu_seqlens([150, 60]), lens, 0.125)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(again, whole), threads


def test_a_bf16_cache_gives_the_fp32_result_over_its_values_widened() -> None:
    # bf16 -> fp32 is exact: reading a bf16 cache is the fp32 kernel over the widened cache, to the bit
    gen = torch.Generator().manual_seed(5)
    kv = make_paged_kv([70, 20], 3, 64, 16, torch.bfloat16, generator=gen)
    q = strided_queries(50, 9, 64, torch.float32, gen)
    args = (kv.block_tables, cu_seqlens([30, 20]), kv.seq_lens, 0.3)
    narrow = paged_prefill_attention_cpu(q, kv.k_cache, kv.v_cache, *args)
    assert torch.equal(narrow, paged_prefill_attention_cpu(q, kv.k_cache.float(), kv.v_cache.float(), *args))
    bf16 = paged_prefill_attention_cpu(q.bfloat16(), kv.k_cache, kv.v_cache, *args)  # a bf16 model's query
    assert bf16.dtype == torch.bfloat16
    widened = paged_prefill_attention_cpu(q.bfloat16().float(), kv.k_cache, kv.v_cache, *args)
    assert torch.equal(bf16, widened.bfloat16())


def test_rows_past_the_chunks_are_left_unwritten_and_empty_chunks_are_skipped() -> None:
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([20, 10, 15, 8, 12], 1, 16, 8, torch.float32, generator=gen)
    q = strided_queries(20, 2, 16, torch.float32, gen)  # empty chunks first, between and last
    out = paged_prefill_attention_cpu(q, kv.k_cache, kv.v_cache, kv.block_tables, cu_seqlens([0, 10, 0, 8, 0]),
                                      kv.seq_lens, 0.5)
    assert_close(out[:10], dense_attention_fp64(q[:10], kv.keys[1], kv.values[1], 0.5), torch.float32)
    assert_close(out[10:18], dense_attention_fp64(q[10:18], kv.keys[3], kv.values[3], 0.5), torch.float32)
    assert out.shape == q.shape  # rows 18 and 19 (padding) are the caller's to ignore


def test_a_block_outside_the_cache_is_refused() -> None:
    gen = torch.Generator().manual_seed(4)
    kv = make_paged_kv([20], 1, 16, 8, torch.float32, generator=gen)
    q = strided_queries(20, 1, 16, torch.float32, gen)
    table = kv.block_tables.clone()
    table[0, 1] = kv.k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="outside the cache"):
        paged_prefill_attention_cpu(q, kv.k_cache, kv.v_cache, table, cu_seqlens([20]), kv.seq_lens, 1.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "seq_lens": torch.tensor([10], dtype=torch.int32)}, "negative or longer"),  # chunk > context
        (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 20])}, "cu_seqlens_q must be"),  # int64
        (lambda a: {**a, "cu_seqlens_q": torch.tensor([1, 20], dtype=torch.int32)}, "start at 0"),
        (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 21], dtype=torch.int32)}, "end within"),
        (lambda a: {**a, "q": a["q"].double()}, "fp32 CPU tensor"),
        (lambda a: {**a, "q": a["q"][:, :, ::2]}, "do not fit|contiguous"),
    ],
)
def test_inputs_it_cannot_read_are_refused(change: Callable[[dict[str, Any]], dict[str, Any]], message: str) -> None:
    gen = torch.Generator().manual_seed(6)
    kv = make_paged_kv([20], 1, 16, 8, torch.float32, generator=gen)
    args = {"q": strided_queries(20, 2, 16, torch.float32, gen), "k_cache": kv.k_cache, "v_cache": kv.v_cache,
            "block_tables": kv.block_tables, "cu_seqlens_q": cu_seqlens([20]), "seq_lens": kv.seq_lens, "scale": 1.0}
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention_cpu(**change(args))
