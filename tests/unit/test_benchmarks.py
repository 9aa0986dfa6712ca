"""`pagedserve bench blocks` on a small trace: the JSON it prints and the utilization targets it must meet.

Utilization is deterministic for a seed; latencies are only checked for presence (no timing asserts).
"""

import json
import os
import subprocess
import sys

import pytest

from pagedserve.benchmarks.workloads import sharegpt_like


def test_trace_is_seedable_and_shaped_like_sharegpt() -> None:
    specs = sharegpt_like(3000, seed=1)
    assert specs == sharegpt_like(3000, seed=1) and specs != sharegpt_like(3000, seed=2)
    mean_in = sum(s.prompt_len for s in specs) / len(specs)
    mean_out = sum(s.output_len for s in specs) / len(specs)
    assert 140 < mean_in < 180 and 300 < mean_out < 370
    assert max(s.prompt_len + s.output_len for s in specs) <= 2048
    assert max(s.output_len for s in specs) > 4 * mean_out  # heavy right tail


def test_bench_blocks_json_meets_targets() -> None:
    cmd = [sys.executable, "-m", "pagedserve", "bench", "blocks", "--json", "--num-requests", "300",
           "--decode-seqs", "64", "--steps", "30"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300,
                         env={**os.environ, "PYTHONSAFEPATH": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kv_utilization_paged"] >= 0.96
    assert result["kv_utilization_paged"] >= 2.5 * result["kv_utilization_reserved"]
    assert result["max_concurrent_paged"] > result["max_concurrent_reserved"] == 16
    for key in ("step_us_inprocess_p50", "step_rpc_us_p50", "step_rpc_us_p99"):
        assert result[key] > 0


def test_bench_executor_json_smoke() -> None:
    """The executor benchmark runs both sides and reports every key (its numbers are not asserted: timing)."""
    cmd = [sys.executable, "-m", "pagedserve", "bench", "executor", "--json", "--batches", "1,2", "--new-tokens", "3",
           "--repeats", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600,
                         env={**os.environ, "PYTHONSAFEPATH": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for batch in (1, 2):
        assert result[f"ours_tok_s_batch{batch}"] > 0 and result[f"hf_tok_s_batch{batch}"] > 0
        assert result[f"ratio_batch{batch}"] == pytest.approx(
            result[f"ours_tok_s_batch{batch}"] / result[f"hf_tok_s_batch{batch}"], rel=0.01
        )
