"""The two services the scheduler drives, as interfaces: in-process adapters here, the gRPC clients in
services/block_manager/client.py and services/executor/client.py.

`BlockManagerPort.step` answers one batch of ops (validated as a whole, applied in order) with one outcome
per op and the block statistics after the step; `send` makes the same call and returns at once, so that the
engine collects a step's tokens while the block manager works. `ExecutorPort.submit` sends one step (block moves, the
forward pass, sampling) and returns at once; its `result()` is one token per sequence that asked for one,
in request order. Steps run in the order they are submitted, so step N+1 can be sent while N runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ..block_manager.manager import BlockManager
from ..block_manager.stats import BlockStats
from ..block_manager.step import Op, StepAnswer, apply_step
from ..executor.step_types import SampledToken, StepInput

if TYPE_CHECKING:  # the scheduler imports this module in the frontend, which must not load torch
    from ..executor.runner import ModelRunner


class PendingAnswer(Protocol):
    def result(self) -> StepAnswer: ...


class BlockManagerPort(Protocol):
    def step(self, ops: Sequence[Op]) -> StepAnswer: ...

    def send(self, ops: Sequence[Op]) -> PendingAnswer: ...

    def stats(self) -> BlockStats: ...

    def reset(self) -> BlockStats: ...


class RunningStep(Protocol):
    def result(self) -> list[SampledToken]: ...


class ExecutorPort(Protocol):
    def submit(self, step: StepInput) -> RunningStep: ...


class LocalBlockManager:
    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager

    def step(self, ops: Sequence[Op]) -> StepAnswer:
        return StepAnswer(apply_step(self.manager, ops), self.manager.stats())

    def send(self, ops: Sequence[Op]) -> PendingAnswer:
        return Answered(self.step(ops))  # in process there is nothing to overlap it with

    def stats(self) -> BlockStats:
        return self.manager.stats()

    def reset(self) -> BlockStats:
        self.manager.reset()
        return self.manager.stats()


class Answered(NamedTuple):
    answer: StepAnswer

    def result(self) -> StepAnswer:
        return self.answer


class LocalExecutor:
    """The runner on a thread of its own, so that the engine plans the next step while this one runs."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")

    def submit(self, step: StepInput) -> RunningStep:
        return self.thread.submit(self.runner.execute, step)
