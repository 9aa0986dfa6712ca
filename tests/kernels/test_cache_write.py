"""cache_write and its reference: valid slots land where the slot says, padding slots write nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_testing import DEVICE

from pagedserve.kernels import cache_write, cache_write_ref

WRITERS = {"triton": cache_write, "torch": cache_write_ref}
SENTINEL = 7.0


@pytest.mark.parametrize("writer", WRITERS.values(), ids=WRITERS.keys())
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize(
    ("dtype", "num_kv_heads", "head_dim", "block_size"),
    [(torch.float16, 2, 64, 16), (torch.bfloat16, 3, 80, 8), (torch.float32, 8, 128, 32)],
)
def test_writes_valid_slots_and_skips_padding(
    writer: Callable[..., None], strided: bool, dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads)
    num_blocks = 6
    # Tokens in shuffled slots across blocks, with padding (-1, and another negative) in between.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9].tolist()
    slots[2] = -1
    slots[6] = -5
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    # key/value are views into a fused QKV-like tensor, as the executor produces them.
    fused = torch.randn(len(slots), 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if strided:  # K and V interleaved per block in one tensor: neither cache is contiguous
        kv = torch.full((num_blocks, 2, *shape[1:]), SENTINEL, dtype=dtype, device=DEVICE)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.full(shape, SENTINEL, dtype=dtype, device=DEVICE)
        v_cache = torch.full_like(k_cache, SENTINEL)

    writer(key, value, k_cache, v_cache, slot_mapping)

    expected_k = torch.full_like(k_cache, SENTINEL)
    expected_v = torch.full_like(v_cache, SENTINEL)
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[token]
            expected_v[slot // block_size, slot % block_size] = value[token]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_rejects_int32_slot_mapping() -> None:
    k_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    key = torch.zeros(3, 1, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="int64"):
        cache_write(key, key, k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.int32, device=DEVICE))
