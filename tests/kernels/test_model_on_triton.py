"""The production path end to end: the model with the Triton kernels inside it (compiled on a GPU, the
interpreter on the CPU), driven by the real engine (scheduler, block manager, block tables), compared
step by step with the torch backend on the same weights and the same steps.

Every step the engine sends runs on both runners; each must sample the same tokens with logprobs within
fp32 tolerance. The workload makes the engine use every op: chunked prefill, a prefix hit, decode across
block boundaries, an n = 2 fork (copy-on-write of the shared tail block), and preemption by swap (blocks
out to the CPU pool and back). Both runners' caches start as NaN, so a slot read before it is written shows.
"""

from __future__ import annotations

import itertools
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from tiny_model import randomize_norms_and_biases

from pagedserve.kernels import get_backend
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.executor.model.loader import load_model
from pagedserve.services.executor.runner import ModelRunner
from pagedserve.services.executor.step_types import SampledToken, StepInput
from pagedserve.services.frontend.engine import Engine, EngineLimits
from pagedserve.services.frontend.ports import LocalBlockManager
from pagedserve.services.frontend.request import GenerationParams, Request
from pagedserve.services.frontend.scheduler import Scheduler, SchedulerConfig

NUM_BLOCKS, BLOCK_SIZE, CPU_BLOCKS = 20, 4, 64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def save_tiny(kind: str, path: Path) -> Path:
    """A 2-layer random model of the kind, biases and norms randomised (a dropped one would show)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        kind, vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, eos_token_id=None,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_norms_and_biases(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def nan_runner(path: Path, backend: str) -> ModelRunner:
    model, config = load_model(str(path), torch.float32, DEVICE, get_backend(backend))  # type: ignore[arg-type]
    runner = ModelRunner(model, config, get_backend(backend), BLOCK_SIZE, NUM_BLOCKS, CPU_BLOCKS, 256)
    for caches in (runner.kv_caches, runner.cpu_caches):
        for k, v in caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
    return runner


class StepByStep:
    """An executor port that runs each step on the Triton runner and on the torch runner and compares."""

    def __init__(self, triton: ModelRunner, reference: ModelRunner) -> None:
        self.triton, self.reference = triton, reference
        self.seen: Counter[str] = Counter()  # which ops the engine's steps used

    def submit(self, step: StepInput) -> Future[list[SampledToken]]:
        ours, theirs = self.triton.execute(step), self.reference.execute(step)
        assert [t.token_id for t in ours] == [t.token_id for t in theirs], f"step {step.step_id}"
        torch.testing.assert_close(torch.tensor([t.logprob for t in ours]), torch.tensor([t.logprob for t in theirs]),
                                   atol=1e-4, rtol=1e-4)
        self.seen["copies"] += bool(step.copies)
        self.seen["swap_out"] += bool(step.swap_out)
        self.seen["swap_in"] += bool(step.swap_in)
        self.seen["chunked"] += any(len(s.token_ids) > 1 and s.sampling is None for s in step.sequences)
        self.seen["decode"] += any(len(s.token_ids) == 1 for s in step.sequences)
        done: Future[list[SampledToken]] = Future()
        done.set_result(ours)
        return done


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_model_on_triton_kernels_steps_as_the_torch_path(kind: str, tmp_path: Path) -> None:
    path = save_tiny(kind, tmp_path / kind)
    executor = StepByStep(nan_runner(path, "triton"), nan_runner(path, "torch"))
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, CPU_BLOCKS)
    # every step names its sequences: StepByStep runs each on two runners itself, holding no batch
    scheduler = Scheduler(SchedulerConfig(BLOCK_SIZE, 256, 8, 8, "swap", repeat_batches=False),
                          LocalBlockManager(manager))
    engine = Engine(scheduler, executor, EngineLimits(96, 256, NUM_BLOCKS, BLOCK_SIZE, frozenset()),
                    CacheIdentity("digest", kind, "", "float32", BLOCK_SIZE))
    prompt = [(7 * i + 3) % 96 for i in range(13)]
    greedy = GenerationParams(max_tokens=12, ignore_eos=True)

    def run(requests: list[tuple[list[int], GenerationParams]]) -> list[Request]:
        made = [engine.add_request(f"{next(ids)}", p, g) for p, g in requests]
        while engine.has_work:
            engine.step()
        return made

    ids = itertools.count()
    (cold,) = run([(prompt, greedy)])  # chunked prefill (8-token budget), decodes across block boundaries
    (hit,) = run([(prompt, greedy)])
    assert cold.num_cached_tokens == 0 and hit.num_cached_tokens == 12  # 3 full blocks of 4 from the cache
    assert hit.seqs[0].output_token_ids == cold.seqs[0].output_token_ids
    sampled = GenerationParams(max_tokens=10, temperature=0.9, seed=5, n=2, ignore_eos=True)
    run([(prompt[:10], sampled)])  # a fork: both samples share the prompt's tail block until they write it
    # five at once in 20 blocks: some are swapped out to the CPU pool and back
    run([([(5 * i + j) % 96 for i in range(9)], GenerationParams(max_tokens=16, ignore_eos=True)) for j in range(5)])
    assert executor.seen["chunked"] and executor.seen["decode"] and executor.seen["copies"]
    assert executor.seen["swap_out"] and executor.seen["swap_in"]
    assert manager.stats().num_used_blocks == 0
    manager.check_integrity()
