"""copy_blocks (copy-on-write inside the device caches) and swap_blocks (CPU pool <-> device)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_testing import DEVICE

from pagedserve.kernels import copy_blocks, copy_blocks_ref, swap_blocks

COPIERS = {"triton": copy_blocks, "torch": copy_blocks_ref}


def random_cache(num_blocks: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if dtype == torch.uint8:  # e.g. an fp8 cache stored as bytes
        return torch.randint(0, 256, (num_blocks, 4, 2, 32), generator=gen, dtype=torch.uint8).to(device)
    return torch.randn(num_blocks, 4, 2, 32, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("copier", COPIERS.values(), ids=COPIERS.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_copies_every_pair_in_every_cache(copier: Callable[..., None], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    caches = [random_cache(8, dtype, gen, DEVICE) for _ in range(4)]  # two layers, K and V each
    before = [cache.clone() for cache in caches]
    pairs = [(2, 5), (7, 0), (1, 3)]

    copier(caches, torch.tensor(pairs, dtype=torch.int64, device=DEVICE))

    for cache, original in zip(caches, before, strict=True):
        expected = original.clone()
        for src, dst in pairs:
            expected[dst] = original[src]
        assert torch.equal(cache, expected)


def test_copy_of_no_pairs_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(1)
    caches = [random_cache(3, torch.float16, gen, DEVICE)]
    before = caches[0].clone()
    copy_blocks(caches, torch.empty(0, 2, dtype=torch.int64, device=DEVICE))
    assert torch.equal(caches[0], before)


def test_swap_out_and_back_in() -> None:
    gen = torch.Generator().manual_seed(2)
    device_cache = random_cache(6, torch.bfloat16, gen, DEVICE)
    cpu_pool = torch.zeros(4, *device_cache.shape[1:], dtype=torch.bfloat16)
    swap_blocks(device_cache, cpu_pool, torch.tensor([[5, 0], [1, 3]], dtype=torch.int64))  # swap out
    assert torch.equal(cpu_pool[0], device_cache[5].cpu()) and torch.equal(cpu_pool[3], device_cache[1].cpu())
    assert torch.all(cpu_pool[1:3] == 0)

    restored = torch.zeros_like(device_cache)
    swap_blocks(cpu_pool, restored, torch.tensor([[0, 2], [3, 4]], dtype=torch.int64))  # swap in elsewhere
    assert torch.equal(restored[2], device_cache[5]) and torch.equal(restored[4], device_cache[1])
    assert torch.all(restored[[0, 1, 3, 5]] == 0)
