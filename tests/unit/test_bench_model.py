"""`bench model` on the CPU with the tiny model: our fp32 path agrees with HF transformers token for token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_model_fp32_on_the_cpu_agrees_with_hf(tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "model", "--model", str(tiny_chat_model_dir), "--device", "cpu",
         "--dtypes", "float32", "--prompts", "3", "--new-tokens", "8", "--json", "--out", str(out)],
        check=True, timeout=600, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert result["greedy_match_float32"] == 1.0 and result["greedy_prefix_float32"] == 1.0
    assert 0 < result["logprob_max_abs_diff_float32"] < 1e-4  # close, and measured (not a missing value)
