"""The three KV layouts (paged, virtual, static) behind one engine: same greedy tokens, what each holds.

Every engine gets its own runner over one loaded model; paged caches and static slots are NaN-filled, and a
virtual region reads as zeros until written, so a read of KV a step never wrote shows as a different token.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_model import EOS, VOCAB

from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.executor.engine_config import build_runner, build_sequence_kv
from pagedserve.services.executor.options import ExecutorConfig
from pagedserve.services.executor.runner import ModelRunner
from pagedserve.services.executor.step_types import GREEDY, SequenceInput, StepInput
from pagedserve.services.executor.virtual_kv import StaticKV, VirtualKV
from pagedserve.services.frontend.engine import Engine, EngineLimits
from pagedserve.services.frontend.ports import LocalBlockManager, LocalExecutor
from pagedserve.services.frontend.request import GenerationParams, Request
from pagedserve.services.frontend.scheduler import Scheduler, SchedulerConfig, shares_kv

rng = random.Random(1)
PROMPTS = [[rng.randrange(2, 90) for _ in range(n)] for n in (3, 40, 9, 70, 1, 33, 12, 64)]
GREEDY_40 = GenerationParams(max_tokens=40, ignore_eos=True)
BLOCK_SIZES = {"paged": 4, "virtual": 32, "static": 0}  # tiny model: 128-byte K rows, 32 per 4 KiB page
Factory = Callable[..., tuple[Engine, BlockManager, ModelRunner]]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> ModelRunner:
    runner, _ = build_runner(ExecutorConfig(model=str(tiny_llama_dir), num_blocks=8, device="cpu", dtype="float32"))
    return runner


@pytest.fixture
def make_engine(loaded: ModelRunner, overlap: bool) -> Factory:
    def make(layout: str, num_blocks: int = 256, max_num_batched_tokens: int = 64,
             max_num_seqs: int = 16) -> tuple[Engine, BlockManager, ModelRunner]:
        max_len = loaded.max_model_len
        block_size = BLOCK_SIZES[layout] or max_len
        kv = build_sequence_kv(layout, loaded.config, loaded.dtype, loaded.device, block_size, num_blocks, max_len,
                               4096)
        runner = ModelRunner(loaded.model, loaded.config, loaded.backend, block_size, num_blocks, 0, max_len, kv)
        for k, v in runner.kv_caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        if isinstance(kv, StaticKV):
            kv.slots.fill_(float("nan"))
        manager = BlockManager(num_blocks, block_size)
        scheduler = Scheduler(SchedulerConfig(block_size, max_len, max_num_seqs, max_num_batched_tokens,
                                              share_kv=shares_kv(layout)), LocalBlockManager(manager))
        engine = Engine(scheduler, LocalExecutor(runner), EngineLimits(VOCAB, max_len, num_blocks, block_size,
                                                                       frozenset({EOS})),
                        CacheIdentity("tiny", "tiny", "", "float32", block_size), overlap)
        return engine, manager, runner

    return make


def run(engine: Engine, prompts: list[list[int]], params: GenerationParams,
        each_step: Callable[[], None] = lambda: None) -> list[Request]:
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_work:
        engine.step()
        each_step()
    return requests


def tokens(requests: list[Request]) -> list[list[list[int]]]:
    return [[s.output_token_ids for s in sorted(r.seqs, key=lambda s: s.index)] for r in requests]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_greedy_output_is_the_same_in_every_layout(make_engine: Factory) -> None:
    results = {}
    for layout in ("paged", "virtual", "static"):
        engine, manager, _ = make_engine(layout)
        results[layout] = tokens(run(engine, PROMPTS, GREEDY_40))
        assert manager.stats().num_used_blocks == 0
    assert results["virtual"] == results["paged"]
    assert results["static"] == results["paged"]


@pytest.mark.parametrize("overlap", [False], ids=["serial"])  # the runner idle between steps: its state can be read
def test_virtual_commits_exactly_its_blocks_and_releases_them(make_engine: Factory) -> None:
    """Under a budget too small for the batch (preemption by recompute, chunked prefill), the memory the virtual
    layout has committed is, after every step, exactly its blocks in the block manager (a block is 2 layers x
    (K, V) x one 4 KiB page); a finished or preempted sequence's pages go back with the next step."""
    reference = tokens(run(make_engine("paged")[0], PROMPTS, GREEDY_40))
    engine, manager, runner = make_engine("virtual", num_blocks=7, max_num_batched_tokens=24)
    kv = runner.sequence_kv
    assert isinstance(kv, VirtualKV)
    block_bytes = 2 * 2 * 4096
    checked, peak = 0, 0

    def check() -> None:
        nonlocal checked, peak
        peak = max(peak, kv.committed_bytes)
        # frees the executor has not been told of yet, or spares the scheduler has not: it is a step behind
        if not engine.scheduler.kv.has_released and not engine.scheduler.kv.has_deferred_answer:
            assert kv.committed_bytes == manager.stats().num_used_blocks * block_bytes
            checked += 1

    requests = run(engine, PROMPTS, GREEDY_40, check)
    assert tokens(requests) == reference
    assert engine.scheduler.num_preemptions["recompute"] > 0
    assert checked > 50 and 0 < peak <= 7 * block_bytes
    assert kv.num_page_commits * 4096 > peak  # pages released and committed again
    runner.execute(StepInput([], released_seq_ids=engine.scheduler.kv.take_released()))  # the idle engine's last frees
    assert kv.committed_bytes == 0 and not kv.regions


