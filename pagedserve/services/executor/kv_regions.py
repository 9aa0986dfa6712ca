"""A sequence's K/V region for the per-sequence layouts (virtual_kv.py): the interface, and the CPU's.

The GPU's region (cuda_vmm.py) and the CPU's below implement `KVRegion`; `VirtualKV` picks one by device.
"""

from __future__ import annotations

import mmap
import platform
import sys
from abc import ABC, abstractmethod

import torch

# Python's mmap module names MAP_NORESERVE only from 3.13 on; 0x4000 is its value on Linux x86-64 and arm64.
# Without it, a region's whole reservation would count against the kernel's overcommit limit.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux"
                        and platform.machine() in ("x86_64", "aarch64") else 0)


class KVRegion(ABC):
    """One sequence's K/V, `kv` [num_layers, 2, capacity, num_kv_heads, head_dim]. Positions [0, num_tokens)
    are backed by memory; `ensure` backs more before they are written, `release` gives it all back."""

    kv: torch.Tensor
    num_tokens: int

    @abstractmethod
    def ensure(self, num_tokens: int) -> int:
        """Backs positions [0, num_tokens); returns how many pages that newly committed."""

    @abstractmethod
    def release(self) -> None:
        """Hands every committed page back; the address range stays reserved for the next sequence."""

    @property
    @abstractmethod
    def committed_bytes(self) -> int:
        """Memory backing the region now."""


class MappedRegion(KVRegion):
    """Anonymous private memory mapped with MAP_NORESERVE: address space only, until the kernel commits a page
    on its first write (a minor fault). `madvise(MADV_DONTNEED)` returns the pages; they read as zeros after."""

    def __init__(self, shape: tuple[int, int, int, int, int], dtype: torch.dtype, page_size: int) -> None:
        num_layers, two, capacity, num_kv_heads, head_dim = shape
        element = torch.empty((), dtype=dtype).element_size()
        self.slab_bytes = capacity * num_kv_heads * head_dim * element
        self.token_bytes = num_kv_heads * head_dim * element
        self.num_slabs = num_layers * two
        self.page_size = page_size
        assert self.slab_bytes % page_size == 0, "slabs must start on page boundaries (capacity rounds to pages)"
        self._map = mmap.mmap(-1, self.num_slabs * self.slab_bytes,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self.kv = torch.frombuffer(self._map, dtype=dtype).view(shape)  # shares the mapping, copies nothing
        self.num_tokens = 0

    def pages_per_slab(self, num_tokens: int) -> int:
        return -(-num_tokens * self.token_bytes // self.page_size)

    def ensure(self, num_tokens: int) -> int:
        # nothing to map: the forward pass's writes fault the pages in; this only keeps the count
        if num_tokens <= self.num_tokens:
            return 0
        new_pages = self.pages_per_slab(num_tokens) - self.pages_per_slab(self.num_tokens)
        self.num_tokens = num_tokens
        return new_pages * self.num_slabs

    def release(self) -> None:
        length = self.pages_per_slab(self.num_tokens) * self.page_size
        if length:
            for slab in range(self.num_slabs):
                self._map.madvise(mmap.MADV_DONTNEED, slab * self.slab_bytes, length)
        self.num_tokens = 0

    @property
    def committed_bytes(self) -> int:
        return self.pages_per_slab(self.num_tokens) * self.page_size * self.num_slabs
