"""Builders and oracles shared by the kernel tests (a plain module: the tests import it by name)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (atol, rtol) of a kernel against its fp32 reference: 16-bit inputs lose precision in the output
# rounding and in the probabilities cast to the input dtype before the P @ V product.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim], the contiguous truth
    values: list[torch.Tensor]


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    generator: torch.Generator,
    interleaved: bool = False,
    spare_blocks: int = 3,
) -> PagedKV:
    """Random K/V per sequence, scattered token by token into shuffled blocks of NaN-filled caches.

    Every slot no sequence owns (spare blocks, tails of last blocks) holds NaN, and block-table entries
    past a sequence's blocks alternate between -1 and a huge id: a kernel that reads any of them fails.
    With `interleaved`, K and V are views of one [num_blocks, 2, ...] tensor (non-contiguous caches).
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    kv = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 2
    block_tables = torch.empty(len(seq_lens), max_blocks, dtype=torch.int32)
    block_tables[:, 0::2] = -1
    block_tables[:, 1::2] = 2**31 - 1
    keys, values = [], []
    for seq, seq_len in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(blocks_per_seq[seq])]
        block_tables[seq, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        for pos in range(seq_len):
            kv[ids[pos // block_size], 0, pos % block_size] = k[pos]
            kv[ids[pos // block_size], 1, pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
    kv = kv.to(DEVICE)
    k_cache, v_cache = (kv[:, 0], kv[:, 1]) if interleaved else (kv[:, 0].contiguous(), kv[:, 1].contiguous())
    return PagedKV(
        k_cache,
        v_cache,
        block_tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        keys,
        values,
    )


def strided_queries(
    num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], a view into a wider fused-QKV-like tensor
    fused = torch.randn(num_tokens, num_heads + 4, head_dim, generator=generator).to(dtype)
    return fused.to(DEVICE)[:, 2 : 2 + num_heads]


def dense_attention_fp64(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim] float64
    """softmax(q k^T * scale) v with an explicit causal mask: query i sits at seq_len - q_len + i."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q_len, num_heads, q.shape[2], dtype=torch.float64)
    q_pos = torch.arange(seq_len - q_len, seq_len)
    visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
    for head in range(num_heads):
        kh = k[:, head // group].double()  # [seq_len, head_dim]
        vh = v[:, head // group].double()
        scores = (q[:, head].double() @ kh.T) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, head] = torch.softmax(scores, dim=-1) @ vh
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)
