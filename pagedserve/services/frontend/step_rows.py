"""The executor's rows of a step from the scheduler's sequences: the per-sequence loops every step runs.

Each function advances the sequences it schedules as far as planning goes (`num_computed`; `num_pending` for one
that samples; `num_local_slots` for a decode the scheduler placed itself), appends their rows (`SequenceInput`) to
`inputs` and the sequences that sample to `sampled`, in the rows' order, which is the order of the executor's
answer. The steady decode step, the last step's batch again, needs no rows at all (fast_paths.py): the executor's
port fills them in from the batch it holds.
"""

from __future__ import annotations

import itertools

from ..block_manager.contract import AdmitOp, DecodeOp, Op, OpOutcome, ReserveOp
from ..executor.step_types import LAST_SAMPLED, SequenceInput, StepInput, new_row
from .request import SeqStatus, Sequence


def add_decodes(seqs: list[Sequence], slots: list[int] | None, block_size: int,
                inputs: list[SequenceInput], sampled: list[Sequence]) -> None:
    """The step's hot loop: every decoding sequence, every step (SequenceInput written out). A sequence that
    finished since the plan is left out (its slot goes with its blocks at the next call). No `slots`: the
    decodes the scheduler placed itself, each in a free slot of its own tail block (counted as local)."""
    finished, append_input, append_sampled = SeqStatus.FINISHED, inputs.append, sampled.append
    for seq, slot in zip(seqs, itertools.repeat(None, len(seqs)) if slots is None else slots, strict=True):
        if seq.status is finished:
            continue
        start, token_ids = seq.num_computed, seq.token_ids
        if slot is None:  # kv_geometry.slot_of written out: the call costs ~6 us a step at 256 decodes (+35 %)
            slot = seq.block_table[start // block_size] * block_size + start % block_size
            seq.num_local_slots += 1
        num_known = len(token_ids)
        seq.num_computed = start + 1  # from here on, as far as planning goes, it is computed
        token = token_ids[start] if start < num_known else LAST_SAMPLED  # else: being sampled
        if start + 1 == num_known + seq.num_pending:  # its next token is wanted
            seq.num_pending += 1
            append_sampled(seq)
            append_input(new_row(SequenceInput, (seq.seq_id, [token], start, seq.block_table, [slot],
                                                 seq.sampling)))
        else:
            append_input(new_row(SequenceInput, (seq.seq_id, [token], start, seq.block_table, [slot], None)))


def add_tokens(seq: Sequence, slot_mapping: list[int], inputs: list[SequenceInput],
               sampled: list[Sequence]) -> None:
    """The step's input for a sequence granted slots for its next tokens (a chunk, or a decode)."""
    start, num_tokens = seq.num_computed, len(slot_mapping)
    tokens = seq.token_ids[start : start + num_tokens] or [LAST_SAMPLED]  # being sampled by the last step
    sample = start + num_tokens == len(seq.token_ids) + seq.num_pending
    inputs.append(SequenceInput(seq.seq_id, tokens, start, seq.block_table, slot_mapping,
                                seq.sampling if sample else None))
    seq.num_computed = start + num_tokens  # from here on, as far as planning goes, it is computed
    if sample:
        seq.num_pending += 1
        sampled.append(seq)


class StepRows:
    """One step's rows and block moves, gathered from the block manager's answer op by op (in the order of the
    ops, which is the order of the executor's answer), then the decodes placed here."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.inputs: list[SequenceInput] = []
        self.sampled: list[Sequence] = []  # the sequences that sample a token, in the order of `inputs`
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int]] = []

    def add_outcome(self, op: Op, seqs: list[Sequence], outcome: OpOutcome) -> None:
        """The rows of the sequences an op granted slots (`seqs`), and the block moves it asks for."""
        if outcome.copies or outcome.swap_in or outcome.swap_out:
            self.copies += [(c.src, c.dst) for c in outcome.copies]
            self.swap_in += [(c.src, c.dst) for c in outcome.swap_in]
            self.swap_out += [(c.src, c.dst) for c in outcome.swap_out]
        match op:
            case DecodeOp():
                add_decodes(seqs, outcome.slot_mapping, self.block_size, self.inputs, self.sampled)
            case ReserveOp() | AdmitOp() if outcome.granted:
                add_tokens(seqs[0], list(outcome.slot_mapping), self.inputs, self.sampled)

    def add_local(self, local: list[Sequence]) -> None:
        """The rows of the decodes placed here, each in a free slot of its own blocks."""
        add_decodes(local, None, self.block_size, self.inputs, self.sampled)

    @property
    def empty(self) -> bool:
        """No row and no block move: nothing to send."""
        return not self.inputs and not (self.swap_out or self.swap_in or self.copies)

    def step(self, step_id: int, released_seq_ids: list[int]) -> StepInput:
        return StepInput(self.inputs, swap_out=self.swap_out, swap_in=self.swap_in, copies=self.copies,
                         step_id=step_id, released_seq_ids=released_seq_ids)
