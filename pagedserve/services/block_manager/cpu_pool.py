"""The CPU block pool that swapped-out sequences live in: ids and reference counts, nothing cached."""

from __future__ import annotations


class CpuBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_blocks}")
        self.ref_counts = [0] * num_blocks
        self._free_ids = list(range(num_blocks - 1, -1, -1))  # a stack: lowest id handed out first
        self._held_back: list[int] | None = None  # freed during a step: reusable after it (see BlockPool)

    def begin_step(self) -> None:
        self._held_back = []

    def end_step(self) -> None:
        held_back, self._held_back = self._held_back or [], None
        self._free_ids.extend(held_back)

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    def free_ids(self) -> list[int]:
        return list(self._free_ids)

    def allocate(self) -> int:
        block_id = self._free_ids.pop()
        self.ref_counts[block_id] = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"cpu block {block_id} acquired while free"
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"cpu block {block_id} released more often than acquired"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            (self._free_ids if self._held_back is None else self._held_back).append(block_id)

    def reset(self) -> None:
        self.ref_counts = [0] * self.num_blocks
        self._free_ids = list(range(self.num_blocks - 1, -1, -1))
