"""A sequence as the block manager holds it: its tokens, its block table and how far the executor has got."""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_pool import KVBlock


@dataclass(eq=False)
class SequenceState:
    seq_id: int
    namespace: bytes
    token_ids: list[int]  # known tokens; with overlap, the last slot's token may be unknown yet (see decode)
    block_table: list[KVBlock] = field(default_factory=list)
    num_slots: int = 0  # tokens with a reserved slot (KV stored or about to be): <= len(token_ids) + MAX_UNTOLD_SLOTS
    # block_table covers the slots, plus at most one empty block past them: a spare (see BlockManager.spare)
    num_computed: int = 0  # tokens whose KV the executor has stored
    block_hashes: list[bytes] = field(default_factory=list)  # keys of the full computed blocks
    cpu_table: list[int] | None = None  # cpu block ids while swapped out

    @property
    def is_swapped(self) -> bool:
        return self.cpu_table is not None
