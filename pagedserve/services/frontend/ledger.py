"""What the block manager knows of each sequence, as the KV client tracks it, and the Advance that brings it level.

A sequence's ledger fields (`Sequence.num_known_to_manager`, `num_committed`, `num_local_slots`) are the
block manager's as of the last call sent, answered or not: a Decode's commit and told token count when it is
planned (a refused one's token is taken back when the answer is applied), an Advance when it is queued (it is
never refused). So an Advance queued between a call and its answer (for a sequence that just finished) is exact.
"""

from __future__ import annotations

from ..block_manager.contract import MAX_UNTOLD_SLOTS, NO_TOKEN, AdvanceOp, Op
from .request import Sequence


class PendingAdvance:
    """The next call's Advance, gathered sequence by sequence; it heads the call (no earlier op of a step may
    name its sequences)."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, list[int]]] = []  # (seq_id, slots placed, tokens told)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add(self, seq: Sequence) -> None:
        """The sequence's catch-up: the slots the scheduler placed in its tail block since the block manager last
        heard of it, their known tokens, and the commit of every slot. Nothing when it is level already."""
        told = seq.token_ids[seq.num_known_to_manager : seq.num_computed]
        if not (seq.num_local_slots or told or seq.num_committed < seq.num_computed):
            return
        self.entries.append((seq.seq_id, seq.num_local_slots, told))
        seq.num_known_to_manager += len(told)
        seq.num_committed = seq.num_computed
        seq.num_local_slots = 0

    def take(self, routes: list[tuple[Op, list[Sequence]]]) -> list[Op]:
        """The call's ops: the Advance first (put at the head of the routes too, about no sequence), then the
        routes'. The Advance is then sent: it starts empty again."""
        ops = [op for op, _ in routes]
        if self.entries:
            seq_ids, num_slots, told = zip(*self.entries, strict=True)
            ops.insert(0, AdvanceOp(seq_ids, num_slots, [len(t) for t in told], [t for ts in told for t in ts]))
            routes.insert(0, (ops[0], []))
            self.entries = []
        return ops

    def clear(self) -> None:
        self.entries = []


def decode_token(seq: Sequence) -> int | None:
    """For a one-token step: what its Decode tells the block manager (the oldest token it has not been told, or
    NO_TOKEN), or None when it cannot take the Decode fast path. A Decode tells at most one token, and leaves the
    sequence at most MAX_UNTOLD_SLOTS slots whose tokens are still being sampled (overlapped steps: plans run
    two steps ahead of the tokens)."""
    known, computed, token_ids = seq.num_known_to_manager, seq.num_computed, seq.token_ids
    num_untold = max(0, min(len(token_ids), computed + 1) - known)  # len(token_ids[known : computed + 1])
    if num_untold > 1 or computed + 1 - known - num_untold > MAX_UNTOLD_SLOTS:
        return None
    return token_ids[known] if num_untold else NO_TOKEN
