"""`bench overhead` through its real processes (frontend, block manager, executor stand-in) on a tiny run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_overhead_runs_both_modes_and_every_request_reads_the_same(
    tiny_chat_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "overhead.json"
    subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "overhead", "--model", str(tiny_chat_model_dir), "--seqs", "6",
         "--step-ms", "5", "--tokens", "40", "--json", "--out", str(out)],
        check=True, timeout=600, env={**os.environ, "PYTHONSAFEPATH": "1"}, capture_output=True, text=True,
    )
    result = json.loads(out.read_text())
    assert "stand-in" in result["executor"]
    for prefix in ("", "serial_"):
        assert 0.0 <= result[f"{prefix}overhead_frac_6_5ms"] < 1.0
        assert result[f"{prefix}steps_6_5ms"] >= 10  # steps in which all six sequences decoded
        # the part of the gaps spent waiting for the next step to arrive is a part of them
        assert 0.0 <= result[f"{prefix}gap_waiting_for_frontend_ms_6_5ms"] <= result[f"{prefix}gap_ms_6_5ms"]
    # overlapped and serial steps, six requests each: one text, so no token was lost, repeated or streamed late
    assert result["one_text_for_all_runs"] is True
