"""`python -m pagedserve.benchmarks.kernels --tiny --json` runs and reports what docs/kernels.md promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RESULT_KEYS = {
    "batch", "context", "num_heads", "num_kv_heads", "head_dim", "gqa", "num_splits", "kv_bytes", "paged_ms",
    "paged_gbps", "bandwidth_share", "sdpa_ms", "speedup_vs_sdpa", "max_abs_diff_vs_sdpa",
}  # fmt: skip


def test_tiny_benchmark_prints_json(tmp_path: Path) -> None:
    # The script must switch the interpreter on by itself when there is no GPU.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out_file = tmp_path / "bench.json"
    command = [sys.executable, "-m", "pagedserve.benchmarks.kernels", "--tiny", "--json", "--out", str(out_file)]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads(out_file.read_text()) == report
    assert report["benchmark"] == "paged_decode_attention" and report["mode"] == "tiny"
    assert report["copy_bandwidth_gbps"] > 0
    assert report["skipped"] == []
    [row] = report["results"]
    assert set(row) == RESULT_KEYS
    assert row["paged_ms"] > 0 and row["sdpa_ms"] > 0 and row["bandwidth_share"] >= 0
    assert row["max_abs_diff_vs_sdpa"] < 5e-3  # the paged kernel computed the same attention as SDPA
