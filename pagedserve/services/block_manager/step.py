"""One scheduler step's worth of block-manager operations (contract.py), validated as a whole and then applied in
order.

The whole batch is validated against a shadow of the sequences it touches before anything changes, so a
malformed batch raises `InvalidStep` (naming the op and field) with no effect. A shortage of blocks is a
per-op refusal; once an op on a sequence is refused, later ops on that sequence in the same step are
refused too (they were planned assuming it succeeded), except Free, which always applies. An Advance reads
its sequences' tables as they were before the step, so no earlier op of the step may name them. The checks of an
op against a sequence's table are op_checks.py's, which the manager runs too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .contract import (
    MAX_NAMESPACE_BYTES,
    MAX_TOKEN_ID,
    MAX_UNTOLD_SLOTS,
    MIN_NAMESPACE_BYTES,
    NO_TOKEN,
    AdmitOp,
    AdvanceOp,
    CommitOp,
    CreateOp,
    DecodeOp,
    ForkOp,
    FreeOp,
    InvalidStep,
    Op,
    OpOutcome,
    ReserveOp,
    SpareOp,
    SwapInOp,
    SwapOutOp,
)
from .manager import BlockManager
from .op_checks import advance_problem, fork_problem, spare_problem


@dataclass(slots=True)
class _Shadow:
    swapped: bool
    num_known: int
    num_slots: int
    num_computed: int
    # Why no later op of this step may name the sequence: after a reservation, the executor writes its new
    # slots only after every copy, swap and free of the step, so a later fork, swap-out or free would see
    # (or hand out) blocks whose contents are not there yet; after a create, its slot count is unknown.
    sealed: str = ""
    swapped_in: bool = False


class _Validator:
    """Replays the ops on shadows of the sequences they touch, assuming every op is granted."""

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self.shadows: dict[int, _Shadow | None] = {}  # None: does not exist at this point of the step
        # Sequences whose only op so far is one decode: tracked without a shadow, since a step decodes
        # every running sequence and most are touched by nothing else.
        self.decoded_once: set[int] = set()
        self.advanced: set[int] = set()  # named by the step's Advance and no other op so far (a Spare may follow)
        self.forked: set[int] = set()  # children of this step's forks: their ids may name a sequence freed before

    def shadow(self, seq_id: int) -> _Shadow | None:
        if seq_id not in self.shadows:
            seq = self.manager.seqs.get(seq_id)
            shadow = None
            if seq is not None:
                shadow = _Shadow(seq.is_swapped, len(seq.token_ids), seq.num_slots, seq.num_computed)
            if shadow is not None and seq_id in self.decoded_once:
                shadow.sealed = "reserved slots (decode)"
            self.shadows[seq_id] = shadow
        return self.shadows[seq_id]

    def decode(self, seq_id: int, where: str) -> None:
        if seq_id in self.shadows or seq_id in self.decoded_once:
            self.existing(seq_id, where).sealed = "reserved slots (decode)"  # raises if sealed already
            return
        state = self.manager.seqs.get(seq_id)
        if state is None or state.cpu_table is not None:
            self.existing(seq_id, where)  # raises the precise error
        self.decoded_once.add(seq_id)

    def check_unknown_slot_is_free(self, seq_id: int, where: str) -> None:
        """A decode without a token reserves a slot for a token told later: a sequence holds MAX_UNTOLD_SLOTS
        such slots at most (a told decode keeps their count)."""
        shadow = self.shadows.get(seq_id)
        num_slots, num_known = (shadow.num_slots, shadow.num_known) if shadow else (
            self.manager.seqs[seq_id].num_slots, len(self.manager.seqs[seq_id].token_ids))
        if num_slots - num_known >= MAX_UNTOLD_SLOTS:
            raise InvalidStep(f"{where}: sequence {seq_id} already holds {num_slots - num_known} slots for tokens"
                              f" not told yet; this decode must tell one (NO_TOKEN is {NO_TOKEN})")

    def check_advance(self, op: AdvanceOp, where: str) -> None:
        """An Advance reads its sequences' tables as they are before the step: no earlier op may name them."""
        if not len(op.seq_ids) == len(op.num_slots) == len(op.num_tokens) or sum(op.num_tokens) != len(op.token_ids):
            raise InvalidStep(f"{where}: seq_ids, num_slots and num_tokens must match one to one, and token_ids"
                              f" hold sum(num_tokens) tokens ({len(op.seq_ids)}, {len(op.num_slots)},"
                              f" {len(op.num_tokens)}; {len(op.token_ids)} tokens)")
        if len(set(op.seq_ids)) != len(op.seq_ids):
            raise InvalidStep(f"{where}.seq_ids: duplicate sequence ids in {list(op.seq_ids)}")
        _check_token_ids(op.token_ids, f"{where}.token_ids")
        bs = self.manager.block_size
        for seq_id, num_slots, num_tokens in zip(op.seq_ids, op.num_slots, op.num_tokens, strict=True):
            if seq_id in self.shadows or seq_id in self.decoded_once:
                raise InvalidStep(f"{where}.seq_ids: sequence {seq_id} is named earlier in this step; its Advance"
                                  " must come first")
            shadow = self.existing(seq_id, f"{where}.seq_ids")
            table = self.manager.seqs[seq_id].block_table
            problem = advance_problem(seq_id, table, shadow.num_slots, num_slots, shadow.num_known + num_tokens, bs)
            if problem:
                raise InvalidStep(f"{where}.{problem[0]}: {problem[1]}")
            shadow.num_known += num_tokens
            shadow.num_slots = shadow.num_computed = shadow.num_slots + num_slots
            self.advanced.add(seq_id)

    def check_spare(self, op: SpareOp, where: str) -> None:
        """A spare goes past the table as it was before the step: no earlier op but an Advance may name them."""
        if len(set(op.seq_ids)) != len(op.seq_ids):
            raise InvalidStep(f"{where}.seq_ids: duplicate sequence ids in {list(op.seq_ids)}")
        bs = self.manager.block_size
        for seq_id in op.seq_ids:
            if (seq_id in self.shadows and seq_id not in self.advanced) or seq_id in self.decoded_once:
                raise InvalidStep(f"{where}.seq_ids: sequence {seq_id} is named earlier in this step by an op other"
                                  " than an Advance")
            shadow = self.existing(seq_id, f"{where}.seq_ids")
            problem = spare_problem(seq_id, self.manager.seqs[seq_id].block_table, shadow.num_slots, bs)
            if problem:
                raise InvalidStep(f"{where}.seq_ids: {problem}")
            shadow.sealed = "was given a spare"

    def existing(self, seq_id: int, where: str, resident: bool | None = True) -> _Shadow:
        shadow = self.shadow(seq_id)
        self.advanced.discard(seq_id)  # named by another op: no Spare may follow
        if shadow is None:
            raise InvalidStep(f"{where}: unknown sequence {seq_id}")
        if shadow.sealed:
            raise InvalidStep(f"{where}: sequence {seq_id} {shadow.sealed} earlier in this step; no other op may"
                              f" name it until the next step")
        if resident is not None and shadow.swapped == resident:
            raise InvalidStep(f"{where}: sequence {seq_id} is {'swapped out' if resident else 'not swapped out'}")
        return shadow

    def absent(self, seq_id: int, where: str) -> None:
        if self.shadow(seq_id) is not None:
            raise InvalidStep(f"{where}: sequence {seq_id} already exists")

    def check_new_sequence(self, seq_id: int, token_ids: Sequence[int], namespace: bytes, at: str) -> None:
        self.absent(seq_id, f"{at}.seq_id")
        if not token_ids:
            raise InvalidStep(f"{at}.token_ids: must not be empty")
        _check_token_ids(token_ids, f"{at}.token_ids")
        if not MIN_NAMESPACE_BYTES <= len(namespace) <= MAX_NAMESPACE_BYTES:
            raise InvalidStep(
                f"{at}.cache_namespace: must be {MIN_NAMESPACE_BYTES} to {MAX_NAMESPACE_BYTES} bytes,"
                f" got {len(namespace)}"
            )

    def check(self, index: int, op: Op) -> None:
        at = f"ops[{index}]"
        match op:
            case CreateOp():
                self.check_new_sequence(op.seq_id, op.token_ids, op.cache_namespace, f"{at}.create")
                self.shadows[op.seq_id] = _Shadow(False, len(op.token_ids), 0, 0, sealed="was created")
            case AdmitOp():
                self.check_new_sequence(op.seq_id, op.token_ids, op.cache_namespace, f"{at}.admit")
                if op.max_tokens <= 0:
                    raise InvalidStep(f"{at}.admit.num_tokens: must be positive, got {op.max_tokens}")
                self.shadows[op.seq_id] = _Shadow(False, len(op.token_ids), 0, 0, sealed="was admitted")
            case ForkOp():
                parent = self.existing(op.parent_seq_id, f"{at}.fork.parent_seq_id")
                # its table as before the step (only a Spare adds a spare, and it seals), against its slots now (an
                # Advance may have taken the spare), unless swapped or forked since (then the table is not its own)
                state = self.manager.seqs.get(op.parent_seq_id)
                if (state is not None and not state.is_swapped and not parent.swapped_in
                        and op.parent_seq_id not in self.forked):
                    problem = fork_problem(op.parent_seq_id, state.block_table, parent.num_slots,
                                           self.manager.block_size)
                    if problem:
                        raise InvalidStep(f"{at}.fork.parent_seq_id: {problem}")
                self.absent(op.child_seq_id, f"{at}.fork.child_seq_id")
                # a child of a sequence swapped in by this step shares the blocks the step's swap-in writes
                self.shadows[op.child_seq_id] = _Shadow(False, parent.num_known, parent.num_slots, parent.num_computed,
                                                        swapped_in=parent.swapped_in)
                self.forked.add(op.child_seq_id)
            case ReserveOp():
                seq = self.existing(op.seq_id, f"{at}.reserve.seq_id")
                _check_token_ids(op.append_token_ids, f"{at}.reserve.append_token_ids")
                seq.num_known += len(op.append_token_ids)
                if op.num_tokens < 0 or seq.num_slots + op.num_tokens > seq.num_known:
                    raise InvalidStep(
                        f"{at}.reserve.num_tokens: {op.num_tokens} exceeds the {seq.num_known - seq.num_slots}"
                        f" known tokens of sequence {op.seq_id} without a slot"
                    )
                seq.num_slots += op.num_tokens
                seq.sealed = "reserved slots"
            case CommitOp():
                seq = self.existing(op.seq_id, f"{at}.commit.seq_id")
                if not seq.num_computed <= op.num_computed_tokens <= seq.num_slots:
                    raise InvalidStep(
                        f"{at}.commit.num_computed_tokens: {op.num_computed_tokens} outside"
                        f" [{seq.num_computed}, {seq.num_slots}] for sequence {op.seq_id}"
                    )
                seq.num_computed = op.num_computed_tokens
            case AdvanceOp():
                self.check_advance(op, f"{at}.advance")
            case SpareOp():
                self.check_spare(op, f"{at}.spare")
            case FreeOp():
                self.existing(op.seq_id, f"{at}.free.seq_id", resident=None)
                self.shadows[op.seq_id] = None
            case DecodeOp():
                if len(op.seq_ids) != len(op.token_ids) or len(set(op.seq_ids)) != len(op.seq_ids):
                    raise InvalidStep(
                        f"{at}.decode: seq_ids must be distinct and match token_ids one to one"
                        f" ({len(op.seq_ids)} seq_ids, {len(op.token_ids)} token_ids)"
                    )
                ids_at, tokens_at = f"{at}.decode.seq_ids", f"{at}.decode.token_ids"
                if op.token_ids and not NO_TOKEN <= min(op.token_ids) <= max(op.token_ids) <= MAX_TOKEN_ID:
                    _check_token_ids([t for t in op.token_ids if t != NO_TOKEN], tokens_at)  # names the bad one
                for seq_id, token in zip(op.seq_ids, op.token_ids, strict=True):  # every running sequence
                    self.decode(seq_id, ids_at)
                    if token == NO_TOKEN:
                        self.check_unknown_slot_is_free(seq_id, tokens_at)
            case SwapOutOp() | SwapInOp():
                name = "swap_out" if isinstance(op, SwapOutOp) else "swap_in"
                if not op.seq_ids or len(set(op.seq_ids)) != len(op.seq_ids):
                    raise InvalidStep(f"{at}.{name}.seq_ids: must be non-empty and distinct, got {list(op.seq_ids)}")
                for seq_id in op.seq_ids:
                    seq = self.existing(seq_id, f"{at}.{name}.seq_ids", resident=isinstance(op, SwapOutOp))
                    if isinstance(op, SwapOutOp) and seq.swapped_in:  # its blocks are written by this step
                        raise InvalidStep(f"{at}.swap_out.seq_ids: sequence {seq_id} was swapped in earlier in this"
                                          " step; it can be swapped out in the next")
                    seq.swapped = isinstance(op, SwapOutOp)
                    seq.swapped_in = not seq.swapped


