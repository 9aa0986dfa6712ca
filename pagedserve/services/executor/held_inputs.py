"""The inputs an executor holds between steps, as each end of its wire protocol keeps them.

A remote executor keeps each running sequence's block table and sampling parameters, and the last step's batch,
so that a step names only what changed: a table it holds is not sent (the `table_held` field of ExecuteRequest),
of a changed one only its new blocks (`table_kept`), a sequence's sampling parameters once (`sampling_held`),
and the steady decode step as "the last step's batch again" (`same_batch`). The sender (`SentInputs`, the
executor's client) decides what to leave out; the receiver (`HeldInputs`: the executor's server, the in-process
port, and the runner's record of the tables it checked) fills it back in. Both follow one rule: an input is
held from the step that brought it (sent; on the receiver's side accepted, queued) until its sequence is
released or the executor resets. A step's releases come before its sequences, as the runner frees a released
sequence's KV before it runs the step: a sequence freed and admitted again in one step (a preemption by
recompute) holds the inputs that step brought. A step that fails voids the steps behind it, and the frontend
fails its requests. Pure Python: the frontend, which never loads torch, holds both sides.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import replace
from itertools import compress, repeat

from ..common.errors import InvalidRequest
from ..common.kv_geometry import slot_of
from .step_types import LAST_SAMPLED, SamplingParams, SequenceInput, StepInput, new_row

_LAST_ONLY = [LAST_SAMPLED]  # a decode's tokens when the sender does not know its input yet
_ID_AND_TABLE = operator.itemgetter(0, 3)  # a SequenceInput's (seq_id, block_table)
_ID_AND_SAMPLING = operator.itemgetter(0, 5)  # its (seq_id, sampling)
_SAMPLING = operator.itemgetter(1)
_SEQ_ID, _TOKENS, _START = (operator.itemgetter(i) for i in range(3))  # a SequenceInput's


class _HeldByBothSides:
    """What both sides know the executor holds: tables and sampling parameters by sequence, and the last batch."""

    def __init__(self) -> None:
        self.tables: dict[int, Sequence[int]] = {}
        self.samplings: dict[int, SamplingParams] = {}
        # the last step's id, its sequences in order, and the position each one's next token would be at
        self.batch: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None

    def clear(self) -> None:
        """Forgets everything (the executor resets)."""
        self.tables, self.samplings, self.batch = {}, {}, None

    def release(self, seq_ids: Iterable[int]) -> None:
        """The block manager freed these sequences: their inputs are held no longer."""
        for seq_id in seq_ids:
            self.tables.pop(seq_id, None)
            self.samplings.pop(seq_id, None)

    def record_batch(self, step_id: int, seq_ids: Sequence[int], starts: Sequence[int],
                     token_lists: Sequence[Sequence[int]]) -> None:
        """The step just sent (or accepted) is the batch a `same_batch` step would repeat."""
        self.batch = (step_id, tuple(seq_ids), tuple(map(operator.add, starts, map(len, token_lists))))

    def commit_repeated(self, step: StepInput) -> None:
        """Records a `same_batch` step of this very batch (made from it, or checked to be it): its inputs are held
        already, its positions one on."""
        assert self.batch is not None and step.step_id == self.batch[0] + 1, "not this batch's next step"
        self.release(step.released_seq_ids)
        _, seq_ids, starts = self.batch
        self.batch = (step.step_id, seq_ids, tuple(map(operator.add, starts, repeat(1, len(starts)))))


class SentInputs(_HeldByBothSides):
    """The sender's side: what the executor holds, as far as the steps sent tell."""

    def repeats(self, step_id: int, seq_ids: Sequence[int], starts: Sequence[int],
                token_lists: Sequence[Sequence[int]]) -> bool:
        """Whether the step is the last one's batch again, each sequence a decode of the token it sampled there,
        at its next position (tuple comparisons: C loops). Its tables and sampling parameters must also be held
        (`sent`, `sent_sampling`) for it to go as `same_batch`."""
        batch = self.batch
        return (batch is not None and bool(seq_ids) and step_id == batch[0] + 1 and tuple(seq_ids) == batch[1]
                and tuple(starts) == batch[2] and token_lists.count(_LAST_ONLY) == len(token_lists))

    def send_repeated(self, step: StepInput) -> None:
        """Records a step the scheduler built as the last batch again, with no sequences (`StepInput.same_batch`):
        ValueError unless that batch is step_id - 1's (its inputs were held with the steps before: the
        scheduler's promise)."""
        flagged = f"step {step.step_id} is flagged same_batch, but"
        if step.sequences:
            raise ValueError(f"{flagged} names sequences")
        if self.batch is None:
            raise ValueError(f"{flagged} no batch of the step before is held")
        if self.batch[0] != step.step_id - 1:
            raise ValueError(f"{flagged} the batch held is step {self.batch[0]}'s")
        released = set(step.released_seq_ids).intersection(self.batch[1])
        if released:
            raise ValueError(f"{flagged} it releases sequence {min(released)} of that batch")
        self.commit_repeated(step)

    def sent(self, seq_ids: Sequence[int], tables: Sequence[Sequence[int]]) -> tuple[list[bool], list[int]]:
        """For each sequence of a step, whether the executor holds this very table (tables are replaced, never
        changed in place, so the same object means the same table), and for one it does not, how many leading
        entries of the table it holds the new one keeps (a decode's table grows by a block, or its shared tail
        block is replaced by a copy); the new tables are held from now on."""
        if len(seq_ids) != len(tables):
            raise ValueError(f"{len(seq_ids)} sequences, {len(tables)} tables")
        held = self.tables
        before = list(map(held.get, seq_ids))
        mask = list(map(operator.is_, before, tables))  # in C: every sequence, every step
        kept = [0] * len(mask)
        if not all(mask):
            for i in compress(range(len(mask)), map(operator.not_, mask)):  # the few that changed
                kept[i] = _kept(before[i], tables[i])
                held[seq_ids[i]] = tables[i]
        return mask, kept

    def sent_sampling(self, seq_ids: Sequence[int], samplings: Sequence[SamplingParams]) -> list[bool]:
        """For the sequences that sample: whether the executor holds these very parameters (a sequence keeps one
        object for its life), which are then left out; the others are held from now on."""
        held = self.samplings
        mask = list(map(operator.is_, map(held.get, seq_ids), samplings))  # in C: every sequence, every step
        if not all(mask):
            held.update(compress(zip(seq_ids, samplings, strict=True), map(operator.not_, mask)))
        return mask


