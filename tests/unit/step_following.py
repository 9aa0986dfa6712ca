"""How the allocator model follows one apply_step batch, op by op, and what the executor's order reads back.

Within a step, from its first op that may copy or swap (HOLDS_BACK), freed blocks are handed out only after the
step; the model holds them back likewise.
"""

from __future__ import annotations

from allocator_model import AllocatorModel
from kv_cache_sim import NO_EFFECTS, Effects, KVCacheSim

from pagedserve.services.block_manager.contract import (
    AdmitOp,
    AdvanceOp,
    CommitOp,
    CreateOp,
    DecodeOp,
    ForkOp,
    FreeOp,
    Op,
    OpOutcome,
    ReserveOp,
    SpareOp,
    SwapInOp,
    SwapOutOp,
)
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.block_manager.step import apply_step

HOLDS_BACK = (ReserveOp, DecodeOp, SwapOutOp, SwapInOp)  # from the first of these, freed blocks wait for the next step


def run_step(manager: BlockManager, model: AllocatorModel, kv: KVCacheSim,
             ops: list[Op]) -> tuple[list[OpOutcome], list[str]]:
    """Applies a valid batch and follows it op by op; returns what an executor running the step's copies
    and swaps before its writes reads back wrongly (nothing, when op order and executor order agree)."""
    kv_before = kv.clone()
    outcomes = apply_step(manager, ops)
    assert len(outcomes) == len(ops)
    refused: set[int] = set()
    step_effects = []
    for op, outcome in zip(ops, outcomes, strict=True):
        if isinstance(op, HOLDS_BACK) and model.held is None:
            model.hold_back()
        effects = follow_op(model, op, outcome, refused)
        kv.apply(effects)  # op by op: the bookkeeping itself must be exact
        if isinstance(op, AdvanceOp):  # the frontend's own slots, written by the steps it sent them in
            kv_before.apply(effects)
        else:
            step_effects.append(effects)
    model.end_step()
    kv_before.apply_step_as_executor(step_effects)
    return outcomes, kv_before.mismatches(model)


def follow_op(model: AllocatorModel, op: Op, outcome: OpOutcome, refused: set[int]) -> Effects:
    """Checks one op's outcome against the model (with the step's refusal cascade) and follows it."""
    if not outcome.granted:
        assert not (outcome.deltas or outcome.slot_mapping or outcome.copies or outcome.swap_out
                    or outcome.swap_in), f"refused {op} returned work: {outcome}"
    assert isinstance(op, SwapOutOp) or not outcome.swap_out, f"{op} returned swap-out copies"
    assert isinstance(op, SwapInOp) or not outcome.swap_in, f"{op} returned swap-in copies"
    assert isinstance(op, ReserveOp | DecodeOp) or not outcome.copies, f"{op} returned copy-on-write copies"
    assert isinstance(op, DecodeOp | SpareOp) or not outcome.refused_seq_ids
    if isinstance(op, FreeOp):
        refused.discard(op.seq_id)
        assert outcome.granted
        if op.seq_id in model.seqs:
            model.free(op.seq_id)
        return NO_EFFECTS
    if isinstance(op, DecodeOp):  # per sequence: blocked ones count as refused, the others decode
        assert outcome.granted
        effects = model.decode(list(op.seq_ids), list(op.token_ids), refused & set(op.seq_ids),
                                    outcome.slot_mapping, outcome.copies, outcome.deltas,
                                    outcome.refused_seq_ids)
        refused |= set(outcome.refused_seq_ids)
        return effects
    subjects = {op.parent_seq_id, op.child_seq_id} if isinstance(op, ForkOp) else (
        set(op.seq_ids) if isinstance(op, SwapOutOp | SwapInOp | AdvanceOp | SpareOp) else {op.seq_id})
    if refused & subjects:
        assert not outcome.granted, f"{op} applied after an earlier op on its sequence was refused"
        refused |= subjects
        return NO_EFFECTS
    effects = NO_EFFECTS
    match op:
        case CreateOp():
            assert outcome.granted
            model.create(op.seq_id, list(op.token_ids), op.cache_namespace, outcome.num_cached_tokens,
                              outcome.deltas)
        case AdmitOp():
            effects = model.admit(op.seq_id, list(op.token_ids), op.cache_namespace, op.max_tokens,
                                       outcome.granted, outcome.num_cached_tokens, len(outcome.slot_mapping),
                                       outcome.slot_mapping, outcome.deltas)
        case ForkOp():
            assert outcome.granted
            model.fork(op.parent_seq_id, op.child_seq_id, outcome.deltas)
        case ReserveOp():
            effects = model.reserve(op.seq_id, op.num_tokens, list(op.append_token_ids), op.admission,
                                         outcome.granted, outcome.slot_mapping, outcome.copies, outcome.deltas)
        case CommitOp():
            assert outcome.granted
            model.commit(op.seq_id, op.num_computed_tokens)
        case AdvanceOp():
            assert outcome.granted
            told, writes = 0, []
            for seq_id, num_slots, num_tokens in zip(op.seq_ids, op.num_slots, op.num_tokens, strict=True):
                writes += model.advance(seq_id, num_slots, list(op.token_ids[told : told + num_tokens])).writes
                told += num_tokens
            effects = Effects([], [], writes)
        case SpareOp():
            assert outcome.granted
            effects = model.spare(list(op.seq_ids), outcome.deltas, outcome.refused_seq_ids)
        case SwapOutOp():
            effects = model.swap_out(list(op.seq_ids), outcome.granted, outcome.swap_out, outcome.deltas)
        case SwapInOp():
            effects = model.swap_in(list(op.seq_ids), outcome.granted, outcome.swap_in, outcome.deltas)
    if not outcome.granted:
        refused |= subjects
    return effects