def _check_token_ids(token_ids: Sequence[int], where: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise InvalidStep(f"{where}: token id {bad} is negative or too large")


def apply_step(manager: BlockManager, ops: Sequence[Op]) -> list[OpOutcome]:
    """Validates every op, then applies them in order; one outcome per op."""
    validator = _Validator(manager)
    for index, op in enumerate(ops):
        validator.check(index, op)
    refused: set[int] = set()
    outcomes = []
    holding_back = False
    try:
        for op in ops:
            # From the first op whose outcome the executor may read blocks for (a copy-on-write or a
            # swap), blocks freed in this step wait for the next one; frees before it need not wait.
            if not holding_back and isinstance(op, ReserveOp | DecodeOp | SwapOutOp | SwapInOp):
                manager.pool.begin_step()
                manager.cpu_pool.begin_step()
                holding_back = True
            outcomes.append(_apply(manager, op, refused))
    finally:
        if holding_back:
            manager.pool.end_step()
            manager.cpu_pool.end_step()
    return outcomes


def _apply(manager: BlockManager, op: Op, refused: set[int]) -> OpOutcome:
    if isinstance(op, FreeOp):
        refused.discard(op.seq_id)
        if op.seq_id in manager.seqs:
            manager.free(op.seq_id)
        return OpOutcome()
    if isinstance(op, DecodeOp):  # per sequence: the ones an earlier refusal blocked count as refused
        skipped = [seq_id for seq_id in op.seq_ids if seq_id in refused] if refused else []
        if skipped:
            keep = [i for i, seq_id in enumerate(op.seq_ids) if seq_id not in refused]
            op = DecodeOp([op.seq_ids[i] for i in keep], [op.token_ids[i] for i in keep])
        decoded = manager.decode(op.seq_ids, op.token_ids)
        refused.update(decoded.refused_seq_ids)
        return OpOutcome(deltas=decoded.deltas, slot_mapping=decoded.slot_mapping, copies=decoded.copies,
                         refused_seq_ids=skipped + decoded.refused_seq_ids)
    subjects = _subjects(op)
    blocked = refused.intersection(subjects)
    if blocked:
        refused.update(subjects)
        return OpOutcome(False, f"skipped: an earlier op on sequence {min(blocked)} in this step was refused")
    match op:
        case CreateOp():
            created = manager.create(op.seq_id, op.token_ids, op.cache_namespace)
            return OpOutcome(deltas=[created.delta], num_cached_tokens=created.num_cached_tokens)
        case AdmitOp():
            admission = manager.admit(op.seq_id, op.token_ids, op.cache_namespace, op.max_tokens)
            if not admission.granted:
                refused.add(op.seq_id)
                return OpOutcome(False, f"admission needs more than the {manager.pool.num_free_blocks} free blocks"
                                        f" less the {manager.watermark_blocks} held back by the watermark")
            assert admission.delta is not None
            return OpOutcome(deltas=[admission.delta], slot_mapping=admission.slot_mapping,
                             num_cached_tokens=admission.num_cached_tokens)
        case ForkOp():
            return OpOutcome(deltas=[manager.fork(op.parent_seq_id, op.child_seq_id)])
        case ReserveOp():
            seq = manager.seqs[op.seq_id]
            needed = manager.num_blocks_to_reserve(seq, op.num_tokens)
            reservation = manager.reserve(op.seq_id, op.num_tokens, op.append_token_ids, op.admission)
            if not reservation.granted:
                refused.add(op.seq_id)
                kept = f" ({manager.watermark_blocks} held back by the watermark)" if op.admission else ""
                return OpOutcome(
                    False, f"needs {needed} free blocks, {manager.pool.num_free_blocks} free{kept}"
                )
            deltas = [reservation.delta] if reservation.delta else []
            return OpOutcome(deltas=deltas, slot_mapping=reservation.slot_mapping, copies=reservation.copies)
        case CommitOp():
            manager.commit(op.seq_id, op.num_computed_tokens)
            return OpOutcome()
        case SpareOp():
            spares = manager.spare(op.seq_ids)
            return OpOutcome(deltas=[d for d in spares if d is not None],
                             refused_seq_ids=[s for s, d in zip(op.seq_ids, spares, strict=True) if d is None])
        case AdvanceOp():
            told = 0
            for seq_id, num_slots, num_tokens in zip(op.seq_ids, op.num_slots, op.num_tokens, strict=True):
                manager.advance(seq_id, num_slots, op.token_ids[told : told + num_tokens])
                told += num_tokens
            return OpOutcome()
        case SwapOutOp():
            result = manager.swap_out(op.seq_ids)
            if not result.granted:
                refused.update(op.seq_ids)
                return OpOutcome(False, f"cpu pool has {manager.cpu_pool.num_free_blocks} free blocks: too few")
            return OpOutcome(deltas=result.deltas, swap_out=result.copies)
        case SwapInOp():
            result = manager.swap_in(op.seq_ids)
            if not result.granted:
                refused.update(op.seq_ids)
                return OpOutcome(False, f"device has {manager.pool.num_free_blocks} free blocks: too few to swap in")
            return OpOutcome(deltas=result.deltas, swap_in=result.copies)
    raise AssertionError(f"unhandled op {op!r}")


def _subjects(op: Op) -> tuple[int, ...]:
    match op:
        case ForkOp():
            return (op.parent_seq_id, op.child_seq_id)
        case SwapOutOp() | SwapInOp() | DecodeOp() | AdvanceOp() | SpareOp():
            return tuple(op.seq_ids)
        case _:
            return (op.seq_id,)
