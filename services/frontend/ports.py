"""The two services the scheduler drives, as interfaces: in-process adapters here, gRPC ones in remote.py.

`BlockManagerPort.step` answers one batch of ops (validated as a whole, applied in order) with one outcome
per op and the block statistics after the step. `ExecutorPort.execute` runs one step: block moves, the
forward pass, sampling; it returns one token per sequence that asked for one, in request order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ..block_manager.manager import BlockManager
from ..block_manager.stats import BlockStats
from ..block_manager.step import Op, StepAnswer, apply_step
from ..executor.step_types import SampledToken, StepInput

if TYPE_CHECKING:  # the scheduler imports this module in the frontend, which must not load torch
    from ..executor.runner import ModelRunner


class BlockManagerPort(Protocol):
    def step(self, ops: Sequence[Op]) -> StepAnswer: ...

    def stats(self) -> BlockStats: ...


class ExecutorPort(Protocol):
    def execute(self, step: StepInput) -> list[SampledToken]: ...


class LocalBlockManager:
    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager

    def step(self, ops: Sequence[Op]) -> StepAnswer:
        return StepAnswer(apply_step(self.manager, ops), self.manager.stats())

    def stats(self) -> BlockStats:
        return self.manager.stats()


class LocalExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, step: StepInput) -> list[SampledToken]:
        return self.runner.execute(step)
