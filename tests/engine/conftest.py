"""A tiny random-weight Llama (a real model, saved as safetensors) and engines built around it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from tiny_model import EOS, VOCAB

from pagedserve.services.block_manager.contract import AdvanceOp, DecodeOp, Op, SpareOp, StepAnswer
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.executor.engine_config import build_runner, dtype_name
from pagedserve.services.executor.options import ExecutorConfig
from pagedserve.services.executor.runner import ModelRunner
from pagedserve.services.frontend.engine import Engine, EngineLimits
from pagedserve.services.frontend.ports import LocalBlockManager, LocalExecutor
from pagedserve.services.frontend.scheduler import Scheduler, SchedulerConfig

EngineFactory = Callable[..., tuple[Engine, BlockManager]]


class CheckedBlockManager(LocalBlockManager):
    """Every invariant of the block manager recomputed after each step's ops, not only at the end; the ops
    counted by kind (a Decode, Advance or Spare by its sequences), and the calls."""

    def __init__(self, manager: BlockManager) -> None:
        super().__init__(manager)
        self.op_counts: Counter[str] = Counter()
        self.num_calls = 0

    def step(self, ops: Sequence[Op]) -> StepAnswer:
        self.num_calls += 1
        for op in ops:
            packed = isinstance(op, DecodeOp | AdvanceOp | SpareOp)
            self.op_counts[type(op).__name__] += len(op.seq_ids) if packed else 1
        answer = super().step(ops)
        self.manager.check_integrity()
        return answer


@pytest.fixture(scope="session")
def runners() -> dict[tuple[int, int], object]:
    return {}  # one model load per cache shape, for the whole session


def fresh_runner(loaded: ModelRunner, num_cpu_blocks: int, kv_dtype: torch.dtype | None = None) -> ModelRunner:
    """A runner of its own over the loaded model's weights, its KV caches (in `kv_dtype`, default the model's)
    filled with NaN: a read of a slot this engine never wrote shows (it cannot read back what an earlier engine,
    say a reference run, left)."""
    runner = ModelRunner(loaded.model, loaded.config, loaded.backend, loaded.block_size, loaded.num_blocks,
                         num_cpu_blocks, loaded.max_model_len, kv_dtype=kv_dtype)
    for caches in (runner.kv_caches, runner.cpu_caches):
        for k, v in caches:
            k.fill_(float("nan"))
            v.fill_(float("nan"))
    return runner


@pytest.fixture(params=[True, False], ids=["overlap", "serial"])
def overlap(request: pytest.FixtureRequest) -> bool:
    """Every engine test runs with overlapped steps (the default) and in lock step."""
    return bool(request.param)


@pytest.fixture
def make_engine(tiny_llama_dir: Path, runners: dict[tuple[int, int], object], overlap: bool) -> EngineFactory:
    def make(num_blocks: int = 256, block_size: int = 4, cpu_blocks: int = 0, max_num_seqs: int = 16,
             max_num_batched_tokens: int = 64, preemption_mode: str = "recompute",
             local_decodes: bool = True, spare_lookahead: int = 8,
             kv_dtype: torch.dtype | None = None, repeat_batches: bool = True) -> tuple[Engine, BlockManager]:
        key = (num_blocks, block_size)
        if key not in runners:  # one model load per cache shape
            runners[key] = build_runner(ExecutorConfig(
                model=str(tiny_llama_dir), num_blocks=num_blocks, block_size=block_size, device="cpu",
                dtype="float32",
            ))
        loaded, info = runners[key]  # type: ignore[misc]
        runner = fresh_runner(loaded, cpu_blocks, kv_dtype)
        manager = BlockManager(num_blocks, block_size, num_cpu_blocks=cpu_blocks)
        scheduler = Scheduler(
            SchedulerConfig(block_size, info.max_model_len, max_num_seqs, max_num_batched_tokens,
                            preemption_mode, local_decodes=local_decodes,  # type: ignore[arg-type]
                            spare_lookahead=spare_lookahead, repeat_batches=repeat_batches),
            CheckedBlockManager(manager),
        )
        limits = EngineLimits(VOCAB, info.max_model_len, num_blocks, block_size, frozenset({EOS}))
        identity = CacheIdentity(info.model_digest, "tiny", "", dtype_name(runner.kv_dtype), block_size)
        return Engine(scheduler, LocalExecutor(runner), limits, identity, overlap), manager

    return make
