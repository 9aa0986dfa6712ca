"""op_checks: the rules under the Advance, Spare and Fork checks, on hand-made tables (the stateful test and the
scenarios run them through the step validator and the manager)."""

from __future__ import annotations

from pagedserve.services.block_manager.block_pool import KVBlock
from pagedserve.services.block_manager.op_checks import (
    advance_problem,
    fork_problem,
    holds_spare,
    next_slot_is_shared,
    spare_problem,
)

BS = 4


def table(*ref_counts: int) -> list[KVBlock]:
    blocks = [KVBlock(block_id) for block_id in range(len(ref_counts))]
    for block, ref_count in zip(blocks, ref_counts, strict=True):
        block.ref_count = ref_count
    return blocks


def test_a_spare_is_a_whole_block_past_the_slots() -> None:
    assert [holds_spare(2, num_slots, BS) for num_slots in (3, 4, 5, 8)] == [True, True, False, False]
    assert not holds_spare(0, 0, BS) and holds_spare(1, 0, BS)


def test_the_shared_tail_is_the_block_of_the_next_slot_not_the_last_block() -> None:
    """With a spare, table[-1] is the spare (private): the block the next slot writes is table[num_slots // bs]."""
    assert next_slot_is_shared(table(2, 1), 3, BS)  # a partial shared tail, a spare behind it (never made so)
    assert not next_slot_is_shared(table(1, 2), 3, BS)
    assert not next_slot_is_shared(table(2, 1), 4, BS)  # a full tail: the next slot opens the spare


def test_each_op_s_problem_names_what_is_wrong() -> None:
    assert fork_problem(7, table(1, 1), 3, BS) == "sequence 7 holds a spare block (a spare is never shared)"
    assert fork_problem(7, table(1, 1), 5, BS) is None
    assert spare_problem(7, table(1, 1), 4, BS) == "sequence 7 holds a spare already (2 blocks of 4 for 4 slots)"
    assert spare_problem(7, table(2), 3, BS) == (
        "sequence 7's tail block is shared (a fork); its next slot needs a Decode")
    assert spare_problem(7, table(2), 4, BS) is None  # a full shared tail: the spare goes past it
    assert advance_problem(7, table(1, 1), 3, 6, 9, BS) == (
        "num_slots", "sequence 7 has 3 slots in 2 blocks of 4; 6 more do not fit in its tail block and spare")
    assert advance_problem(7, table(2), 3, 1, 4, BS) == (
        "num_slots", "sequence 7's tail block is shared (a fork); its slots need a Decode")
    assert advance_problem(7, table(1, 1), 3, 5, 5, BS) == (
        "num_tokens", "sequence 7 would hold 3 slots for tokens not told yet (at most 2)")
    assert advance_problem(7, table(1, 1), 3, 5, 6, BS) is None  # into the spare, 2 slots untold
    assert advance_problem(7, table(2), 3, 0, 3, BS) is None  # no slots: a commit only
