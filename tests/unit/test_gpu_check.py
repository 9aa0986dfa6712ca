"""scripts/gpu-check.sh as far as a machine without a GPU can check it: it says there is none and runs
nothing, and every benchmark flag it will pass on a GPU exists (a typo would cost the first GPU session)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu-check.sh"


def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 2 and "no CUDA GPU is visible" in run.stderr
    assert not out.exists()


def test_every_benchmark_flag_it_passes_exists() -> None:
    steps = re.findall(r"^step \S+ \d+ bench ([\w-]+) (.*)$", SCRIPT.read_text(), flags=re.MULTILINE)
    assert {name for name, _ in steps} >= {"kernels", "model", "executor", "serve", "overhead", "host-step"}
    for name, args in steps:
        usage = subprocess.run([sys.executable, "-m", "pagedserve", "bench", name, "--help"], capture_output=True,
                               text=True, timeout=120, check=True).stdout
        for flag in re.findall(r"(--[a-z-]+)", args):
            assert flag in usage, f"bench {name} has no {flag}"
