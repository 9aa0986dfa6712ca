"""The scheduler's fast paths on their own: quiet plans and repeated batches (services/frontend/fast_paths.py).

The engine tests check them end to end against full plans and named rows (tests/engine/test_engine.py); these
pin each condition down with hand-made sequences."""

from __future__ import annotations

from pagedserve.services.frontend.fast_paths import FastPaths
from pagedserve.services.frontend.request import GenerationParams, Request, SeqStatus, Sequence

BLOCK_SIZE = 4


def decoding(num_tokens: int, num_blocks: int, max_tokens: int = 100, num_pending: int = 1) -> Sequence:
    """A running sequence decoding steadily: every token known is computed, and `num_pending` more are being
    sampled (its next input is the newest of them)."""
    request = Request("r", [1, 2], GenerationParams(max_tokens=max_tokens), b"ns", seed=0)
    seq = Sequence(num_tokens, request, 0, list(range(num_tokens)), SeqStatus.RUNNING,
                   num_computed=num_tokens + num_pending - 1)
    seq.block_table, seq.num_pending, seq.tail_private = list(range(num_blocks)), num_pending, True
    return seq


def fast(spare_lookahead: int = 0, repeat_batches: bool = True) -> FastPaths:
    return FastPaths(BLOCK_SIZE, max_model_len=1000, spare_lookahead=spare_lookahead, repeat_batches=repeat_batches)


def test_a_quiet_stretch_lasts_while_every_sequence_has_a_free_slot() -> None:
    # 3 and 5 computed in 8 slots: the tighter has 3 free; one slot is kept back without spares, two with
    running = [decoding(3, 2, num_pending=1), decoding(4, 2, num_pending=2)]
    paths = fast()
    paths.start_quiet(list(running), running)
    assert paths.quiet_steps == 2
    with_spares = fast(spare_lookahead=2)
    with_spares.start_quiet(list(running), running)
    assert with_spares.quiet_steps == 1
    for left in (1, 0):
        assert paths.quiet_plan(running) == running
        assert paths.quiet_steps == left
    assert paths.quiet_plan(running) is None  # the stretch is over: a full plan runs


def test_a_quiet_stretch_ends_before_a_length_limit() -> None:
    running = [decoding(3, 10, max_tokens=4)]  # prompt 2 + 4: three tokens known, one pending, two to go
    paths = fast()
    paths.start_quiet(list(running), running)
    assert paths.quiet_steps == 1


def test_no_quiet_stretch_unless_every_running_sequence_decodes_here() -> None:
    running = [decoding(3, 4), decoding(3, 4)]
    paths = fast()
    paths.start_quiet(running[:1], running)  # the other one needs the block manager
    assert paths.quiet_steps == 0 and paths.quiet_plan(running) is None
    paths.start_quiet(list(running), running)
    assert paths.quiet_steps > 0
    assert paths.quiet_plan([running[1], running[0]]) is None  # other sequences (or order): a full plan
    assert paths.quiet_plan(running[:1]) is None
    paths.stop_quiet()
    assert paths.quiet_plan(running) is None


def test_a_batch_repeats_when_the_same_sequences_decode_what_they_sampled() -> None:
    batch = [decoding(3, 4), decoding(5, 4)]
    paths = fast()
    assert not paths.repeats(batch, table_version=0)  # no step sent yet
    paths.rows_sent(list(batch), num_rows=2, table_version=0)
    assert paths.repeats(list(batch), table_version=0)
    paths.repeat(batch)
    assert [(s.num_computed, s.num_local_slots, s.num_pending) for s in batch] == [(4, 1, 2), (6, 1, 2)]


def test_a_batch_does_not_repeat_when_anything_differs() -> None:
    batch = [decoding(3, 4), decoding(5, 4)]
    paths = fast()
    paths.rows_sent(list(batch), num_rows=2, table_version=7)
    assert not paths.repeats(batch, table_version=8)  # a table changed: the rows must carry it
    assert not paths.repeats(batch[::-1], table_version=7)
    assert not paths.repeats(batch[:1], table_version=7)
    assert not paths.repeats([], table_version=7)
    batch[1].num_pending = 0  # its input is known now (a token came back): not LAST_SAMPLED
    assert not paths.repeats(batch, table_version=7)
    batch[1].num_pending, batch[0].status = 1, SeqStatus.FINISHED
    assert not paths.repeats(batch, table_version=7)
    batch[0].status = SeqStatus.RUNNING
    assert paths.repeats(batch, table_version=7)
    assert not fast(repeat_batches=False).repeats(batch, table_version=-1)


def test_a_batch_that_did_not_all_sample_is_not_repeated_and_reset_forgets_it() -> None:
    batch = [decoding(3, 4), decoding(5, 4)]
    paths = fast()
    paths.rows_sent(batch[:1], num_rows=2, table_version=0)  # one row did not sample (a prefill chunk)
    assert not paths.repeats(batch[:1], table_version=0)
    paths.rows_sent(list(batch), num_rows=2, table_version=0)
    paths.start_quiet(list(batch), batch)
    paths.reset()
    assert not paths.repeats(batch, table_version=0) and paths.quiet_plan(batch) is None
