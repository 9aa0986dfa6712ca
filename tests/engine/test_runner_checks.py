"""The runner checks a sequence's block table only when it changes (a new object), never trusting one that a
refused step brought, and forgets what it checked at a release or a reset."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.executor.engine_config import build_runner
from pagedserve.services.executor.options import ExecutorConfig
from pagedserve.services.executor.runner import ModelRunner
from pagedserve.services.executor.step_types import GREEDY, SequenceInput, StepInput

BS = 4


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    runner, _ = build_runner(ExecutorConfig(model=str(tiny_llama_dir), num_blocks=16, block_size=BS, device="cpu",
                                            dtype="float32"))
    return runner


def decode(seq_id: int, position: int, table: list[int]) -> StepInput:
    slot = table[position // BS] * BS + position % BS
    return StepInput([SequenceInput(seq_id, [7], position, table, [slot], GREEDY)])


def test_a_table_is_checked_whenever_it_is_a_new_one(runner: ModelRunner) -> None:
    runner.reset()
    table = [1, 2]
    runner.execute(StepInput([SequenceInput(1, [5, 6, 7], 0, table, [4, 5, 6], GREEDY)]))
    runner.execute(decode(1, 3, table))  # the same table: valid, as before
    bad = [1, 99]  # the next table names a block outside the cache of 16
    for _ in range(2):  # refused both times: a refused step's table is never taken as checked
        with pytest.raises(InvalidRequest, match="block_table: 99 outside"):
            runner.execute(decode(1, 4, bad))
    runner.execute(decode(1, 4, [1, 3]))  # a good new table runs


def test_release_and_reset_forget_the_checked_tables(runner: ModelRunner) -> None:
    runner.reset()
    table = [4, 5]
    runner.execute(decode(2, 0, table))
    assert runner._checked_tables.tables == {2: table}
    runner.execute(StepInput([], released_seq_ids=[2]))
    assert runner._checked_tables.tables == {}
    runner.execute(decode(3, 0, table))
    runner.reset()
    assert runner._checked_tables.tables == {}
    table.append(99)  # changed in place, against the contract: a reset runner checks it again all the same
    with pytest.raises(InvalidRequest, match="block_table: 99 outside"):
        runner.execute(decode(3, 0, table))
