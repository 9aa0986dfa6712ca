"""KV memory kept per sequence: the `virtual` and `static` layouts (docs/layouts.md).

A sequence's K/V is one contiguous region `[num_layers, 2, capacity, num_kv_heads, head_dim]`: each layer's K
and each layer's V is a slab of `capacity` tokens, so dense attention reads `k[:seq_len]` without a block
table. `virtual` reserves the region's address space at max_model_len and lets memory be committed page by
page as the sequence grows (on the CPU the kernel commits a page at its first write; `release` hands the pages
back); `static` commits a max_model_len slot per sequence up front, the allocation paging replaced.

The block manager still admits and accounts: with the block size a whole number of pages of one slab, a
sequence's blocks and its committed pages are the same memory, so the block count bounds what is committed.
Neither layout can share KV between sequences (prefix hits, forks and copy-on-write would need copies): the
scheduler gives them none, and `check` refuses a step that assumes otherwise.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import torch

from ..common.errors import InvalidRequest
from .kv_regions import KVRegion, MappedRegion
from .step_types import SequenceInput

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def os_page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def transparent_hugepages() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"; "unknown" off Linux). Under
    "madvise" or "never" these regions get base pages (we never ask for huge ones): commits are page-sized."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def tokens_per_page(token_bytes: int, page_size: int) -> int:
    """The fewest tokens of one slab (one layer's K or V) that fill whole pages: the virtual layout's block
    size must be a multiple of it, so that a block is exactly the pages it commits."""
    return page_size // math.gcd(page_size, token_bytes)


class SequenceKV(ABC):
    """Where each sequence's contiguous K/V lives, for the dense attention path."""

    @abstractmethod
    def check(self, sequences: Sequence[SequenceInput], released: Iterable[int]) -> None:
        """Raises InvalidRequest unless every sequence's KV before its start position is held (after the
        releases): nothing changes when it does."""

    @abstractmethod
    def region_for(self, seq: SequenceInput) -> torch.Tensor:
        """The sequence's [num_layers, 2, capacity, num_kv_heads, head_dim], backed up to its step's end."""

    @abstractmethod
    def release(self, seq_ids: Iterable[int]) -> None:
        """The block manager freed these sequences: their memory goes back."""

    @abstractmethod
    def reset(self) -> None:
        """Forgets every sequence (the frontend starts over)."""

    committed_bytes: int  # KV memory held now


class VirtualKV(SequenceKV):
    """One region per live sequence, committed page by page. A released region keeps its address range for the
    next sequence (no munmap/mmap per request); its memory is returned at once."""

    def __init__(self, region_shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: torch.device,
                 page_size: int) -> None:
        self.region_shape, self.dtype, self.device, self.page_size = region_shape, dtype, device, page_size
        self.regions: dict[int, KVRegion] = {}  # by seq_id
        self.spare: list[KVRegion] = []
        self.num_page_commits = 0  # pages committed over the runner's life (first writes after a release too)
        self.committed_bytes = 0  # kept as regions grow and go, so that reading it never walks the regions
        self.peak_committed_bytes = 0

    def check(self, sequences: Sequence[SequenceInput], released: Iterable[int]) -> None:
        gone = set(released)
        for i, seq in enumerate(sequences):
            region = None if seq.seq_id in gone else self.regions.get(seq.seq_id)
            held = region.num_tokens if region is not None else 0
            if seq.start_position > held:
                raise InvalidRequest(
                    f"sequences[{i}].start_position: sequence {seq.seq_id} starts at {seq.start_position} but the"
                    f" virtual layout holds {held} of its tokens: it shares no KV (no prefix hits, forks or swaps)"
                )

    def region_for(self, seq: SequenceInput) -> torch.Tensor:
        region = self.regions.get(seq.seq_id)
        if region is None:
            region = self.spare.pop() if self.spare else self._new_region()
            self.regions[seq.seq_id] = region
        new_pages = region.ensure(seq.start_position + len(seq.token_ids))
        if new_pages:
            self.num_page_commits += new_pages
            self.committed_bytes += new_pages * self.page_size
            self.peak_committed_bytes = max(self.peak_committed_bytes, self.committed_bytes)
        return region.kv

    def _new_region(self) -> KVRegion:
        if self.device.type == "cuda":
            from .cuda_vmm import CudaVmmRegion  # the driver binding, only where it can be used

            return CudaVmmRegion(self.region_shape, self.dtype, self.device)
        return MappedRegion(self.region_shape, self.dtype, self.page_size)

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            region = self.regions.pop(seq_id, None)
            if region is not None:
                self.committed_bytes -= region.committed_bytes
                region.release()
                self.spare.append(region)

    def reset(self) -> None:
        self.release(list(self.regions))


class StaticKV(SequenceKV):
    """`num_slots` max_model_len slots, committed once; a sequence's one block id is its slot (the block size
    is max_model_len), so the block manager hands slots out and takes them back."""

    def __init__(self, num_slots: int, region_shape: tuple[int, int, int, int, int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots = torch.zeros((num_slots, *region_shape), dtype=dtype, device=device)  # touched: committed
        self.committed_bytes = self.slots.numel() * self.slots.element_size()

    def check(self, sequences: Sequence[SequenceInput], released: Iterable[int]) -> None:
        for i, seq in enumerate(sequences):
            if len(seq.block_table) != 1:
                raise InvalidRequest(f"sequences[{i}].block_table: a static slot is one block, got"
                                     f" {len(seq.block_table)}")

    def region_for(self, seq: SequenceInput) -> torch.Tensor:
        return self.slots[seq.block_table[0]]

    def release(self, seq_ids: Iterable[int]) -> None:
        pass  # the slot is the block: the block manager freed it

    def reset(self) -> None:
        pass
