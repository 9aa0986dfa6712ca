"""A simulated KV cache for the stateful test: device and CPU blocks, one value per token slot.

The simulated KV of the token at position p is (namespace, token_ids[:p + 1]): what a real KV entry depends
on. So reading a sequence's table back also proves that a shared or cached block holds the same prefix, in
the same namespace, as the reader's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pagedserve.services.block_manager.contract import BlockCopy

if TYPE_CHECKING:
    from allocator_model import AllocatorModel

KV = tuple[bytes, tuple[int, ...]] | None  # what one slot holds; None: never written or stale


class Effects(NamedTuple):
    """What the executor must do for one op."""

    allocated: list[int]  # device blocks handed out: stale until copied into or written
    copies: list[tuple[str, BlockCopy]]  # ("cow" | "swap_out" | "swap_in", copy)
    writes: list[tuple[int, KV]]  # (slot, kv) for every reserved slot


NO_EFFECTS = Effects([], [], [])


class KVCacheSim:
    """Device and CPU KV tensors, one value per token slot, changed only as an executor would change them."""

    def __init__(self, num_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device: list[list[KV]] = [[None] * block_size for _ in range(num_blocks)]
        self.cpu: list[list[KV]] = [[None] * block_size for _ in range(num_cpu_blocks)]

    def clone(self) -> KVCacheSim:
        other = KVCacheSim(0, 0, self.block_size)
        other.device = [list(block) for block in self.device]
        other.cpu = [list(block) for block in self.cpu]
        return other

    def copy(self, kind: str, c: BlockCopy) -> None:
        src = self.cpu if kind == "swap_in" else self.device
        dst = self.cpu if kind == "swap_out" else self.device
        assert 0 < c.num_slots <= self.block_size, f"{kind} copy of {c.num_slots} slots"
        dst[c.dst][: c.num_slots] = src[c.src][: c.num_slots]

    def apply(self, effects: Effects) -> None:
        """One op on its own: fresh blocks hold stale data, copies come before writes."""
        for block_id in effects.allocated:
            self.device[block_id] = [None] * self.block_size
        for kind, c in effects.copies:
            self.copy(kind, c)
        for slot, kv in effects.writes:
            self.device[slot // self.block_size][slot % self.block_size] = kv

    def apply_step_as_executor(self, step: list[Effects]) -> None:
        """A whole step as executor.proto says the executor runs it: every swap-out of the step, then every
        swap-in, then every copy-on-write copy, then the forward pass's writes."""
        for kind in ("swap_out", "swap_in", "cow"):
            for effects in step:
                for copy_kind, c in effects.copies:
                    if copy_kind == kind:
                        self.copy(kind, c)
        for effects in step:
            for slot, kv in effects.writes:
                self.device[slot // self.block_size][slot % self.block_size] = kv

    def mismatches(self, model: AllocatorModel) -> list[str]:
        """Every position of every sequence whose table does not read back that sequence's own KV."""
        bs, wrong = self.block_size, []
        for seq_id, seq in sorted(model.seqs.items()):
            space, table = (self.device, seq.table) if seq.cpu_table is None else (self.cpu, seq.cpu_table)
            for p in range(seq.num_slots):
                got = space[table[p // bs]][p % bs]
                if got != seq.kv(p):
                    where = "device" if seq.cpu_table is None else "cpu"
                    wrong.append(f"seq {seq_id} position {p} ({where} block {table[p // bs]}): {got} != {seq.kv(p)}")
        return wrong
