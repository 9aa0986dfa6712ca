"""The two services the scheduler drives, as interfaces: in-process adapters here, the gRPC clients in
services/block_manager/client.py and services/executor/client.py.

`BlockManagerPort.step` answers one batch of ops (validated as a whole, applied in order) with one outcome
per op and the block statistics after the step; `send` makes the same call and returns at once, so that the
engine collects a step's tokens while the block manager works. `ExecutorPort.submit` sends one step (block moves, the
forward pass, sampling) and returns at once; its `result()` is one token per sequence that asked for one,
in request order. Steps run in the order they are submitted, so step N+1 can be sent while N runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from ..block_manager.contract import BlockStats, Op, StepAnswer
from ..block_manager.manager import BlockManager
from ..block_manager.step import apply_step
from ..executor.held_inputs import HeldInputs
from ..executor.step_types import SampledToken, StepInput

if TYPE_CHECKING:  # the scheduler imports this module in the frontend, which must not load torch
    from ..executor.runner import ModelRunner

T = TypeVar("T")
R = TypeVar("R")


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


def _step_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")


class LocalExecutor:
    """The runner on a thread of its own, so that the engine plans the next step while this one runs.

    `load` builds the runner on that thread, and `call` runs other torch work there: libgomp gives every thread
    that opens an OpenMP region a pool of worker threads of its own, and once the pools' threads outnumber the
    cores, each pool's workers stop spinning and sleep at every barrier, so that each of a step's ~200 parallel
    regions waits for a wake-up (a decode step at 64 sequences 10-15 % slower on two cores, docs/performance.md,
    "One OpenMP pool"). The executor service loads on its step thread for the same reason."""

    def __init__(self, runner: ModelRunner, thread: ThreadPoolExecutor | None = None) -> None:
        self.runner = runner
        self.thread = thread or _step_thread()
        self.held = HeldInputs()  # the last batch, its tables and sampling parameters, as the executor's server holds

    @classmethod
    def load(cls, build: Callable[[], tuple[ModelRunner, T]]) -> tuple[LocalExecutor, T]:
        """The runner `build` makes on the new step thread, with what else it returns."""
        thread = _step_thread()
        try:
            runner, extra = thread.submit(build).result()
        except BaseException:
            thread.shutdown()  # a model that failed to load leaves no thread behind
            raise
        return cls(runner, thread), extra

    def call(self, fn: Callable[..., R], *args: Any) -> R:
        """fn(*args) on the step thread, after the steps submitted before it."""
        return self.thread.submit(fn, *args).result()

    def submit(self, step: StepInput) -> RunningStep:
        """Runs the step after those submitted before; a `same_batch` step's sequences are the held batch's."""
        return self.thread.submit(self.runner.execute, self.held.fill(step, self.runner.block_size))