@pytest.mark.parametrize("overlap", [True], ids=["overlap"])
def test_n_samples_and_repeated_prompts_share_nothing_outside_paged(make_engine: Factory) -> None:
    """Paged: one prompt prefill for n = 3 (forks), and a repeated prompt hits the prefix cache. Virtual: n
    independent sequences and no hits, with the same tokens (sample i is seeded seed + i either way)."""
    params = GenerationParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    paged, _, _ = make_engine("paged")
    virtual, _, _ = make_engine("virtual")
    paged_requests = run(paged, [PROMPTS[3], PROMPTS[3]], params)
    virtual_requests = run(virtual, [PROMPTS[3], PROMPTS[3]], params)
    assert tokens(paged_requests) == tokens(virtual_requests)
    assert len({tuple(t) for t in tokens(paged_requests)[0]}) > 1  # the samples differ
    assert paged_requests[1].num_cached_tokens > 0
    assert all(r.num_cached_tokens == 0 for r in virtual_requests)


def test_a_step_that_assumes_shared_kv_is_refused(loaded: ModelRunner) -> None:
    kv = build_sequence_kv("virtual", loaded.config, loaded.dtype, loaded.device, 32, 8, loaded.max_model_len, 4096)
    runner = ModelRunner(loaded.model, loaded.config, loaded.backend, 32, 8, 0, loaded.max_model_len, kv)
    runner.execute(StepInput([SequenceInput(1, [5, 6, 7], 0, [0], [0, 1, 2], GREEDY)]))
    with pytest.raises(InvalidRequest, match="holds 0 of its tokens"):  # a prefix hit: KV it never computed
        runner.execute(StepInput([SequenceInput(2, [5], 3, [1], [35], GREEDY)]))
    with pytest.raises(InvalidRequest, match="holds 0 of its tokens"):  # released in the same step
        runner.execute(StepInput([SequenceInput(1, [8], 3, [0], [3], GREEDY)], released_seq_ids=[1]))
    with pytest.raises(InvalidRequest, match="copies: a per-sequence KV layout"):
        runner.execute(StepInput([], copies=[(0, 1)]))
    runner.execute(StepInput([SequenceInput(1, [8], 3, [0], [3], GREEDY)]))  # its own next token is fine


def test_virtual_block_size_must_be_whole_pages(tiny_llama_dir: Path) -> None:
    config = ExecutorConfig(model=str(tiny_llama_dir), num_blocks=8, device="cpu", dtype="float32",
                            kv_layout="virtual", block_size=16)
    with pytest.raises(ValueError, match="use a multiple of 32"):
        build_runner(config)
