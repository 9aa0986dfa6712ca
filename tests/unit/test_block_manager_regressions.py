"""Plain properties of the block-manager core, and regression tests of the bugs the stateful test found,
driven through the stateful machine by hand (`harness`): every step is checked against the allocator model,
and a step the validator accepts must read back the same in the executor's order."""

from __future__ import annotations

import re

import pytest
import test_block_manager_stateful as stateful
from hypothesis import given, settings
from hypothesis import strategies as st
from step_drawing import VOCAB, sealed_message
from step_following import run_step

from pagedserve.services.block_manager.contract import (
    MAX_UNTOLD_SLOTS,
    NO_TOKEN,
    AdmitOp,
    BlockCopy,
    CommitOp,
    CreateOp,
    DecodeOp,
    ForkOp,
    FreeOp,
    InvalidStep,
    Op,
    OpOutcome,
    ReserveOp,
    SwapInOp,
    SwapOutOp,
)
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.block_manager.step import apply_step

namespaces = stateful.namespaces


# ---- plain properties ----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=4), spare=st.integers(0, 3), data=st.data())
def test_free_queue_hands_out_unhashed_blocks_first_then_cached_ones_least_recently_freed(
    lengths: list[int], spare: int, data: st.DataObject
) -> None:
    bs = 2
    ns_a, ns_b = namespaces(bs)
    prompts = [[10 * i + j for j in range(n)] for i, n in enumerate(lengths)]  # no two share a prefix
    num_blocks = sum(-(-n // bs) for n in lengths) + spare
    m = BlockManager(num_blocks, bs, 0, 0.0)
    for seq_id, prompt in enumerate(prompts):
        m.create(seq_id, prompt, ns_a)
        assert m.reserve(seq_id, len(prompt), admission=True).granted
        m.commit(seq_id, len(prompt))
    held = {b for seq_id in range(len(prompts)) for b in m.block_table(seq_id)}
    never_used = [b for b in range(num_blocks) if b not in held]
    unhashed: list[int] = []  # expected queue: unhashed (last freed first), never used, cached (least recent first)
    cached: list[int] = []
    for seq_id in data.draw(st.permutations(range(len(prompts))), label="free order"):
        table, num_full = m.block_table(seq_id), len(prompts[seq_id]) // bs
        m.free(seq_id)
        for index in reversed(range(len(table))):  # a sequence is freed tail first
            if index < num_full:
                cached.append(table[index])
            else:
                unhashed.insert(0, table[index])
    # a prefix hit takes cached blocks out of the queue; freed again, they are the most recently used
    for seq_id in data.draw(st.lists(st.sampled_from(range(len(prompts))), unique=True, max_size=2), label="hits"):
        created = m.create(100 + seq_id, prompts[seq_id], ns_a)
        hit = m.block_table(100 + seq_id)
        assert created.num_cached_tokens == len(hit) * bs == (len(prompts[seq_id]) - 1) // bs * bs
        m.free(100 + seq_id)
        cached = [b for b in cached if b not in hit] + hit[::-1]
    # hand out every block, one per reservation, to a sequence of the other namespace (which hits nothing)
    m.create(999, [7] * (num_blocks * bs), ns_b)
    handed_out: list[int] = []
    for _ in range(num_blocks):
        reservation = m.reserve(999, bs)
        assert reservation.granted and reservation.delta is not None
        handed_out += reservation.delta.append
    assert handed_out == unhashed + never_used + cached
    assert m.stats().num_evictions == len(cached)
    m.check_integrity()


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(VOCAB, min_size=1, max_size=9), block_size=st.integers(2, 4))
def test_a_prefix_is_shared_within_its_namespace_only(prompt: list[int], block_size: int) -> None:
    ns_a, ns_b = namespaces(block_size)
    m = BlockManager(16, block_size)
    m.create(1, prompt, ns_a)
    m.reserve(1, len(prompt))
    m.commit(1, len(prompt))
    assert m.create(2, prompt, ns_b).num_cached_tokens == 0
    assert m.create(3, prompt, ns_a).num_cached_tokens == (len(prompt) - 1) // block_size * block_size
    m.check_integrity()


# ---- regressions ---------------------------------------------------------------------------------------


def harness(num_blocks: int = 8, block_size: int = 4, num_cpu_blocks: int = 4) -> stateful.BlockManagerMachine:
    machine = stateful.BlockManagerMachine()
    machine.setup(num_blocks=num_blocks, block_size=block_size, num_cpu_blocks=num_cpu_blocks, watermark=0.0)
    return machine


def run_sound(machine: stateful.BlockManagerMachine, ops: list[Op]) -> list[OpOutcome]:
    """Runs a valid step: the model agrees, and the executor's order reads back what op order does."""
    outcomes = machine.do_step(ops)
    machine.check()
    return outcomes


def assert_rejected(machine: stateful.BlockManagerMachine, ops: list[Op], message: str) -> None:
    """The step raises InvalidStep with this message, and changes nothing."""
    before = machine.snapshot()
    with pytest.raises(InvalidStep, match=re.escape(message)):
        run_step(machine.manager, machine.model, machine.kv, ops)
    assert machine.snapshot() == before
    machine.check()


def assert_sealed(machine: stateful.BlockManagerMachine, ops: list[Op], where: str, seq_id: int, why: str) -> None:
    """Rejected because the op at `where` names a sequence sealed earlier in the step."""
    assert_rejected(machine, ops, f"{where}: {sealed_message(seq_id, why)}")


def test_step_fork_after_reserve_is_rejected() -> None:
    """Was accepted: the child's copy-on-write copy of the shared tail (3 slots) ran, in the executor's order,
    before the forward pass wrote slot 2 of it, so the child read stale KV."""
    machine = harness()
    ns = machine.namespaces[0]
    run_sound(machine, [AdmitOp(1, [0, 1, 2], ns, 2)])
    ops: list[Op] = [ReserveOp(1, 1), ForkOp(1, 2), ReserveOp(2, 1, [3])]
    assert_sealed(machine, ops, "ops[1].fork.parent_seq_id", 1, "reserved slots")
    run_sound(machine, ops[:1])  # the same ops over two steps are sound
    outcomes = run_sound(machine, ops[1:])
    assert outcomes[1].copies == [BlockCopy(machine.manager.block_table(1)[0], machine.manager.block_table(2)[0], 3)]


def test_step_swap_out_after_reserve_is_rejected() -> None:
    """Was accepted: the swap-out copied the tail before the forward pass wrote its slot 2."""
    machine = harness()
    run_sound(machine, [AdmitOp(1, [0, 1, 2], machine.namespaces[0], 2)])
    assert_sealed(machine, [ReserveOp(1, 1), SwapOutOp([1])], "ops[1].swap_out.seq_ids", 1, "reserved slots")
    assert_sealed(machine, [DecodeOp([1], [5]), SwapOutOp([1])], "ops[1].swap_out.seq_ids", 1,
                    "reserved slots (decode)")
    run_sound(machine, [ReserveOp(1, 1)])
    assert run_sound(machine, [SwapOutOp([1])])[0].granted


def test_step_free_after_reserve_is_rejected() -> None:
    """Was accepted: seq 2 copied the shared tail into a fresh block and was freed; seq 3 swapped into that
    block, and the executor, which swaps in before it copies, gave seq 3 seq 2's KV."""
    machine = harness()
    ns = machine.namespaces[0]
    run_sound(machine, [AdmitOp(1, [0, 1, 2], ns, 3), AdmitOp(3, [5, 5], ns, 2)])
    run_sound(machine, [SwapOutOp([3]), ForkOp(1, 2)])
    ops: list[Op] = [ReserveOp(2, 1, [7]), FreeOp(2), SwapInOp([3])]
    assert_sealed(machine, ops, "ops[1].free.seq_id", 2, "reserved slots")
    outcomes = run_sound(machine, [ops[0], ops[2]])
    assert outcomes[0].copies and all(o.granted for o in outcomes)
    run_sound(machine, [ops[1]])


def test_step_reserve_after_a_create_that_hits_the_cache_is_rejected() -> None:
    """Was accepted: the validator shadowed seq 2 as 0 slots, but it got 4 cached tokens, so the manager
    raised ValueError halfway through the step, with seq 2 already created."""
    machine = harness()
    ns = machine.namespaces[0]
    run_sound(machine, [AdmitOp(1, [0, 1, 2, 3, 4], ns, 5)])
    run_sound(machine, [CommitOp(1, 5)])
    create = CreateOp(2, [0, 1, 2, 3, 9], ns)
    assert_sealed(machine, [create, ReserveOp(2, 5)], "ops[1].reserve.seq_id", 2, "was created")
    assert_sealed(machine, [create, FreeOp(2)], "ops[1].free.seq_id", 2, "was created")
    assert_sealed(machine, [AdmitOp(2, [0, 1, 2, 3, 9], ns, 1), FreeOp(2)], "ops[1].free.seq_id", 2, "was admitted")
    assert 2 not in machine.manager.seqs
    assert run_sound(machine, [create])[0].num_cached_tokens == 4
    assert run_sound(machine, [ReserveOp(2, 1)])[0].slot_mapping


def test_decode_after_a_refusal_in_the_same_step() -> None:
    """Used to recurse forever: any DecodeOp after any refusal of the step. Now it decodes the others and
    reports the sequences an earlier refusal blocked as refused."""
    machine = harness(num_blocks=2, block_size=2, num_cpu_blocks=1)
    ns = machine.namespaces[0]
    run_sound(machine, [AdmitOp(3, [4, 4], ns, 2), AdmitOp(2, [1], ns, 1)])
    run_sound(machine, [SwapOutOp([3]), CreateOp(1, [0, 0, 0, 0, 0], ns)])
    run_sound(machine, [ReserveOp(1, 2)])  # no block left
    table_2 = machine.manager.block_table(2)
    outcomes = run_sound(machine, [ReserveOp(1, 3), SwapInOp([3]), DecodeOp([2, 3], [3, 3])])
    assert [o.granted for o in outcomes] == [False, False, True]
    assert outcomes[2].refused_seq_ids == [3]  # blocked by its refused swap-in
    assert outcomes[2].slot_mapping == [table_2[0] * 2 + 1]  # seq 2 decoded into its tail
    assert machine.manager.get(2).token_ids == [1, 3] and machine.manager.get(3).is_swapped


def test_swap_in_counts_a_revived_cached_block_once() -> None:
    """Was refused: two cpu blocks of one content reuse one cached device block, which swap_in counted twice."""
    machine = harness(num_blocks=4, block_size=2, num_cpu_blocks=4)
    ns = machine.namespaces[0]
    # two sequences compute the same prompt separately: one registers its first block, both know its key
    run_sound(machine, [CreateOp(1, [0, 0, 1], ns), CreateOp(2, [0, 0, 1], ns)])
    run_sound(machine, [ReserveOp(1, 3), ReserveOp(2, 3)])
    run_sound(machine, [CommitOp(1, 3), CommitOp(2, 3)])
    cached = machine.manager.block_table(1)[0]
    run_sound(machine, [SwapOutOp([1, 2])])
    run_sound(machine, [AdmitOp(3, [3], ns, 1)])
    assert machine.manager.stats().num_free_blocks == 3  # 1 of them cached
    (swap_in,) = run_sound(machine, [SwapInOp([1, 2])])  # the cached block plus two tails: 3 blocks
    assert swap_in.granted and len(swap_in.swap_in) == 2
    assert machine.manager.block_table(1)[0] == machine.manager.block_table(2)[0] == cached


def test_step_swap_in_after_the_source_of_a_copy_on_write_copy_is_freed() -> None:
    """Was unsound: seq 2 copied the tail it shared with seq 1, freeing seq 1 freed that source block, and
    seq 3 swapped into it; the executor swaps in before it copies, so seq 2 copied seq 3's KV. Blocks freed
    after the first op of a step that may copy or swap are now handed out only after the step."""
    machine = harness()
    ns = machine.namespaces[0]
    run_sound(machine, [AdmitOp(1, [0, 1, 2], ns, 3), AdmitOp(3, [5, 5], ns, 2)])
    run_sound(machine, [SwapOutOp([3]), ForkOp(1, 2)])
    source = machine.manager.block_table(1)[-1]
    outcomes = run_sound(machine, [ReserveOp(2, 1, [7]), FreeOp(1), SwapInOp([3])])
    assert [c.src for c in outcomes[0].copies] == [source] and outcomes[2].granted
    assert source not in [c.dst for c in outcomes[2].swap_in]


def test_step_swap_out_after_a_swap_in() -> None:
    """Was unsound: seq 1's swap-in freed cpu block 0 and seq 2's swap-out took it; the executor runs every
    swap-out of a step first, so seq 1 was swapped in from seq 2's KV. Now the freed cpu block waits for the
    next step, and a sequence swapped in cannot be swapped out in the same step."""
    machine = harness(num_cpu_blocks=1)
    ns = machine.namespaces[0]
    run_sound(machine, [AdmitOp(1, [0, 1], ns, 2), AdmitOp(2, [5, 5], ns, 2)])
    run_sound(machine, [SwapOutOp([1])])
    assert_rejected(machine, [SwapInOp([1]), SwapOutOp([1])], "ops[1].swap_out.seq_ids: sequence 1 was swapped in"
                    " earlier in this step; it can be swapped out in the next")
    outcomes = run_sound(machine, [SwapInOp([1]), SwapOutOp([2])])
    assert outcomes[0].granted and not outcomes[1].granted  # the only cpu block is held back
    assert run_sound(machine, [SwapOutOp([2])])[0].granted


@settings(max_examples=80, deadline=None)
@given(block_size=st.integers(2, 4), prompts=st.lists(st.lists(VOCAB, min_size=1, max_size=9), min_size=1, max_size=3),
       fork=st.booleans(), num_steps=st.integers(1, 12), lag=st.integers(1, MAX_UNTOLD_SLOTS), data=st.data())
def test_decodes_told_late_end_where_decodes_told_at_once_end(
    block_size: int, prompts: list[list[int]], fork: bool, num_steps: int, lag: int, data: st.DataObject
) -> None:
    """Overlapped steps tell each sampled token one or two decodes late (NO_TOKEN first): the slots, copies and
    table changes are those of decodes that know each token at once, and once the last tokens are told both
    managers are in the same state: tokens, tables, block keys, prefix cache, statistics. A NO_TOKEN beyond
    MAX_UNTOLD_SLOTS untold slots is refused."""
    serial, late = BlockManager(64, block_size), BlockManager(64, block_size)
    namespace = namespaces(block_size)[0]
    seq_ids = list(range(1, len(prompts) + 1))
    for manager in (serial, late):
        for seq_id, prompt in zip(seq_ids, prompts, strict=True):
            assert manager.admit(seq_id, prompt, namespace, len(prompt)).granted
        if fork:
            manager.fork(1, 99)
    seq_ids += [99] if fork else []
    untold: list[list[int]] = [[NO_TOKEN] * len(seq_ids)] * lag  # the tokens of the steps in flight, oldest first
    for step in range(num_steps):
        tokens = data.draw(st.lists(VOCAB, min_size=len(seq_ids), max_size=len(seq_ids)), label=f"step {step}")
        at_once, late_ones = serial.decode(seq_ids, tokens), late.decode(seq_ids, untold[0])
        assert at_once == late_ones
        serial.check_integrity()
        late.check_integrity()
        untold = [*untold[1:], tokens]
    if min(num_steps, lag) == MAX_UNTOLD_SLOTS:  # it holds as many untold slots as it may
        with pytest.raises(InvalidStep, match="not told yet"):
            apply_step(late, [DecodeOp(seq_ids[:1], [NO_TOKEN])])
    for i, seq_id in enumerate(seq_ids):  # the last tokens arrive; both commit what they hold
        late.reserve(seq_id, 0, [tokens[i] for tokens in untold if tokens[i] != NO_TOKEN])
        for manager in (serial, late):
            manager.commit(seq_id, manager.seqs[seq_id].num_slots)
    assert stateful_snapshot(serial) == stateful_snapshot(late)
    late.check_integrity()


def stateful_snapshot(manager: BlockManager) -> tuple[object, ...]:
    seqs = [(i, s.token_ids, s.num_slots, s.num_computed, manager.block_table(i), s.block_hashes)
            for i, s in sorted(manager.seqs.items())]
    return manager.stats(), seqs, sorted(manager.pool.cached), [b.block_id for b in manager.pool.free_queue]
