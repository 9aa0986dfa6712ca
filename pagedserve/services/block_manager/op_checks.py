"""The read-only check of each op that reads a sequence's table, written once: the step validator runs it against
its shadow of the sequence (its counts as of that point of the step, its table as before the step) and the
manager against the sequence itself. Each check returns what is wrong (None when nothing is), and each caller
raises it in its own words for where (`ops[3].spare.seq_ids: ...` over the wire, `spare: ...` in process).
"""

from __future__ import annotations

from collections.abc import Sequence

from .block_pool import KVBlock
from .contract import MAX_UNTOLD_SLOTS


def holds_spare(num_blocks: int, num_slots: int, block_size: int) -> bool:
    """Whether a table of num_blocks blocks holds one past the blocks that the sequence's slots use: its spare."""
    return num_blocks * block_size - num_slots >= block_size


def next_slot_is_shared(table: Sequence[KVBlock], num_slots: int, block_size: int) -> bool:
    """Whether the sequence's next slot lies in a partly filled block it shares (with a fork): writing it needs a
    copy first. That block is `table[num_slots // block_size]`, not `table[-1]`, which may be a spare (though a
    shared partial tail never has one behind it)."""
    return num_slots % block_size != 0 and table[num_slots // block_size].ref_count > 1


def fork_problem(parent_id: int, table: Sequence[KVBlock], num_slots: int, block_size: int) -> str | None:
    """A fork shares every block of the parent's table: a spare is never shared."""
    if holds_spare(len(table), num_slots, block_size):
        return f"sequence {parent_id} holds a spare block (a spare is never shared)"
    return None


def spare_problem(seq_id: int, table: Sequence[KVBlock], num_slots: int, block_size: int) -> str | None:
    """A spare goes past the table's end, one at most, never behind a partial tail that a fork shares (its next
    slot needs a Decode's copy-on-write, which replaces that block)."""
    if holds_spare(len(table), num_slots, block_size):
        return f"sequence {seq_id} holds a spare already ({len(table)} blocks of {block_size} for {num_slots} slots)"
    if next_slot_is_shared(table, num_slots, block_size):
        return f"sequence {seq_id}'s tail block is shared (a fork); its next slot needs a Decode"
    return None


def advance_problem(seq_id: int, table: Sequence[KVBlock], num_slots: int, num_added_slots: int, num_known: int,
                    block_size: int) -> tuple[str, str] | None:
    """An Advance of num_added_slots past the sequence's num_slots, which then knows num_known tokens: the slots
    fit in its tail block and spare, the first of them is not in a shared block, and at most MAX_UNTOLD_SLOTS
    slots wait for their tokens. What is wrong comes as (the field at fault, why)."""
    end = num_slots + num_added_slots
    if num_added_slots < 0 or end > len(table) * block_size:
        return "num_slots", (f"sequence {seq_id} has {num_slots} slots in {len(table)} blocks of {block_size};"
                             f" {num_added_slots} more do not fit in its tail block and spare")
    if num_added_slots and next_slot_is_shared(table, num_slots, block_size):
        return "num_slots", f"sequence {seq_id}'s tail block is shared (a fork); its slots need a Decode"
    if end - num_known > MAX_UNTOLD_SLOTS:
        return "num_tokens", (f"sequence {seq_id} would hold {end - num_known} slots for tokens not told yet"
                              f" (at most {MAX_UNTOLD_SLOTS})")
    return None
