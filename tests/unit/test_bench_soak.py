"""`bench soak` through `pagedserve serve` on the tiny model for a few seconds: its clients cancel and
disconnect, and nothing leaks or fails unasked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_soak_short_run_has_no_errors_and_no_leaks(tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "soak", "--model", str(tiny_chat_model_dir), "--minutes",
         "0.15", "--clients", "3", "--json", "--out", str(out)],
        check=True, timeout=600, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert result["requests"] > 10 and result["errors"] == 0, result
    assert result["cancelled"] + result["disconnected"] > 0  # the mix asked for some
    assert result["leaked_blocks"] == 0
    assert sorted(result["rss_growth_mib"]) == ["block-manager", "executor", "frontend"]
    assert result["p99_ttft_drift"] > 0
