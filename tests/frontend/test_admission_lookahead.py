"""Admission that leaves the running sequences room to grow (services/frontend/growth.py, Scheduler._admit).

The real engine, scheduler and block manager in process, in front of the executor stand-in of `bench blocks`
(benchmarks/standin_executor.py: it samples a token per position, with no model); no EOS, so a request ends at
its `max_tokens` unless it names a stop token. Everything is counted in engine steps, never in time. The last
test runs the tiny real model instead: the reserve changes when a sequence runs, never what it computes."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import EOS, VOCAB

from pagedserve.benchmarks.standin_executor import StandInRunner, Timeline
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.common.kv_geometry import blocks_for
from pagedserve.services.executor.engine_config import build_runner
from pagedserve.services.executor.options import ExecutorConfig
from pagedserve.services.frontend.engine import Engine, EngineLimits
from pagedserve.services.frontend.growth import (
    Growing,
    OutputLengths,
    forked_growth,
    peak_growth,
    sharing_once,
    total_growth,
)
from pagedserve.services.frontend.ports import LocalBlockManager, LocalExecutor
from pagedserve.services.frontend.request import GenerationParams, Request, SeqStatus
from pagedserve.services.frontend.scheduler import Scheduler, SchedulerConfig

BLOCK_SIZE = 4
VOCAB_SIZE = 1000
MAX_MODEL_LEN = 256


@contextmanager
def engine_over(num_blocks: int, reserve_growth: bool = True, watermark: float = 0.0) -> Iterator[Engine]:
    """An engine over a cache of `num_blocks` blocks (by default no watermark: every block is admissible)."""
    config = SchedulerConfig(BLOCK_SIZE, MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=256,
                             reserve_growth=reserve_growth)
    manager = BlockManager(num_blocks, BLOCK_SIZE, watermark=watermark)
    executor = LocalExecutor(StandInRunner(0.0, VOCAB_SIZE, Timeline(), BLOCK_SIZE))
    limits = EngineLimits(VOCAB_SIZE, MAX_MODEL_LEN, num_blocks, BLOCK_SIZE, frozenset())
    identity = CacheIdentity("test-admission", "", "", "float32", BLOCK_SIZE)
    try:
        yield Engine(Scheduler(config, LocalBlockManager(manager)), executor, limits, identity)
    finally:
        executor.thread.shutdown()
    manager.check_integrity()


def add(engine: Engine, name: str, prompt_len: int, max_tokens: int) -> Request:
    prompt = [1 + (len(name) * 31 + i) % (VOCAB_SIZE - 1) for i in range(prompt_len)]
    return engine.add_request(name, prompt, GenerationParams(max_tokens=max_tokens), final_only=True)


def expect_outputs_of(engine: Engine, length: int, count: int = 16) -> None:
    """The scheduler has seen `count` sequences finish with `length` output tokens."""
    for _ in range(count):
        engine.scheduler.output_lengths.observe(length)


def running(request: Request) -> bool:
    return request.seqs[0].status is SeqStatus.RUNNING


def run_to_end(engine: Engine, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError(f"the engine still has work after {max_steps} steps")


# ---- the estimate ----------------------------------------------------------------------------------------


def test_the_estimate_is_a_percentile_of_the_latest_finished_lengths() -> None:
    lengths = OutputLengths(window=20, min_observed=4, percentile=35)
    for length in (50, 10, 40):
        lengths.observe(length)
    assert lengths.typical == 0  # three finished: no estimate yet
    lengths.observe(30)
    assert lengths.typical == 30  # 10 30 40 50: the 35th percentile is the second
    for _ in range(20):  # a change of traffic: the old lengths leave the window
        lengths.observe(200)
    assert lengths.typical == 200


def test_the_expected_length_is_capped_by_the_sequences_own_limit() -> None:
    with engine_over(num_blocks=64) as engine:
        short, long = add(engine, "short", 8, max_tokens=10), add(engine, "long", 8, max_tokens=100)
        lengths = engine.scheduler.output_lengths
        assert lengths.entry(short.seqs[0], MAX_MODEL_LEN).end == 8  # no estimate yet: nothing more
        expect_outputs_of(engine, 40)
        assert lengths.entry(short.seqs[0], MAX_MODEL_LEN) == Growing(0, 8, 8 + 10)  # its max_tokens
        assert lengths.entry(long.seqs[0], MAX_MODEL_LEN) == Growing(0, 8, 8 + 40)  # the typical output
        long.seqs[0].token_ids += [7] * 50  # past the typical length, and no finished one was longer: stops now
        assert lengths.entry(long.seqs[0], MAX_MODEL_LEN) == Growing(0, 58, 58, frees=False)


def test_a_sequence_past_the_typical_length_is_expected_to_go_on_into_the_tail() -> None:
    lengths = OutputLengths(window=100, min_observed=4, percentile=60)
    for length in [10] * 60 + list(range(100, 140)):  # most stop at 10; the longer ones spread over 100-139
        lengths.observe(length)
    assert lengths.typical == 100 and lengths.expected_output(0) == 100
    # past it: the tail percentile (10th) of the lengths beyond its own
    assert lengths.expected_output(100) == 101 + (39 * 10 // 100) and lengths.expected_output(120) == 121 + 1
    assert lengths.expected_output(139) == 139  # none longer: expected to stop now
    assert OutputLengths().expected_output(7) == 7  # no estimate


def test_finished_sequences_feed_the_estimate_and_aborted_ones_do_not() -> None:
    with engine_over(num_blocks=256) as engine:
        for i in range(16):
            add(engine, f"r{i}", 6, max_tokens=5 + i % 2)  # outputs of 5 and 6 tokens
        add(engine, "aborted", 6, max_tokens=200)
        engine.step()
        engine.abort("aborted")
        run_to_end(engine)
        assert engine.scheduler.output_lengths.typical == 6  # the 60th percentile of eight 5s and eight 6s
        for _ in range(11):  # 19 of 27 are 5s: past the 60th percentile
            engine.scheduler.output_lengths.observe(5)
        assert engine.scheduler.output_lengths.typical == 5


@pytest.mark.parametrize("percentile", [-1, 100])
def test_a_percentile_outside_its_range_is_refused(percentile: int) -> None:
    with pytest.raises(ValueError, match="percentile"):
        OutputLengths(percentile=percentile)


def test_an_estimate_needs_at_least_one_finished_sequence() -> None:
    with pytest.raises(ValueError, match="min_observed"):
        OutputLengths(window=8, min_observed=0)


def brute_force_peak(seqs: list[Growing], block_size: int) -> int:
    """The reserve's reference: every sequence's blocks at every step, each growing a token a step until its
    expected end and holding nothing after it (one that does not free them holds its end's blocks throughout);
    the most taken at once beyond what they hold now."""
    steady = [s for s in seqs if not s.frees or s.end <= s.known]
    ending = [s for s in seqs if s not in steady]
    horizon = max((s.end - s.known for s in ending), default=0)
    return sum(max(0, blocks_for(s.end, block_size) - s.held) for s in steady) + max(
        [0] + [sum(blocks_for(s.known + t, block_size) for s in ending if s.known + t <= s.end)
               - sum(s.held for s in ending) for t in range(horizon + 1)])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16), st.lists(st.tuples(st.integers(0, 30), st.integers(0, 300), st.integers(0, 200),
                                              st.booleans()), max_size=12))
def test_the_peak_bounds_the_brute_force_peak_within_a_block_a_sequence(
        block_size: int, raw: list[tuple[int, int, int, bool]]) -> None:
    seqs = [Growing(held, known, known + more, frees) for held, known, more, frees in raw]
    exact = brute_force_peak(seqs, block_size)
    peak = peak_growth(seqs, block_size)
    assert exact <= peak <= exact + len(seqs)
    # the sum of their growth, were they all to end at once, is never below the peak
    assert exact <= total_growth(seqs, block_size)


def test_the_peak_counts_the_blocks_a_sequence_frees_as_it_ends() -> None:
    # blocks of 4. One sequence 8 tokens from its end, one 40: the first frees its 3 blocks (12 tokens) before the
    # second has grown 40 tokens, so the peak is the second's growth less the block the first held
    short, long = Growing(held=1, known=4, end=12), Growing(held=1, known=4, end=44)
    assert total_growth([short, long], 4) == (3 - 1) + (11 - 1)
    assert brute_force_peak([short, long], 4) == 11 - 1 - 1 == peak_growth([short, long], 4)
    # one in the long tail is not counted on to free its blocks: its growth counts in full, throughout
    assert peak_growth([Growing(held=1, known=4, end=12, frees=False), long], 4) == (3 - 1) + (11 - 1)
    # a sample forked from a sequence of 10 tokens shares its 2 full blocks of 4 and grows its own past them
    assert forked_growth(Growing(held=0, known=10, end=30), 4) == Growing(0, 2, 22)
    # one with nothing more to grow still needs the blocks of what it knows and has not computed
    assert peak_growth([Growing(held=1, known=20, end=20)], 4) == 5 - 1


def test_samples_of_one_request_give_back_their_shared_prompt_blocks_once_the_last_ends() -> None:
    # blocks of 4. Three samples of a 16-token prompt (4 shared full blocks), each with 4 tokens of its own (1
    # block): 5 blocks in each table, 4 + 3 held. One ends in 4 tokens (2 blocks of its own then), two in 40
    # (11 of their own); beside them a sequence growing from 1 block to 11. In truth the first's end gives back
    # its 2 own blocks only: the shared 4 stay until the last sample ends
    family = [Growing(held=5, known=20, end=24), Growing(held=5, known=20, end=60), Growing(held=5, known=20, end=60)]
    other = Growing(held=1, known=4, end=44)

    def truth(t: int) -> int:  # blocks in use t steps from now
        alive = [s for s in family if s.known + t <= s.end]
        own = sum(blocks_for(s.known + t, 4) - 4 for s in alive)
        return (4 if alive else 0) + own + (blocks_for(other.known + t, 4) if other.known + t <= other.end else 0)

    held_now = 4 + 3 * 1 + other.held
    real_peak = max(truth(t) for t in range(41)) - held_now
    reckoned = sharing_once(family, 16, 4)
    assert reckoned[0] == Growing(held=1, known=4, end=8)  # without the shared blocks: it does not end last
    assert peak_growth([*reckoned, other], 4) >= real_peak
    assert peak_growth([*family, other], 4) < real_peak  # each sample's table counted as given back in full
    assert sharing_once(family[:1], 16, 4) == family[:1] and sharing_once(family, 3, 4) == family  # nothing shared


# ---- admission ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reserve_growth", [True, False])
def test_a_running_sequences_expected_growth_is_reserved(reserve_growth: bool) -> None:
    # 20 blocks of 4. The running request holds 1-2 of them and is expected to reach 4 + 60 tokens (16 blocks);
    # the waiting one's prompt takes 10 blocks: it fits the free blocks, not the free blocks less the reserve.
    # Admitted anyway (no reserve), both grow until one of them is preempted
    with engine_over(num_blocks=20, reserve_growth=reserve_growth) as engine:
        expect_outputs_of(engine, 60)
        first = add(engine, "first", 4, max_tokens=64)
        engine.step()
        assert running(first)
        second = add(engine, "second", 40, max_tokens=30)
        for _ in range(5):
            engine.step()
        assert running(second) is not reserve_growth
        assert (engine.scheduler.num_reserve_holds > 0) is reserve_growth  # the metric's count
        run_to_end(engine)
        preemptions = engine.scheduler.num_preemptions["recompute"]
        assert preemptions == 0 if reserve_growth else preemptions > 0


@pytest.mark.parametrize("n", [1, 3])
def test_the_samples_a_request_will_fork_are_reserved_for(n: int) -> None:
    # 20 blocks of 4, outputs of 40 observed. The running request (4 + 40 tokens: 11 blocks at its end) and a
    # waiting one of 8 + 20 tokens (7 blocks a sample): one sample fits beside it at the peak (6 + 7 - 1 of the
    # 19 free), three do not (each forked sample grows 5 blocks past the 2 of the prompt they share)
    with engine_over(num_blocks=20) as engine:
        expect_outputs_of(engine, 40)
        first = add(engine, "first", 4, max_tokens=40)  # as long as the estimate: it is right
        engine.step()
        prompt = [1 + i for i in range(8)]
        forking = engine.add_request("forking", prompt, GenerationParams(max_tokens=20, n=n), final_only=True)
        engine.step()
        assert running(first) and running(forking) is (n == 1)
        run_to_end(engine)
        assert forking.finished and engine.scheduler.num_preemptions["recompute"] == 0


def test_a_lone_request_is_admitted_whatever_the_estimate() -> None:
    # 40 blocks, 4 of them below the watermark. Outputs of 200 tokens observed: each request below is expected to
    # reach 40 + 120 tokens, the whole cache, more than the 36 blocks admission may give. With nothing running the
    # first is admitted all the same (else it would wait forever), and the second waits for it to end
    with engine_over(num_blocks=40, watermark=0.1) as engine:
        expect_outputs_of(engine, 200)
        first, second = add(engine, "first", 40, max_tokens=120), add(engine, "second", 40, max_tokens=120)
        engine.step()
        assert running(first) and not running(second)
        while not first.finished:
            engine.step()
            assert not running(second) or first.finished
        run_to_end(engine)
        assert second.finished and engine.scheduler.num_preemptions["recompute"] == 0


def test_an_old_waiting_request_is_not_overtaken_and_is_admitted() -> None:
    # a long prompt waits behind the reserve while short requests keep arriving behind it: none of them is
    # admitted before it, and it is admitted once the running sequences have ended
    with engine_over(num_blocks=48) as engine:
        expect_outputs_of(engine, 30)
        early = [add(engine, f"early{i}", 8, max_tokens=30) for i in range(4)]
        engine.step()
        assert all(map(running, early))
        old = add(engine, "old", 96, max_tokens=40)  # expected to reach 96 + 30 while the early ones run
        late: list[Request] = []
        for i in range(200):
            late.append(add(engine, f"late{i}", 4, max_tokens=4))  # one block each: each would fit alone
            engine.step()
            assert running(old) or not any(map(running, late))
            if running(old):
                break
        assert running(old), "the old request was never admitted"
        assert len(late) > 1  # it did wait behind the reserve (24 blocks fit the free ones from the start)
        run_to_end(engine)
        assert all(r.finished for r in [*early, old, *late])


def test_greedy_outputs_are_the_same_with_and_without_the_reserve(tiny_llama_dir: Path) -> None:
    # 24 blocks of 4 for six requests of 9-16 + 30 tokens: without the reserve they preempt each other, with it
    # they wait; the tokens are the same
    rng = random.Random(5)
    prompts = [[rng.randrange(1, EOS) for _ in range(rng.randrange(9, 17))] for _ in range(6)]
    outputs, preemptions = {}, {}
    for reserve_growth in (True, False):
        runner, info = build_runner(ExecutorConfig(model=str(tiny_llama_dir), num_blocks=24, block_size=BLOCK_SIZE,
                                                   device="cpu", dtype="float32"))
        config = SchedulerConfig(BLOCK_SIZE, info.max_model_len, 16, 64, reserve_growth=reserve_growth)
        executor = LocalExecutor(runner)
        engine = Engine(Scheduler(config, LocalBlockManager(BlockManager(24, BLOCK_SIZE))), executor,
                        EngineLimits(VOCAB, info.max_model_len, 24, BLOCK_SIZE, frozenset({EOS})),
                        CacheIdentity(info.model_digest, "tiny", "", "float32", BLOCK_SIZE))
        try:
            expect_outputs_of(engine, 30)
            greedy = GenerationParams(max_tokens=30, ignore_eos=True)
            requests = [engine.add_request(f"r{i}", p, greedy, final_only=True) for i, p in enumerate(prompts)]
            run_to_end(engine)
        finally:
            executor.thread.shutdown()
        outputs[reserve_growth] = [r.seqs[0].output_token_ids for r in requests]
        preemptions[reserve_growth] = engine.scheduler.num_preemptions["recompute"]
    assert outputs[True] == outputs[False] and all(len(o) == 30 for o in outputs[True])
    assert preemptions[True] < preemptions[False], preemptions
