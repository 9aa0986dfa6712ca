"""The executor's rows of a step from the scheduler's sequences: the per-sequence loops every step runs.

Each function advances the sequences it schedules as far as planning goes (`num_computed`; `num_pending` for one
that samples; `num_local_slots` for a decode the scheduler placed itself), appends their rows (`SequenceInput`) to
`inputs` and the sequences that sample to `sampled`, in the rows' order, which is the order of the executor's
answer. The steady decode step, the last step's batch again, needs no rows at all (`repeats_last_batch`): the
executor's port fills them in from the batch it holds.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

from ..executor.step_types import LAST_SAMPLED, SequenceInput, new_row
from .request import SeqStatus, SequenceState


def add_decodes(seqs: list[SequenceState], slots: Sequence[int] | None, block_size: int,
                inputs: list[SequenceInput], sampled: list[SequenceState]) -> None:
    """The step's hot loop: every decoding sequence, every step (SequenceInput written out). A sequence that
    finished since the plan is left out (its slot goes with its blocks at the next call). No `slots`: the
    decodes the scheduler placed itself, each in a free slot of its own tail block (counted as local)."""
    finished, append_input, append_sampled = SeqStatus.FINISHED, inputs.append, sampled.append
    for seq, slot in zip(seqs, itertools.repeat(None, len(seqs)) if slots is None else slots, strict=True):
        if seq.status is finished:
            continue
        start, token_ids = seq.num_computed, seq.token_ids
        if slot is None:
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


def add_tokens(seq: SequenceState, slot_mapping: list[int], inputs: list[SequenceInput],
               sampled: list[SequenceState]) -> None:
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


def repeats_last_batch(local: list[SequenceState], last: list[SequenceState]) -> bool:
    """Whether a step's decodes, all placed by the scheduler (no block-manager op, so no table changed), are
    `last` (the last step's sequences, every one of which sampled) again, in its order, each decoding the token
    it sampled there (LAST_SAMPLED) and sampling the next: `HeldInputs.repeats`' condition, known without rows."""
    if not local or len(local) != len(last) or not all(map(operator.is_, local, last)):
        return False
    finished = SeqStatus.FINISHED
    for seq in local:
        start, num_known = seq.num_computed, len(seq.token_ids)
        if seq.status is finished or start < num_known or start + 1 != num_known + seq.num_pending:
            return False
    return True


def advance_repeated(local: list[SequenceState]) -> None:
    """`add_decodes`' bookkeeping for a batch that `repeats_last_batch`, without its rows."""
    for seq in local:
        seq.num_computed += 1
        seq.num_local_slots += 1
        seq.num_pending += 1
