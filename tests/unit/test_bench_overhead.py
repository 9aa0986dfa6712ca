"""`bench overhead` through its real processes (frontend, block manager, executor stand-in) on a tiny run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.benchmarks.standin_executor import StandInRunner, Timeline
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.executor.step_types import GREEDY, LAST_SAMPLED, SequenceInput, StepInput


def test_bench_overhead_runs_both_modes_and_every_request_reads_the_same(
    tiny_chat_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "overhead.json"
    subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "overhead", "--model", str(tiny_chat_model_dir), "--seqs", "6",
         "--step-ms", "5", "--tokens", "40", "--repeats", "1", "--json", "--out", str(out)],
        check=True, timeout=600, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert "stand-in" in result["executor"]
    for prefix in ("", "serial_"):
        assert 0.0 <= result[f"{prefix}overhead_frac_6_5ms"] < 1.0
        # what the cores allow the processes' CPU: a floor under the overhead (interpolated CPU samples: a margin)
        assert 0.0 <= result[f"{prefix}cpu_floor_overhead_frac_6_5ms"] <= result[f"{prefix}overhead_frac_6_5ms"] + 0.02
        assert result[f"{prefix}steps_6_5ms"] >= 10  # steps in which all six sequences decoded
        # the part of the gaps spent waiting for the next step to arrive is a part of them
        assert 0.0 <= result[f"{prefix}gap_waiting_for_frontend_ms_6_5ms"] <= result[f"{prefix}gap_ms_6_5ms"]
    # overlapped and serial steps, six requests each: one text, so no token was lost, repeated or streamed late
    assert result["one_text_for_all_runs"] is True


def test_bench_overhead_with_streaming_callers(tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "overhead", "--model", str(tiny_chat_model_dir), "--seqs", "6",
         "--step-ms", "5", "--tokens", "40", "--modes", "overlap", "--stream", "--repeats", "1", "--json",
         "--out", str(out)],
        check=True, timeout=600, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert 0.0 <= result["overhead_frac_6_5ms_stream"] < 1.0 and result["steps_6_5ms_stream"] >= 10
    assert "overhead_frac_6_5ms" not in result and "serial_overhead_frac_6_5ms_stream" not in result
    # every stream's chunks put together read the same: none was lost or repeated
    assert result["one_text_for_all_runs"] is True


def test_bench_overhead_reports_the_median_of_three_runs(tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "overhead", "--model", str(tiny_chat_model_dir), "--seqs", "6",
         "--step-ms", "5", "--tokens", "40", "--modes", "overlap", "--json", "--out", str(out)],  # 3 by default
        check=True, timeout=600, capture_output=True, text=True)
    result = json.loads(out.read_text())
    rounds = result["overhead_frac_6_5ms_rounds"]
    assert result["repeats"] == 3 and len(rounds) == 3 and rounds == sorted(rounds)
    assert result["overhead_frac_6_5ms"] == rounds[1]  # the median run's, with the rest of its keys
    assert 0.0 <= result["cpu_floor_overhead_frac_6_5ms"] <= result["overhead_frac_6_5ms"] + 0.02
    assert "serial_overhead_frac_6_5ms" not in result and result["one_text_for_all_runs"] is True


def test_the_stand_in_samples_by_position_and_checks_last_sampled_as_the_runner_does() -> None:
    runner = StandInRunner(0.0, 100, Timeline())
    token = {position: 1 + position * 7919 % 99 for position in range(8)}  # depends on the position alone
    first = runner.execute(StepInput([SequenceInput(1, [5, 6], 0, [0], [0, 1], GREEDY),
                                      SequenceInput(2, [7], 0, [1], [4], None)], step_id=1))  # 2 samples nothing
    assert [(t.seq_id, t.token_id) for t in first] == [(1, token[2])]
    again = runner.execute(StepInput([SequenceInput(1, [LAST_SAMPLED], 2, [0], [2], GREEDY)], step_id=2))
    assert [(t.seq_id, t.token_id) for t in again] == [(1, token[3])]
    for sequences, step_id, error in [
        ([SequenceInput(1, [LAST_SAMPLED], 3, [0], [3], GREEDY)], 4, "step 4 asks for the tokens step 3 sampled"),
        ([SequenceInput(1, [LAST_SAMPLED], 3, [0], [3], GREEDY), SequenceInput(2, [LAST_SAMPLED], 1, [1], [5], GREEDY)],
         3, r"sequences\[1\].token_ids: step 2 sampled no token for sequence 2"),
        ([SequenceInput(1, [LAST_SAMPLED, 5], 3, [0], [3, 4], GREEDY)], 3, "stands alone"),
    ]:
        with pytest.raises(InvalidRequest, match=error):
            runner.execute(StepInput(sequences, step_id=step_id))
    # refused steps changed nothing: step 3 may still ask for what step 2 sampled
    assert runner.execute(StepInput([SequenceInput(1, [LAST_SAMPLED], 3, [0], [3], GREEDY)], step_id=3))[0].seq_id == 1