class HeldInputs(_HeldByBothSides):
    """The receiver's side: fills a step's held inputs back in (InvalidRequest for one not held), and records
    each step accepted (`commit`, `commit_repeated`). The `resolve_*` calls change nothing; a step's are made
    on the inputs held after its releases (`without`)."""

    def without(self, seq_ids: Sequence[int]) -> HeldInputs:
        """The inputs held once these sequences are released: this object when there are none (the usual step), else
        a copy without them (a step's releases come before its sequences)."""
        if not seq_ids:
            return self
        after = HeldInputs()
        after.tables, after.samplings, after.batch = dict(self.tables), dict(self.samplings), self.batch
        after.release(seq_ids)
        return after

    def repeated_batch(self, step_id: int, block_size: int) -> list[SequenceInput]:
        """A `same_batch` step's sequences: the held batch's, each a decode of LAST_SAMPLED at its next position,
        its slot by the slot rule over its held table, its held sampling parameters (InvalidRequest when the
        batch is not step_id - 1's, or an input is not held)."""
        batch = self.batch
        if batch is None or step_id != batch[0] + 1:
            last = "none" if batch is None else f"step {batch[0]}"
            raise InvalidRequest(f"same_batch: step {step_id} repeats the batch of step {step_id - 1}, but the last"
                                 f" step this executor holds is {last}")
        _, seq_ids, starts = batch
        if not seq_ids:
            raise InvalidRequest(f"same_batch: step {step_id - 1} ran no sequences to run again")
        try:
            tables = list(map(self.tables.__getitem__, seq_ids))
            samplings = list(map(self.samplings.__getitem__, seq_ids))
        except KeyError:
            missing = next(s for s in seq_ids if s not in self.tables or s not in self.samplings)
            raise InvalidRequest(f"same_batch: this executor holds no block table or sampling parameters for"
                                 f" sequence {missing}") from None
        try:
            slots = list(map(slot_of, tables, starts, repeat(block_size)))
        except IndexError:
            i = next(i for i, (t, p) in enumerate(zip(tables, starts, strict=True)) if p >= len(t) * block_size)
            raise InvalidRequest(f"same_batch: sequence {seq_ids[i]}'s held table of {len(tables[i])} blocks does"
                                 f" not reach its next position {starts[i]}") from None
        return list(map(new_row, repeat(SequenceInput), zip(
            seq_ids, [[LAST_SAMPLED] for _ in seq_ids], starts, tables, [[slot] for slot in slots], samplings,
            strict=True)))

    def resolve_sampling(self, seq_ids: Sequence[int], held: Sequence[bool],
                         sent: Sequence[SamplingParams]) -> list[SamplingParams]:
        """The parameters of the sequences that sample (`seq_ids`), the held ones filled in among those `sent`."""
        if held and len(held) != len(seq_ids):
            raise InvalidRequest(f"sampling_held: {len(held)} entries for {len(seq_ids)} sequences that sample (or "
                                 "none)")
        wanted = held.count(False) if held else len(seq_ids)
        if len(sent) != wanted:
            raise InvalidRequest(f"temperature: {len(sent)} entries for {wanted} sequences that sample"
                                 + (" and whose sampling_held is false" if held else ""))
        if not held:
            return list(sent)
        samplings = self.samplings
        try:
            if all(held):  # the steady state
                return list(map(samplings.__getitem__, seq_ids))
            each = iter(sent)
            return [samplings[seq_id] if is_held else next(each) for seq_id, is_held in zip(seq_ids, held, strict=True)]
        except KeyError:
            i = next(i for i, seq_id in enumerate(seq_ids) if held[i] and seq_id not in samplings)
            raise InvalidRequest(f"sampling_held[{i}]: this executor holds no sampling parameters for sequence "
                                 f"{seq_ids[i]} (send them)") from None

    def resolve_tables(self, seq_ids: Sequence[int], sent: Sequence[Sequence[int]], held: Sequence[bool],
                       kept: Sequence[int] = ()) -> list[Sequence[int]]:
        """By columns: each sequence's table, a held one filled in and a kept prefix put back in front of the
        blocks `sent` (InvalidRequest for a table not held, or shorter than its kept prefix)."""
        tables, num_seqs = self.tables, len(seq_ids)
        if held and len(held) != num_seqs:
            raise InvalidRequest(f"table_held: {len(held)} entries for {num_seqs} sequences (or none)")
        if kept and len(kept) != num_seqs:
            raise InvalidRequest(f"table_kept: {len(kept)} entries for {num_seqs} sequences (or none)")
        try:
            if held and all(held):  # the steady state: every sequence, every step
                filled = list(map(tables.__getitem__, seq_ids))
            else:
                filled = list(sent)
                for i in compress(range(num_seqs), held):
                    filled[i] = tables[seq_ids[i]]
            for i in compress(range(num_seqs), kept):  # a changed table's kept prefix
                if held and held[i]:
                    raise InvalidRequest(f"table_kept[{i}]: {kept[i]} for a table the executor holds (table_held):"
                                         " must be 0")
                prefix = tables[seq_ids[i]]
                if kept[i] > len(prefix):
                    raise InvalidRequest(f"table_kept[{i}]: {kept[i]} entries of a held table of {len(prefix)}")
                filled[i] = [*prefix[: kept[i]], *sent[i]]
        except KeyError:
            i = next(i for i, seq_id in enumerate(seq_ids) if ((held and held[i]) or (kept and kept[i]))
                     and seq_id not in tables)
            field_name = "table_held" if held and held[i] else "table_kept"
            raise InvalidRequest(f"{field_name}[{i}]: this executor holds no block table for sequence {seq_ids[i]}"
                                 " (send it)") from None
        return filled

    def fill(self, step: StepInput, block_size: int) -> StepInput:
        """An in-process executor's side (LocalExecutor), as the executor's server does it: a step the scheduler
        sent as `same_batch` with no sequences gets the held batch's (`repeated_batch`); every step is recorded."""
        if step.same_batch and not step.sequences:
            sequences = self.without(step.released_seq_ids).repeated_batch(step.step_id, block_size)
            step = replace(step, sequences=sequences)
            self.commit_repeated(step)
        else:
            self.commit(step)
        return step

    def commit(self, step: StepInput, samplings_sent: bool = True) -> None:
        """Records the step's releases, then its inputs as held, and its batch; its sampling parameters only where
        some were sent (else every one was held already)."""
        seqs = step.sequences
        self.release(step.released_seq_ids)
        self.tables.update(map(_ID_AND_TABLE, seqs))
        if samplings_sent:
            self.samplings.update(filter(_SAMPLING, map(_ID_AND_SAMPLING, seqs)))
        self.record_batch(step.step_id, list(map(_SEQ_ID, seqs)), list(map(_START, seqs)), list(map(_TOKENS, seqs)))


def _kept(before: Sequence[int] | None, table: Sequence[int]) -> int:
    """How many leading entries of `before` (the table held) `table` starts with: all of them (it grew), all but
    the last (its tail block was copied on write), or none (sent whole). Each comparison is one pass in C."""
    if not before:
        return 0
    n = len(before)
    if len(table) >= n and table[:n] == before:
        return n
    if len(table) >= n - 1 and table[: n - 1] == before[: n - 1]:
        return n - 1
    return 0
