"""A tiny random-weight Llama (a real model, saved as safetensors) and engines built around it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from tiny_model import EOS, VOCAB

from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.block_manager.step import Op, StepAnswer
from pagedserve.services.executor.engine_config import build_runner
from pagedserve.services.executor.options import ExecutorConfig
from pagedserve.services.frontend.engine import Engine, EngineLimits, ModelIdentity
from pagedserve.services.frontend.ports import LocalBlockManager, LocalExecutor
from pagedserve.services.frontend.scheduler import Scheduler, SchedulerConfig

EngineFactory = Callable[..., tuple[Engine, BlockManager]]


class CheckedBlockManager(LocalBlockManager):
    """Every invariant of the block manager recomputed after each step's ops, not only at the end."""

    def step(self, ops: Sequence[Op]) -> StepAnswer:
        answer = super().step(ops)
        self.manager.check_integrity()
        return answer


@pytest.fixture(scope="session")
def runners() -> dict[tuple[int, int], object]:
    return {}  # one model load per cache shape, for the whole session


@pytest.fixture(params=[True, False], ids=["overlap", "serial"])
def overlap(request: pytest.FixtureRequest) -> bool:
    """Every engine test runs with overlapped steps (the default) and in lock step."""
    return bool(request.param)


@pytest.fixture
def make_engine(tiny_llama_dir: Path, runners: dict[tuple[int, int], object], overlap: bool) -> EngineFactory:
    def make(num_blocks: int = 256, block_size: int = 4, cpu_blocks: int = 0, max_num_seqs: int = 16,
             max_num_batched_tokens: int = 64, preemption_mode: str = "recompute") -> tuple[Engine, BlockManager]:
        key = (num_blocks, block_size)
        if key not in runners:  # one model load per cache shape; the swap pool is sized per runner below
            runners[key] = build_runner(ExecutorConfig(
                model=str(tiny_llama_dir), num_blocks=num_blocks, block_size=block_size,
                cpu_swap_bytes=1 << 30, device="cpu", dtype="float32",
            ))
        runner, info = runners[key]  # type: ignore[misc]
        manager = BlockManager(num_blocks, block_size, num_cpu_blocks=min(cpu_blocks, info.num_cpu_blocks))
        scheduler = Scheduler(
            SchedulerConfig(block_size, info.max_model_len, max_num_seqs, max_num_batched_tokens,
                            preemption_mode),  # type: ignore[arg-type]
            CheckedBlockManager(manager),
        )
        limits = EngineLimits(VOCAB, info.max_model_len, num_blocks, block_size, frozenset({EOS}))
        identity = ModelIdentity(info.model_digest, "tiny", "", info.dtype)
        return Engine(scheduler, LocalExecutor(runner), limits, identity, overlap), manager

    return make
