"""The runner checks a sequence's block table only when it changes (a new object), never trusting one that a
refused step brought, and forgets what it checked at a release or a reset. One check (StepChecks) tests each rule
over the step's columns, and names the field of the first sequence that breaks it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.services.common import kv_geometry
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.executor.engine_config import build_runner
from pagedserve.services.executor.held_inputs import HeldInputs
from pagedserve.services.executor.options import ExecutorConfig
from pagedserve.services.executor.runner import ModelRunner
from pagedserve.services.executor.step_types import (
    GREEDY,
    LAST_SAMPLED,
    SampledToken,
    SamplingParams,
    SequenceInput,
    StepInput,
)

BS = 4


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    runner, _ = build_runner(ExecutorConfig(model=str(tiny_llama_dir), num_blocks=16, block_size=BS, device="cpu",
                                            dtype="float32"))
    return runner


def decode(seq_id: int, position: int, table: list[int]) -> StepInput:
    return StepInput([SequenceInput(seq_id, [7], position, table, [kv_geometry.slot_of(table, position, BS)], GREEDY)])


def test_a_table_is_checked_whenever_it_is_a_new_one(runner: ModelRunner) -> None:
    runner.reset()
    table = [1, 2]
    runner.execute(StepInput([SequenceInput(1, [5, 6, 7], 0, table, [4, 5, 6], GREEDY)]))
    runner.execute(decode(1, 3, table))  # the same table: valid, as before
    bad = [1, 99]  # the next table names a block outside the cache of 16
    for _ in range(2):  # refused both times: a refused step's table is never taken as checked
        with pytest.raises(InvalidRequest, match="block_table: 99 outside"):
            runner.execute(decode(1, 4, bad))
    runner.execute(decode(1, 4, [1, 3]))  # a good new table runs


def test_a_same_batch_step_is_checked_for_what_it_adds_and_runs_as_the_step_in_full(
        runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """The steady decode step the server derives from its held batch (`same_batch`) skips the checks of what the
    step before passed here, and samples what the same step in full samples; one that is not that
    batch again, one position on, is checked as any step."""
    prefill = StepInput([SequenceInput(1, [5, 6, 7], 0, [1, 2], [4, 5, 6], GREEDY),
                         SequenceInput(2, [9, 8], 0, [3, 4], [12, 13], GREEDY)], step_id=1)

    def run(flagged: bool) -> list[int]:
        runner.reset()
        held = HeldInputs()  # the server's
        tokens, tables = [], []
        for step_id in range(1, 5):  # the prefill, then three steps of the same batch: into block 2's slots, then 4's
            step = prefill if step_id == 1 else StepInput(held.repeated_batch(step_id, BS), step_id=step_id,
                                                          same_batch=flagged)
            held.commit(step)
            tokens += [t.token_id for t in runner.execute(step)]
            if step_id > 1:
                assert runner._decode_tables is not None
                tables.append(runner._decode_tables[1])
        # the decodes' padded tables: built for the first step of decodes, then reused while the batch repeats
        assert [t is tables[0] for t in tables] == [True, flagged, flagged]
        return tokens

    in_full = run(False)
    check_sequences = runner.checks._check_sequences

    def in_full_only_the_prefill(seqs: list[SequenceInput], step_id: int, repeated: bool) -> None:
        assert repeated or step_id == 1, "a same_batch step checked in full"
        check_sequences(seqs, step_id, repeated)

    with monkeypatch.context() as patch:
        patch.setattr(runner.checks, "_check_sequences", in_full_only_the_prefill)
        assert run(True) == in_full
    # another batch under the flag (its sequence 2 gone, sequence 1 one position further): checked, and refused
    runner.reset()
    runner.execute(prefill)
    stray = StepInput([SequenceInput(1, [LAST_SAMPLED], 4, [1, 2], [9], GREEDY)], step_id=2, same_batch=True)
    with pytest.raises(InvalidRequest, match="slot 9 of position 4 is not in its block"):
        runner.execute(stray)
    # the batch again at the end of the context (its table long enough), or past its table's end: refused
    for position, blocks, message in ((runner.max_model_len, runner.max_model_len // BS + 1, "exceed the context"),
                                      (8, 2, "2 blocks cannot hold 9 tokens")):
        runner.reset()
        runner.execute(prefill)
        table = [1] * blocks
        runner.checks.checked.tables[1], runner.checks.checked.batch = table, (1, (1, 2), (position, 2))
        slot = kv_geometry.slot(table[min(position // BS, blocks - 1)], position % BS, BS)
        late = StepInput([SequenceInput(1, [LAST_SAMPLED], position, table, [slot], GREEDY),
                          prefill.sequences[1]._replace(token_ids=[LAST_SAMPLED], start_position=2, slot_mapping=[14])],
                         step_id=2, same_batch=True)
        with pytest.raises(InvalidRequest, match=message):
            runner.execute(late)


def test_release_and_reset_forget_the_checked_tables(runner: ModelRunner) -> None:
    runner.reset()
    table = [4, 5]
    runner.execute(decode(2, 0, table))
    assert runner.checks.checked.tables == {2: table}
    runner.execute(StepInput([], released_seq_ids=[2]))
    assert runner.checks.checked.tables == {}
    runner.execute(decode(3, 0, table))
    runner.reset()
    assert runner.checks.checked.tables == {}
    table.append(99)  # changed in place, against the contract: a reset runner checks it again all the same
    with pytest.raises(InvalidRequest, match="block_table: 99 outside"):
        runner.execute(decode(3, 0, table))


# One way to break a well-formed step's sequence each, and the field the check names for it.
BREAKS = {"seq_id": "seq_id", "empty": "token_ids", "token": "token_ids", "negative token": "token_ids",
          "last_sampled in a chunk": "token_ids", "unsampled": "token_ids", "step_id": "token_ids",
          "context": "start_position", "table": "block_table", "slot": "slot_mapping", "slots": "slot_mapping",
          "temperature": "sampling", "nan": "sampling", "top_p": "sampling", "top_k": "sampling",
          "top_logprobs": "sampling.num_top_logprobs"}


@st.composite
def checked_steps(draw: st.DrawFn, vocab: int, max_len: int) -> tuple[list[SequenceInput], int, dict[int, int], str]:
    """A well-formed step of decodes (some of them LAST_SAMPLED) and prefill chunks, the step before's sampled
    tokens, and how one sequence was broken ("" for none)."""
    sampled_before = {seq_id: 3 for seq_id in draw(st.sets(st.integers(1, 12), max_size=6))}
    seqs = []
    for seq_id in draw(st.lists(st.integers(1, 12), min_size=1, max_size=6, unique=True)):
        if seq_id in sampled_before and draw(st.booleans()):
            tokens = [LAST_SAMPLED]
        else:
            tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=5))
        start = draw(st.integers(0, max_len - len(tokens)))
        end = start + len(tokens)
        num_blocks = kv_geometry.blocks_for(end, BS)
        table = draw(st.lists(st.integers(0, 15), min_size=num_blocks, max_size=num_blocks + 2))
        slots = [kv_geometry.slot_of(table, p, BS) for p in range(start, end)]
        sampling = draw(st.one_of(st.none(), st.builds(
            SamplingParams, st.floats(0, 2), st.integers(0, 50), st.floats(0, 1), st.integers(0, 99),
            st.integers(0, 20))))
        seqs.append(SequenceInput(seq_id, tokens, start, table, slots, sampling))
    step_id, broken = 8, draw(st.sampled_from(["", *BREAKS]))
    i = draw(st.integers(0, len(seqs) - 1))
    s = seqs[i]
    sampling = s.sampling or GREEDY
    match broken:
        case "seq_id":
            seqs.append(seqs[0])
        case "empty":
            seqs[i] = s._replace(token_ids=[], slot_mapping=[])
        case "token":
            seqs[i] = s._replace(token_ids=[vocab] * len(s.token_ids))
        case "negative token":
            seqs[i] = s._replace(token_ids=[-2] * len(s.token_ids))
        case "last_sampled in a chunk":
            seqs[i] = s._replace(token_ids=[LAST_SAMPLED, 5], slot_mapping=[*s.slot_mapping, 0])
        case "unsampled":  # the step before sampled nothing for it
            seqs[i] = s._replace(seq_id=99, token_ids=[LAST_SAMPLED], slot_mapping=s.slot_mapping[:1])
        case "step_id":
            step_id = 9
        case "context":
            seqs[i] = s._replace(start_position=max_len)
        case "table":
            end = s.start_position + len(s.token_ids)
            short = kv_geometry.blocks_for(end, BS) - 1  # a block short
            seqs[i] = s._replace(block_table=list(s.block_table)[:short])
        case "slot":
            seqs[i] = s._replace(slot_mapping=[slot + 1 for slot in s.slot_mapping])
        case "slots":
            seqs[i] = s._replace(slot_mapping=[*s.slot_mapping, 0])
        case "temperature":
            seqs[i] = s._replace(sampling=sampling._replace(temperature=-0.5))
        case "nan":
            seqs[i] = s._replace(sampling=sampling._replace(top_p=math.nan))
        case "top_p":
            seqs[i] = s._replace(sampling=sampling._replace(top_p=1.5))
        case "top_k":
            seqs[i] = s._replace(sampling=sampling._replace(top_k=-1))
        case "top_logprobs":
            seqs[i] = s._replace(sampling=sampling._replace(num_top_logprobs=21))
    return seqs, step_id, sampled_before, broken


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_check_refuses_exactly_the_broken_steps_naming_the_field(runner: ModelRunner,
                                                                    data: st.DataObject) -> None:
    """Every well-formed step passes (over its columns, the fast way); a broken one is refused with the error
    that names the field broken, of the sequence that breaks it, and changes nothing."""
    runner.reset()
    seqs, step_id, sampled_before, broken = data.draw(checked_steps(runner.config.vocab_size, runner.max_model_len))
    runner.last_sampled.start(step_id - 1)
    runner.last_sampled.record([SampledToken(seq_id, token, 0.0, (), ()) for seq_id, token in sampled_before.items()])
    step = StepInput(seqs, step_id=step_id)
    try:
        runner.checks.validate(step)
    except InvalidRequest as refusal:
        assert broken, f"a well-formed step refused: {refusal}"
        assert f"].{BREAKS[broken]}: " in str(refusal), f"broken: {broken}; refused with: {refusal}"
        assert runner.checks.checked.tables == {} and runner.checks.checked.batch is None
    else:  # a step without LAST_SAMPLED has no step before to be wrong about
        assert broken in ("", "step_id"), f"broken: {broken}, yet passed"
