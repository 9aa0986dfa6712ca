"""What the executor is given and gives back: a step's inputs, the sampled tokens, its Info.

Plain data without torch: the frontend builds steps and reads the results in a container that must
never load torch (only the executor's does). executor.proto carries the same fields between processes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress, repeat
from typing import NamedTuple

from ..common.errors import InvalidRequest

MAX_TOP_LOGPROBS = 20
LAST_SAMPLED = -1  # a decode's input token: the one the executor sampled for this sequence in the previous step
# tuple.__new__(SomeNamedTuple, values) is that NamedTuple, built without the class's own __new__ (a Python
# function): 2-3x faster for the rows built per sequence every step (256 tokens: 75 -> 30 µs).
new_row = tuple.__new__


class SamplingParams(NamedTuple):  # a tuple: the executor builds one per sampled sequence every step
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    num_top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


GREEDY = SamplingParams()


class SampledToken(NamedTuple):
    seq_id: int
    token_id: int
    logprob: float  # of the chosen token under the model's distribution (before temperature and filters)
    top_token_ids: Sequence[int]  # () when none were asked for: no list per token
    top_logprobs: Sequence[float]


class SequenceInput(NamedTuple):  # a tuple: hundreds are built every step
    seq_id: int
    token_ids: Sequence[int]  # tokens whose KV is computed this step ([LAST_SAMPLED]: not known to the sender)
    start_position: int  # position of token_ids[0]
    block_table: Sequence[int]  # covers positions [0, start_position + len(token_ids)); see HeldInputs
    slot_mapping: Sequence[int]  # one cache slot per token
    sampling: SamplingParams | None = None  # None: no next token wanted (a non-final prefill chunk)


_LAST_ONLY = [LAST_SAMPLED]  # a decode's tokens when the sender does not know its input yet
_ID_AND_TABLE = operator.itemgetter(0, 3)  # a SequenceInput's (seq_id, block_table)
_ID_AND_SAMPLING = operator.itemgetter(0, 5)  # its (seq_id, sampling)
_SAMPLING = operator.itemgetter(1)
_SEQ_ID, _TOKENS, _START = (operator.itemgetter(i) for i in range(3))  # a SequenceInput's


@dataclass(frozen=True)
class StepInput:
    sequences: Sequence[SequenceInput]
    swap_out: Sequence[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: Sequence[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copies: Sequence[tuple[int, int]] = field(default_factory=list)  # (device src, device dst)
    step_id: int = 0  # overlapped steps: 1, 2, ...; LAST_SAMPLED refers to step_id - 1 (0: unnumbered)
    # sequences the block manager freed since the last step: a layout that keeps KV per sequence (virtual)
    # releases their memory before this step runs; the paged layout ignores them (its blocks say it all)
    released_seq_ids: Sequence[int] = ()
    # the sequences are the held batch again (`HeldInputs.repeated_batch`), so the runner checks only what a step
    # adds to one it already ran (ModelRunner.validate). From the scheduler (SchedulerConfig.repeat_batches): the
    # last step's sequences again, not named (`sequences` empty); the executor's side fills them in
    same_batch: bool = False


class LastSampled:
    """The tokens the last step sampled, per sequence: the next numbered step's inputs where it says
    LAST_SAMPLED (overlapped steps). Kept by whatever runs steps: the model runner, the benchmark's stand-in."""

    def __init__(self) -> None:
        self.step_id = 0  # of the last step run
        self.tokens: dict[int, int] = {}

    def clear(self) -> None:
        """Forgets every step (the frontend starts over: no step may ask for what an earlier one sampled)."""
        self.step_id, self.tokens = 0, {}

    def check(self, step_id: int, seq_id: int, token_ids: Sequence[int], where: str) -> None:
        """Raises InvalidRequest unless step `step_id` may ask for sequence `seq_id`'s last sampled token."""
        if len(token_ids) != 1:
            raise InvalidRequest(f"{where}: LAST_SAMPLED ({LAST_SAMPLED}) stands alone, as a decode's one token")
        if step_id == 0 or step_id != self.step_id + 1:
            raise InvalidRequest(f"{where}: step {step_id} asks for the tokens step {step_id - 1} sampled, but the"
                                 f" last step run was {self.step_id}")
        if seq_id not in self.tokens:
            raise InvalidRequest(f"{where}: step {self.step_id} sampled no token for sequence {seq_id}")

    def allows(self, step_id: int, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> bool:
        """What `check` tests of every sequence whose tokens hold LAST_SAMPLED, over the step's columns (C loops):
        True only when none of them would raise."""
        asks = list(map(operator.contains, token_lists, repeat(LAST_SAMPLED)))
        if not any(asks):
            return True
        return (step_id != 0 and step_id == self.step_id + 1
                and all(map(operator.eq, compress(token_lists, asks), repeat([LAST_SAMPLED])))
                and all(map(self.tokens.__contains__, compress(seq_ids, asks))))

    def start(self, step_id: int) -> dict[int, int]:
        """Step `step_id` begins: returns the tokens it may use; it has sampled none until `record`."""
        tokens, self.tokens, self.step_id = self.tokens, {}, step_id
        return tokens

    def record(self, sampled: Iterable[SampledToken]) -> None:
        self.tokens = {t.seq_id: t.token_id for t in sampled}


class HeldInputs:
    """The block tables and sampling parameters a remote executor holds, so that a step names only the tables
    that changed (the `table_held` field of ExecuteRequest), and of a changed one only its new blocks
    (`table_kept`), and sends a sequence's sampling parameters once (`sampling_held`); and the last step's
    batch, so that the steady decode step is sent as "the same batch again" (`same_batch`). The frontend's side
    (`sent`, `sent_sampling`, `repeats`, `record_batch`) and the executor's (`resolve_tables`, `resolve_sampling`,
    `repeated_batch`, then `commit` as the step is queued) follow the same rules: an input is held from a step
    sent (on the executor's side: accepted, queued) until its sequence is released or the executor resets. A
    step that fails voids the steps behind it, and the frontend fails its requests."""

    def __init__(self) -> None:
        self.tables: dict[int, Sequence[int]] = {}
        self.samplings: dict[int, SamplingParams] = {}
        # the last step's id, its sequences in order, and the position each one's next token would be at
        self.batch: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None

    def clear(self) -> None:
        self.tables, self.samplings, self.batch = {}, {}, None

    def record_batch(self, step_id: int, seq_ids: Sequence[int], starts: Sequence[int],
                     token_lists: Sequence[Sequence[int]]) -> None:
        """The step just sent (or accepted) is the batch a `same_batch` step would repeat."""
        self.batch = (step_id, tuple(seq_ids), tuple(map(operator.add, starts, map(len, token_lists))))

    def repeats(self, step_id: int, seq_ids: Sequence[int], starts: Sequence[int],
                token_lists: Sequence[Sequence[int]]) -> bool:
        """The sender's side: whether the step is the last one's batch again, each sequence a decode of the token
        it sampled there, at its next position (tuple comparisons: C loops). Its tables and sampling parameters
        must also be held (`sent`, `sent_sampling`) for it to go as `same_batch`."""
        batch = self.batch
        return (batch is not None and bool(seq_ids) and step_id == batch[0] + 1 and tuple(seq_ids) == batch[1]
                and tuple(starts) == batch[2] and token_lists.count(_LAST_ONLY) == len(token_lists))

    def repeated_batch(self, step_id: int, block_size: int) -> list[SequenceInput]:
        """The executor's side of a `same_batch` step: the held batch's sequences, each a decode of LAST_SAMPLED
        at its next position, its slot by the slot rule over its held table, its held sampling parameters
        (InvalidRequest when the batch is not step_id - 1's, or an input is not held). Changes nothing."""
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
        bs = repeat(block_size)
        try:  # table[position // block_size] * block_size + position % block_size, in C
            blocks = map(operator.getitem, tables, map(operator.floordiv, starts, bs))
            slots = list(map(operator.add, map(operator.mul, blocks, bs), map(operator.mod, starts, bs)))
        except IndexError:
            i = next(i for i, (t, p) in enumerate(zip(tables, starts, strict=True)) if p >= len(t) * block_size)
            raise InvalidRequest(f"same_batch: sequence {seq_ids[i]}'s held table of {len(tables[i])} blocks does"
                                 f" not reach its next position {starts[i]}") from None
        return list(map(new_row, repeat(SequenceInput), zip(
            seq_ids, [[LAST_SAMPLED] for _ in seq_ids], starts, tables, [[slot] for slot in slots], samplings,
            strict=True)))

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self.tables.pop(seq_id, None)
            self.samplings.pop(seq_id, None)

    def sent_sampling(self, seq_ids: Sequence[int], samplings: Sequence[SamplingParams]) -> list[bool]:
        """The sender's side, for the sequences that sample: whether the executor holds these very parameters (a
        sequence keeps one object for its life), which are then left out; the others are held from now on."""
        held = self.samplings
        mask = list(map(operator.is_, map(held.get, seq_ids), samplings))  # in C: every sequence, every step
        if not all(mask):
            held.update(compress(zip(seq_ids, samplings, strict=True), map(operator.not_, mask)))
        return mask

    def resolve_sampling(self, seq_ids: Sequence[int], held: Sequence[bool],
                         sent: Sequence[SamplingParams]) -> list[SamplingParams]:
        """The executor's side: the parameters of the sequences that sample (`seq_ids`), the held ones filled in
        among those `sent` (InvalidRequest for one not held). Changes nothing: `commit` records them."""
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

    def sent(self, seq_ids: Sequence[int], tables: Sequence[Sequence[int]]) -> tuple[list[bool], list[int]]:
        """The sender's side: for each sequence of a step, whether the executor holds this very table (tables
        are replaced, never changed in place, so the same object means the same table), and for one it does
        not, how many leading entries of the table it holds the new one keeps (a decode's table grows by a
        block, or its shared tail block is replaced by a copy); the new tables are held from now on."""
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

    def resolve_tables(self, seq_ids: Sequence[int], sent: Sequence[Sequence[int]], held: Sequence[bool],
                       kept: Sequence[int] = ()) -> list[Sequence[int]]:
        """The executor's side, by columns: each sequence's table, a held one filled in and a kept prefix put back
        in front of the blocks `sent` (InvalidRequest for a table not held, or shorter than its kept prefix).
        Changes nothing: `commit` records the step's new tables."""
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
            step = replace(step, sequences=self.repeated_batch(step.step_id, block_size))
            self.commit_repeated(step)
        else:
            self.commit(step)
        return step

    def commit_repeated(self, step: StepInput) -> None:
        """Records a `same_batch` step made from this very batch (`repeated_batch`, or checked to be it): its inputs
        are held already, its positions one on."""
        assert self.batch is not None and step.step_id == self.batch[0] + 1, "not this batch's next step"
        _, seq_ids, starts = self.batch
        self.batch = (step.step_id, seq_ids, tuple(map(operator.add, starts, repeat(1, len(starts)))))
        self.release(step.released_seq_ids)

    def commit(self, step: StepInput, samplings_sent: bool = True) -> None:
        """Records the step's inputs as held, and its batch; its sampling parameters only where some were sent
        (else every one was held already)."""
        seqs = step.sequences
        self.tables.update(map(_ID_AND_TABLE, seqs))
        if samplings_sent:
            self.samplings.update(filter(_SAMPLING, map(_ID_AND_SAMPLING, seqs)))
        self.record_batch(step.step_id, list(map(_SEQ_ID, seqs)), list(map(_START, seqs)), list(map(_TOKENS, seqs)))
        self.release(step.released_seq_ids)


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


@dataclass(frozen=True)
class ExecutorInfo:
    model: str
    model_digest: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    num_cpu_blocks: int
    eos_token_ids: tuple[int, ...]
    kernel_backend: str
    epoch: int = 0  # of the frontend's last Reset (a remote executor's)
    kv_layout: str = "paged"  # "paged", "virtual" or "static" (options.KV_LAYOUTS); only paged shares KV
    kv_cache_dtype: str = ""  # the KV cache's dtype where it is not `dtype` (bfloat16 under fp32 weights)

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype: what its blocks hold, so part of the prefix cache's namespace."""
        return self.kv_cache_dtype or self.dtype
