"""The executor's step message, both ends: what the frontend sends (step_to_proto, held inputs left out) is what
the executor runs (step_from_proto, its held inputs filled in), for any mix of prefill chunks, decodes,
sampling and not, over a run of steps in which tables change, are held and are released."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.protos import executor_pb2 as pb
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.kv_geometry import slot_of
from pagedserve.services.executor.codec import step_from_proto, step_to_proto, tokens_from_proto, tokens_to_proto
from pagedserve.services.executor.held_inputs import HeldInputs, SentInputs
from pagedserve.services.executor.step_types import (
    GREEDY,
    LAST_SAMPLED,
    SampledToken,
    SamplingParams,
    SequenceInput,
    StepInput,
)

# floats that float32 (the wire) holds exactly
sampling = st.builds(SamplingParams, st.sampled_from([0.0, 0.5, 1.25]), st.integers(0, 50),
                     st.sampled_from([1.0, 0.875, 0.25]), st.integers(0, 2**62), st.integers(0, 5))


@st.composite
def steps(draw: st.DrawFn) -> list[StepInput]:
    """A run of steps over a few sequences; a sequence keeps its table object until it changes (as the
    scheduler does: replaced, never changed in place), and its sampling parameters object mostly (a request's
    never change, but another object may come), and some are released."""
    num_seqs = draw(st.integers(0, 6))
    tables: dict[int, list[int]] = {seq_id: draw(st.lists(st.integers(0, 999), max_size=6)) for seq_id in
                                    range(1, num_seqs + 1)}
    samplings = {seq_id: draw(sampling) for seq_id in tables}
    run = []
    for step_id in range(1, draw(st.integers(1, 5)) + 1):
        sequences, released = [], []
        for seq_id in list(tables):
            if draw(st.integers(0, 9)) == 0:
                released.append(seq_id)
                if draw(st.booleans()):
                    del tables[seq_id]
                    continue
                # freed and admitted again in the same step (a preemption by recompute): the release comes first,
                # and it holds what this step brings
                tables[seq_id] = list(tables[seq_id])
            change = draw(st.sampled_from(["none", "grow", "copy tail", "replace"]))
            if change == "grow":
                tables[seq_id] = tables[seq_id] + draw(st.lists(st.integers(0, 999), min_size=1, max_size=2))
            elif change == "copy tail":
                tables[seq_id] = tables[seq_id][:-1] + [draw(st.integers(0, 999))]
            elif change == "replace":
                tables[seq_id] = draw(st.lists(st.integers(0, 999), max_size=6))
            decode = draw(st.booleans())
            tokens = [draw(st.sampled_from([LAST_SAMPLED, 7]))] if decode else draw(
                st.lists(st.integers(0, 4000), min_size=1, max_size=5))
            slots = draw(st.lists(st.integers(-1, 9999), min_size=len(tokens), max_size=len(tokens)))
            if draw(st.integers(0, 4)) == 0:
                samplings[seq_id] = draw(sampling)  # another object, equal or not
            sequences.append(SequenceInput(seq_id, tokens, draw(st.integers(0, 2000)), tables[seq_id], slots,
                                           draw(st.sampled_from([None, samplings[seq_id]]))))
        run.append(StepInput(sequences, step_id=step_id, released_seq_ids=released))
    return run


def as_lists(step: StepInput) -> list[tuple[object, ...]]:
    return [(s.seq_id, list(s.token_ids), s.start_position, list(s.block_table), list(s.slot_mapping), s.sampling)
            for s in step.sequences]


@settings(max_examples=150, deadline=None)
@given(steps())
def test_the_executor_runs_the_step_the_frontend_sent(run: list[StepInput]) -> None:
    sender, receiver = SentInputs(), HeldInputs()
    sent: dict[int, object] = {}  # the table object each sequence last sent
    sent_sampling: dict[int, object] = {}  # and its sampling parameters
    for step in run:
        request = pb.ExecuteRequest.FromString(step_to_proto(step, 3, sender).SerializeToString())
        received = step_from_proto(request, receiver)
        receiver.commit(received)
        assert as_lists(received) == as_lists(step)
        assert (received.step_id, list(received.released_seq_ids)) == (step.step_id, list(step.released_seq_ids))
        assert request.epoch == 3
        for seq_id in step.released_seq_ids:  # released before the step's sequences
            sent.pop(seq_id, None)
            sent_sampling.pop(seq_id, None)
        # a table is left out exactly when the same object went in an earlier step
        assert list(request.table_held) == [sent.get(s.seq_id) is s.block_table for s in step.sequences]
        assert [n == 0 for n, held in zip(request.block_table_lens, request.table_held, strict=True) if held] == \
            [True] * sum(request.table_held)
        # a changed table goes as what follows the longest prefix it keeps of the one sent before: all of it, all
        # but its tail block, or nothing
        kept = list(request.table_kept) or [0] * len(step.sequences)
        for s, held, k, n in zip(step.sequences, request.table_held, kept, request.block_table_lens, strict=True):
            before = list(sent.get(s.seq_id) or [])
            if held:
                assert k == 0
                continue
            if before and s.block_table[: len(before)] == before:
                assert k == len(before)
            elif len(before) > 1 and s.block_table[: len(before) - 1] == before[:-1]:
                assert k == len(before) - 1
            else:
                assert k == 0
            assert n == len(s.block_table) - k
        # parameters are left out exactly when the same object went in an earlier step (none held: the field empty)
        sampled = [s for s in step.sequences if s.sampling is not None]
        held = [sent_sampling.get(s.seq_id) is s.sampling for s in sampled]
        assert list(request.sampling_held) == (held if any(held) else [])
        assert len(request.temperature) == held.count(False)
        sent.update({s.seq_id: s.block_table for s in step.sequences})
        sent_sampling.update({s.seq_id: s.sampling for s in sampled})


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10**6), st.integers(0, 49151), st.floats(-50, 0),
                          st.lists(st.tuples(st.integers(0, 49151), st.floats(-50, 0)), max_size=3)), max_size=8))
def test_sampled_tokens_come_back_as_sampled(rows: list[tuple[int, int, float, list[tuple[int, float]]]]) -> None:
    tokens = [SampledToken(s, t, lp, [i for i, _ in top], [v for _, v in top]) for s, t, lp, top in rows]
    back = tokens_from_proto(pb.ExecuteResponse.FromString(tokens_to_proto(tokens).SerializeToString()))
    assert [(t.seq_id, t.token_id, list(t.top_token_ids)) for t in back] == \
        [(t.seq_id, t.token_id, t.top_token_ids) for t in tokens]
    for got, sent in zip(back, tokens, strict=True):  # floats travel as float32
        assert abs(got.logprob - sent.logprob) <= 1e-5 * max(1.0, abs(sent.logprob))


def test_a_kept_prefix_without_held_tables_touches_only_its_sequence() -> None:
    """`table_kept` alone (no `table_held`): the sequence with a kept count gets the held prefix in front of its
    blocks; one with 0 keeps its own table, held or not."""
    receiver = HeldInputs()
    receiver.tables = {1: [10, 11, 12]}
    resolved = receiver.resolve_tables([1, 2], [[13], [20]], (), [3, 0])
    assert [list(table) for table in resolved] == [[10, 11, 12, 13], [20]]


def test_sampling_parameters_are_sent_once_and_refused_when_not_held() -> None:
    params = SamplingParams(0.5, 40, 0.875, 2**40 + 3, 2)
    sender, receiver = SentInputs(), HeldInputs()

    def decode(seq_id: int, position: int, sampling: SamplingParams | None = params) -> SequenceInput:
        return SequenceInput(seq_id, [LAST_SAMPLED], position, [3], [12 + position], sampling)

    for step_id, position in ((1, 0), (2, 1)):
        request = step_to_proto(StepInput([decode(7, position)], step_id=step_id), held=sender)
        received = step_from_proto(request, receiver)
        receiver.commit(received)
        assert received.sequences[0].sampling == params
    assert (list(request.sampling_held), list(request.temperature)) == ([True], [])  # the second time: held
    # another sequence joins: its parameters follow, the held ones do not
    mixed = step_to_proto(StepInput([decode(7, 2), decode(8, 0, GREEDY)], step_id=3), held=sender)
    assert (list(mixed.sampling_held), list(mixed.top_k)) == ([True, False], [GREEDY.top_k])
    assert [s.sampling for s in step_from_proto(mixed, receiver).sequences] == [params, GREEDY]
    # an executor that holds none (restarted): refused, naming the sequence; so is a field of the wrong length
    with pytest.raises(InvalidRequest, match=r"sampling_held\[0\]: this executor holds no sampling parameters for "
                                             "sequence 7"):
        step_from_proto(request, HeldInputs())
    del mixed.sampling_held[:]
    mixed.sampling_held.extend([True])
    with pytest.raises(InvalidRequest, match="sampling_held: 1 entries for 2 sequences that sample"):
        step_from_proto(mixed, receiver)
    # released: sent again
    sender.release([7])
    again = step_to_proto(StepInput([decode(7, 3)], step_id=4), held=sender)
    assert (list(again.sampling_held), list(again.seed)) == ([], [params.seed])


BS = 4  # the block size of the same_batch tests


@st.composite
def steady_runs(draw: st.DrawFn) -> list[tuple[StepInput, bool]]:
    """A prefill of a few sequences, then decode steps that are mostly the last step's batch again, each step
    with whether it is that (and every input held): or broken in one of the ways that make it another batch."""
    num_seqs = draw(st.integers(1, 5))
    tables = {seq_id: list(range(seq_id * 10, seq_id * 10 + 6)) for seq_id in range(1, num_seqs + 1)}
    samplings = {seq_id: draw(sampling) for seq_id in tables}
    ends = {seq_id: draw(st.integers(1, 8)) for seq_id in tables}

    def seq(seq_id: int, tokens: list[int], start: int) -> SequenceInput:
        slots = [slot_of(tables[seq_id], p, BS) for p in range(start, start + len(tokens))]
        return SequenceInput(seq_id, tokens, start, tables[seq_id], slots, samplings[seq_id])

    ids = list(tables)  # the batch's order, kept from step to step
    run = [(StepInput([seq(s, [5] * ends[s], 0) for s in ids], step_id=1), False)]
    for step_id in range(2, draw(st.integers(2, 9)) + 1):
        change = draw(st.sampled_from(["none"] * 6 + ["grow", "new sampling", "leave", "join", "jump", "known token",
                                                       "chunk", "reorder", "not sampled", "unnumbered"]))
        if change in ("leave", "reorder") and len(ids) == 1:
            change = "none"  # one sequence cannot leave or change places: the batch stays
        if change == "grow":
            grown = draw(st.sampled_from(ids))
            tables[grown] = [*tables[grown], 99]
        elif change == "new sampling":
            changed = draw(st.sampled_from(ids))
            samplings[changed] = SamplingParams(*samplings[changed])  # equal, but another object: sent again
        elif change == "leave":
            del tables[ids.pop()]
        elif change == "join":
            new = max(ids) + 1
            tables[new], samplings[new], ends[new] = list(range(new * 10, new * 10 + 6)), GREEDY, 0
            ids.append(new)
        elif change == "reorder":
            ids.reverse()
        sequences = [seq(s, [LAST_SAMPLED], ends[s]) for s in ids]
        at = draw(st.integers(0, len(ids) - 1))
        if change == "jump":
            ends[ids[at]] += 1
            sequences[at] = seq(ids[at], [LAST_SAMPLED], ends[ids[at]])
        elif change == "known token":
            sequences[at] = seq(ids[at], [7], ends[ids[at]])
        elif change == "chunk":
            sequences[at] = seq(ids[at], [7, 8], ends[ids[at]])
        elif change == "not sampled":
            sequences[at] = sequences[at]._replace(sampling=None)
        repeated = change == "none" and run[-1][0].step_id == step_id - 1  # not after an unnumbered step
        run.append((StepInput(sequences, step_id=0 if change == "unnumbered" else step_id), repeated))
        for s in sequences:
            ends[s.seq_id] = s.start_position + len(s.token_ids)
    return run


@settings(max_examples=150, deadline=None)
@given(steady_runs())
def test_the_steady_decode_step_goes_as_the_same_batch_and_runs_as_sent(run: list[tuple[StepInput, bool]]) -> None:
    """A step goes as `same_batch` exactly when it is the last step's batch again (the same sequences in the same
    order, each decoding what it sampled at its next position, tables and sampling parameters held), and then
    carries no per-sequence field; either way the executor runs the step the frontend built. The scheduler sends
    such a step without its rows (SchedulerConfig.repeat_batches): the same message, and an in-process executor
    fills in the same rows (`HeldInputs.fill`)."""
    sender, receiver, unnamed_sender, in_process = SentInputs(), HeldInputs(), SentInputs(), HeldInputs()
    for step, repeated in run:
        request = pb.ExecuteRequest.FromString(step_to_proto(step, 3, sender).SerializeToString())
        assert request.same_batch == repeated
        unnamed = StepInput((), step_id=step.step_id, same_batch=True) if repeated else step
        assert step_to_proto(unnamed, 3, unnamed_sender) == request
        assert as_lists(in_process.fill(unnamed, BS)) == as_lists(step)
        if repeated:
            assert [field.name for field, _ in request.ListFields()] == ["step_id", "epoch", "same_batch"]
        received = step_from_proto(request, receiver, BS)
        if received.same_batch:  # as the server records it (ExecutorServicer.accept)
            receiver.commit_repeated(received)
        else:
            receiver.commit(received)
        assert as_lists(received) == as_lists(step)
        assert (received.step_id, received.same_batch) == (step.step_id, repeated)


def test_a_same_batch_step_is_refused_unless_its_batch_and_inputs_are_held() -> None:
    table = [3, 4]
    first = StepInput([SequenceInput(7, [5, 6], 0, table, [12, 13], GREEDY)], step_id=5)
    receiver = HeldInputs()
    receiver.commit(step_from_proto(step_to_proto(first), receiver, BS))
    again = pb.ExecuteRequest(step_id=6, same_batch=True)
    assert as_lists(step_from_proto(again, receiver, BS)) == [(7, [LAST_SAMPLED], 2, table, [14], GREEDY)]
    with pytest.raises(InvalidRequest, match="same_batch: step 6 repeats the batch of step 5, but the last step this "
                                             "executor holds is none"):
        step_from_proto(again, HeldInputs(), BS)
    with pytest.raises(InvalidRequest, match="same_batch: step 8 repeats the batch of step 7, but the last step this "
                                             "executor holds is step 5"):
        step_from_proto(pb.ExecuteRequest(step_id=8, same_batch=True), receiver, BS)
    with pytest.raises(InvalidRequest, match="seq_ids: must be empty in a same_batch step"):
        step_from_proto(pb.ExecuteRequest(step_id=6, same_batch=True, seq_ids=[7]), receiver, BS)
    with pytest.raises(InvalidRequest, match="sampling_held: must be empty in a same_batch step"):
        step_from_proto(pb.ExecuteRequest(step_id=6, same_batch=True, sampling_held=[True]), receiver, BS)
    # its table does not reach position 8 (2 blocks of 4), or it is not held at all
    receiver.batch = (5, (7,), (8,))
    with pytest.raises(InvalidRequest, match="sequence 7's held table of 2 blocks does not reach its next position 8"):
        step_from_proto(again, receiver, BS)
    receiver.release([7])
    with pytest.raises(InvalidRequest, match="holds no block table or sampling parameters for sequence 7"):
        step_from_proto(again, receiver, BS)
    receiver.batch = (5, (), ())
    with pytest.raises(InvalidRequest, match="step 5 ran no sequences to run again"):
        step_from_proto(again, receiver, BS)


def test_a_sequence_freed_and_admitted_again_in_one_step_is_held_for_the_next_same_batch() -> None:
    """A preemption by recompute frees a sequence and admits it again in one step (its release and its new row
    together): the release comes first, as the runner frees its KV before running the step, so its new table and
    parameters are held after, and the next step may repeat the batch on both sides (once, a same_batch step
    found sequence 2 not held: the release had been applied after the row)."""
    sender, receiver, in_process = SentInputs(), HeldInputs(), HeldInputs()
    old_table, new_table = [3, 4], [8, 9]
    run = [StepInput([SequenceInput(2, [5, 6, 7], 0, old_table, [12, 13, 14], GREEDY)], step_id=1),
           StepInput([SequenceInput(2, [5, 6, 7, 1], 0, new_table, [32, 33, 34, 35], GREEDY)], step_id=2,
                     released_seq_ids=[2]),
           StepInput((), step_id=3, same_batch=True)]
    for step in run:
        request = step_to_proto(step, 0, sender)
        received = step_from_proto(request, receiver, BS)
        receiver.commit_repeated(received) if received.same_batch else receiver.commit(received)
        filled = in_process.fill(step, BS)
        assert as_lists(filled) == as_lists(received)
    assert as_lists(received) == [(2, [LAST_SAMPLED], 4, new_table, [36], GREEDY)]
    assert receiver.tables == sender.tables == in_process.tables == {2: new_table}
    # a same_batch step may not release one of its own batch: refused by the sender, and by the receiver
    with pytest.raises(ValueError, match="step 4 is flagged same_batch, but it releases sequence 2 of that batch"):
        step_to_proto(StepInput((), step_id=4, same_batch=True, released_seq_ids=[2]), 0, sender)
    with pytest.raises(InvalidRequest, match="holds no block table or sampling parameters for sequence 2"):
        step_from_proto(pb.ExecuteRequest(step_id=4, same_batch=True, released_seq_ids=[2]), receiver, BS)
    assert receiver.tables == {2: new_table}  # a refused step changed nothing


def test_a_step_the_scheduler_sends_unnamed_needs_the_batch_of_the_step_before() -> None:
    """A `same_batch` step without sequences repeats the batch the sender holds for step_id - 1 (the scheduler's
    last step): anything else is a bug in the scheduler, raised before anything is sent."""
    first = StepInput([SequenceInput(7, [5, 6], 0, [3, 4], [12, 13], GREEDY)], step_id=5)
    sender = SentInputs()
    step_to_proto(first, 0, sender)
    with pytest.raises(ValueError, match="step 7 is flagged same_batch, but the batch held is step 5's"):
        step_to_proto(StepInput((), step_id=7, same_batch=True), 0, sender)
    with pytest.raises(ValueError, match="step 6 is flagged same_batch, but no batch of the step before is held"):
        step_to_proto(StepInput((), step_id=6, same_batch=True), 0, SentInputs())
    with pytest.raises(ValueError, match="step 6 is flagged same_batch, but names sequences"):
        step_to_proto(StepInput(first.sequences, step_id=6, same_batch=True), 0, sender)
    request = step_to_proto(StepInput((), step_id=6, same_batch=True, released_seq_ids=[2]), 0, sender)
    assert (request.step_id, request.same_batch, list(request.released_seq_ids)) == (6, True, [2])
    assert sender.batch == (6, (7,), (3,))  # one position on
    in_process = HeldInputs()  # in process, the same rule
    in_process.batch = sender.batch
    with pytest.raises(InvalidRequest, match="step 9 repeats the batch of step 8"):
        in_process.fill(StepInput((), step_id=9, same_batch=True), BS)
