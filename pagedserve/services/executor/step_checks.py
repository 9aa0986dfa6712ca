"""The runner's check of a step from outside the process: each rule written once, tested over the step's columns.

A step comes from another process (the executor's server) or from the engine's scheduler (the in-process port):
either way it is checked once, before it touches the cache (`ModelRunner.execute`); the runner's own callers
(warm-up, profiling, benchmarks) run steps they built with `ModelRunner.run`, unchecked. Each rule is a C loop
over the step's columns (hundreds of sequences every step); only when one fails is the first sequence that
breaks it found, for the error that names its field. A block table's ids are checked when the table is new (a
new object: tables are replaced, never changed in place), and the steady decode step, the last step's batch
again (`same_batch`), only for what it adds: its positions and the tokens it asks for.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import chain, compress, repeat
from typing import NoReturn

from ..common.errors import InvalidRequest
from ..common.kv_geometry import slot_of
from .held_inputs import HeldInputs
from .step_types import LAST_SAMPLED, MAX_TOP_LOGPROBS, LastSampled, SamplingParams, SequenceInput, StepInput
from .virtual_kv import SequenceKV


class StepChecks:
    """What a step may ask of a runner's cache: its geometry, the tokens the last step sampled, and the tables
    checked so far (kept by the rules of the tables a server holds: recorded per valid step, forgotten at a
    release or a reset)."""

    def __init__(self, vocab_size: int, max_model_len: int, block_size: int, num_blocks: int, num_cpu_blocks: int,
                 last_sampled: LastSampled, sequence_kv: SequenceKV | None) -> None:
        self.vocab_size, self.max_model_len, self.block_size = vocab_size, max_model_len, block_size
        self.num_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        self.last_sampled, self.sequence_kv = last_sampled, sequence_kv
        self.checked = HeldInputs()  # the tables checked, by object, and the last batch

    def reset(self) -> None:
        self.checked.clear()

    def validate(self, step: StepInput) -> bool:
        """Raises InvalidRequest naming the field; nothing has changed when it does. A valid step's tables are
        recorded as checked. True when the step is the last one's batch again (`same_batch`)."""
        seqs = step.sequences
        repeated = self._repeats_batch(step)
        if seqs:
            self._check_sequences(seqs, step.step_id, repeated)
        if self.sequence_kv is not None:
            moves = next((name for name in ("swap_out", "swap_in", "copies") if getattr(step, name)), None)
            if moves is not None:
                raise InvalidRequest(f"{moves}: a per-sequence KV layout shares no blocks and has no swap pool")
            self.sequence_kv.check(seqs, step.released_seq_ids)
        for name, pairs, src_limit, dst_limit in (
            ("swap_out", step.swap_out, self.num_blocks, self.num_cpu_blocks),
            ("swap_in", step.swap_in, self.num_cpu_blocks, self.num_blocks),
            ("copies", step.copies, self.num_blocks, self.num_blocks),
        ):
            for j, (src, dst) in enumerate(pairs):
                if not (0 <= src < src_limit and 0 <= dst < dst_limit):
                    raise InvalidRequest(f"{name}[{j}]: block ({src} -> {dst}) outside the cache")
        if repeated:
            self.checked.commit_repeated(step)
        else:
            self.checked.commit(step, samplings_sent=False)
        return repeated

    def _repeats_batch(self, step: StepInput) -> bool:
        """Whether a `same_batch` step is the batch of the last step checked here again, one position on: the same
        sequences with the same table objects, hence the sampling parameters that step checked (held with them),
        each a decode of the token it sampled, and slots by the slot rule (the server derived them)."""
        batch = self.checked.batch
        if not step.same_batch or not step.sequences or batch is None or step.step_id != batch[0] + 1:
            return False
        seq_ids, token_lists, starts, tables, _, _ = zip(*step.sequences, strict=True)
        return (seq_ids == batch[1] and starts == batch[2] and token_lists.count([LAST_SAMPLED]) == len(token_lists)
                and all(map(operator.is_, map(self.checked.tables.get, seq_ids), tables)))

    def _check_sequences(self, seqs: Sequence[SequenceInput], step_id: int, repeated: bool) -> None:
        """Every rule of a step's sequences, in order; `repeated`: only those a repeated batch may break."""
        seq_ids, token_lists, starts, tables, slot_lists, samplings = zip(*seqs, strict=True)
        num_tokens = list(map(len, token_lists))
        if not repeated:
            if len(set(seq_ids)) != len(seq_ids):
                i = next(i for i, seq_id in enumerate(seq_ids) if seq_id in seq_ids[:i])
                _refuse(i, "seq_id", f"sequence {seq_ids[i]} appears twice in the step")
            if min(num_tokens) < 1:
                _refuse(num_tokens.index(0), "token_ids", "must not be empty")
        if not self.last_sampled.allows(step_id, seq_ids, token_lists):
            for i in compress(range(len(seqs)), map(operator.contains, token_lists, repeat(LAST_SAMPLED))):
                self.last_sampled.check(step_id, seq_ids[i], token_lists[i], f"sequences[{i}].token_ids")
        vocab = self.vocab_size
        if not repeated:  # LAST_SAMPLED passed above: where it is left, it stands alone where the step may ask it
            tokens = list(chain.from_iterable(token_lists))
            if max(tokens) >= vocab or min(tokens) < LAST_SAMPLED:
                i, bad = next((i, t) for i, ts in enumerate(token_lists) for t in ts if not LAST_SAMPLED <= t < vocab)
                _refuse(i, "token_ids", f"token id {bad} outside the vocabulary [0, {vocab})")
        ends = list(map(operator.add, starts, num_tokens))
        if max(ends) > self.max_model_len:
            i = next(i for i, end in enumerate(ends) if end > self.max_model_len)
            _refuse(i, "start_position", f"positions up to {ends[i]} exceed the context of {self.max_model_len}")
        if not repeated and list(map(len, slot_lists)) != num_tokens:
            i = next(i for i, slots in enumerate(slot_lists) if len(slots) != num_tokens[i])
            _refuse(i, "slot_mapping", f"{len(slot_lists[i])} slots for {num_tokens[i]} tokens")
        bs = self.block_size
        capacities = list(map(operator.mul, map(len, tables), repeat(bs)))
        if not all(map(operator.le, ends, capacities)):
            i = next(i for i, end in enumerate(ends) if end > capacities[i])
            _refuse(i, "block_table", f"{len(tables[i])} blocks cannot hold {ends[i]} tokens")
        if repeated:
            return
        new_tables = map(operator.is_not, map(self.checked.tables.get, seq_ids), tables)
        for i in compress(range(len(seqs)), new_tables):  # O(table) per sequence: only a new table
            _check_ids(tables[i], self.num_blocks, f"sequences[{i}].block_table")
        self._check_slots(starts, ends, num_tokens, tables, slot_lists)
        self._check_samplings(samplings)

    def _check_slots(self, starts: Sequence[int], ends: Sequence[int], num_tokens: Sequence[int],
                     tables: Sequence[Sequence[int]], slot_lists: Sequence[Sequence[int]]) -> None:
        """Each token's slot is in its block (kv_geometry.slot_of)."""
        bs = self.block_size
        if max(num_tokens) == 1:
            positions: Iterable[int] = starts
            token_tables: Iterable[Sequence[int]] = tables
        else:
            positions = chain.from_iterable(map(range, starts, ends))
            token_tables = chain.from_iterable(map(repeat, tables, num_tokens))
        if all(map(operator.eq, map(slot_of, token_tables, positions, repeat(bs)), chain.from_iterable(slot_lists))):
            return
        for i, (start, table, slots) in enumerate(zip(starts, tables, slot_lists, strict=True)):
            for pos, slot in enumerate(slots, start):
                if slot != slot_of(table, pos, bs):
                    _refuse(i, "slot_mapping", f"slot {slot} of position {pos} is not in its block")

    @staticmethod
    def _check_samplings(samplings: Sequence[SamplingParams | None]) -> None:
        """Temperature, top-p and top-k in range (`0.0 <= x` is False for NaN), and no more top logprobs than the
        response carries."""
        sampled = list(filter(None, samplings))
        if not sampled:
            return
        temperature, top_k, top_p, _, num_top_logprobs = zip(*sampled, strict=True)
        if not (all(map((0.0).__le__, temperature)) and min(top_k) >= 0 and all(map((0.0).__le__, top_p))
                and all(map((1.0).__ge__, top_p))):
            i = next(i for i, s in enumerate(samplings) if s is not None
                     and not (s.temperature >= 0 and 0 <= s.top_p <= 1 and s.top_k >= 0))
            _refuse(i, "sampling", "temperature >= 0, 0 <= top_p <= 1, top_k >= 0 required")
        if max(num_top_logprobs) > MAX_TOP_LOGPROBS:
            i = next(i for i, s in enumerate(samplings) if s is not None
                     and s.num_top_logprobs > MAX_TOP_LOGPROBS)
            _refuse(i, "sampling.num_top_logprobs", f"at most {MAX_TOP_LOGPROBS}")


def _refuse(index: int, field_name: str, problem: str) -> NoReturn:
    raise InvalidRequest(f"sequences[{index}].{field_name}: {problem}")


def _check_ids(values: Sequence[int], limit: int, where: str) -> None:
    bad = next((v for v in values if not 0 <= v < limit), None)
    if bad is not None:
        raise InvalidRequest(f"{where}: {bad} outside [0, {limit})")
