"""`bench fleet`: the simulation (the router's own choice over simulated pods, each a real BlockManager) and a tiny
real run (three `pagedserve serve` pods of the tiny chat model, a `pagedserve router` per policy, pinned clients):
the report's keys and their consistency, not the targets (those are for the real default run: docs/routing.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedserve.benchmarks.fleet_sim import StepCosts, simulate
from pagedserve.benchmarks.fleet_workload import multi_tenant, oracle_hit_rate, reusable_tokens

ARMS = ["kv-aware", "least-load", "round-robin", "random", "pinned"]
ARM_KEYS = {"ttft_p50_s", "ttft_p90_s", "tok_s", "prefix_hit_rate", "max_over_mean_requests", "requests",
            "requests_per_pod_max", "requests_per_pod_min"}
SUMMARY_KEYS = {"kv_aware_ttft_p90_vs_round_robin", "kv_aware_tok_s_vs_round_robin", "kv_aware_hit_rate",
                "oracle_hit_rate", "router_overhead_ms_p50", "targets", "targets_met"}


def bench(*flags: str, timeout: float) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "fleet", "--json", *flags],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def check_consistent(result: dict[str, Any], requests: int) -> None:
    assert set(result) >= SUMMARY_KEYS and sorted(result["arms"]) == sorted(ARMS)
    assert sorted(result["arm_order"]) == sorted(ARMS)
    for name, arm in result["arms"].items():
        assert set(arm) == ARM_KEYS, name
        assert arm["requests"] == requests, name  # every arm served the whole trace
        assert 0.0 <= arm["prefix_hit_rate"] <= 1.0, name
        assert 0.0 < arm["ttft_p50_s"] <= arm["ttft_p90_s"], name
        assert arm["tok_s"] > 0 and arm["max_over_mean_requests"] >= 1.0, name
        assert arm["requests_per_pod_min"] <= arm["requests_per_pod_max"], name
    kv, rr = result["arms"]["kv-aware"], result["arms"]["round-robin"]
    assert result["kv_aware_hit_rate"] == kv["prefix_hit_rate"]
    assert result["kv_aware_ttft_p90_vs_round_robin"] == pytest.approx(kv["ttft_p90_s"] / rr["ttft_p90_s"], abs=1e-3)
    assert result["kv_aware_tok_s_vs_round_robin"] == pytest.approx(kv["tok_s"] / rr["tok_s"], abs=1e-3)
    assert 0.0 < result["oracle_hit_rate"] < 1.0
    assert result["arms"]["round-robin"]["max_over_mean_requests"] == pytest.approx(1.0, abs=0.34)


def test_simulated_fleet_reports_every_arm_under_the_oracle() -> None:
    result = bench("--simulate", "--pods", "6", "--requests", "150", "--request-rate", "8", timeout=120)
    assert result["mode"] == "simulated" and result["router_overhead_ms_p50"] is None
    check_consistent(result, 150)
    assert result["shape"]["tenants"] == 16 and result["prefixes_exceed_one_pod"]  # grown with --pods 6
    for name, arm in result["arms"].items():  # an upper bound of every policy
        assert arm["prefix_hit_rate"] <= result["oracle_hit_rate"] + 1e-9, name
    # kv-aware follows the prefixes it is told of: more hits than the policies blind to them
    kv = result["arms"]["kv-aware"]["prefix_hit_rate"]
    assert kv > result["arms"]["round-robin"]["prefix_hit_rate"] and kv > result["arms"]["random"]["prefix_hit_rate"]


def test_simulation_is_seeded_and_the_oracle_counts_each_prefix_once() -> None:
    workload = multi_tenant(40, 4, 2, 64, 8, 2, 10.0, range(100, 200), seed=3)
    assert workload == multi_tenant(40, 4, 2, 64, 8, 2, 10.0, range(100, 200), seed=3)
    tenants = {r.tenant for r in workload.requests}
    expected = (len(workload.requests) - len(tenants)) * reusable_tokens(72, 64, 16) / (72 * len(workload.requests))
    assert oracle_hit_rate(workload, 16) == pytest.approx(expected)
    costs = StepCosts(prefill_tok_s=1000.0, decode_step_s=0.02)
    first, again = (simulate("random", workload, 3, 40, 16, costs, seed=5) for _ in range(2))
    assert first == again and first.cached_tokens <= oracle_hit_rate(workload, 16) * first.prompt_tokens
    assert len(first.served) == 40 and first.output_tokens == 80


def test_tiny_real_fleet_behind_the_router(tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    result = bench("--tiny", "--model", str(tiny_chat_model_dir), "--overhead-pairs", "4", "--out", str(out),
                   timeout=300)
    assert json.loads(out.read_text()) == result
    assert result["mode"] == "real" and result["shape"]["pods"] == 3
    check_consistent(result, 12)
    assert isinstance(result["router_overhead_ms_p50"], float)
    low, high = result["router_overhead_ms_ci95"]
    assert low <= result["router_overhead_ms_p50"] <= high
    low, high = result["router_overhead_e2e_ms_ci95"]
    assert low <= result["router_overhead_e2e_ms_p50"] <= high
    routed, floor = result["router_overhead"]["routed"], result["router_overhead"]["floor"]
    # the pass-through hop served the same requests, compared with the same direct ones
    assert routed["pairs"] == floor["pairs"] == 4 and routed["direct_ms_p50"] == floor["direct_ms_p50"] > 0
    assert floor["via_ms_p50"] > 0 and isinstance(result["router_overhead_floor_ms_p50"], float)
    assert result["calibration"]["prefill_tok_s"] > 0 and result["calibration"]["decode_step_ms"] > 0
    # the pods' own Usage: a tenant's later requests reuse its system prompt on some arm
    assert max(arm["prefix_hit_rate"] for arm in result["arms"].values()) > 0
