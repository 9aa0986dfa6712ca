"""`pagedserve bench blocks` on a small trace: the JSON it prints and the utilization targets it must meet.

Utilization is deterministic for a seed; latencies are only checked for presence (no timing asserts).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def bench_blocks(*args: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pagedserve", "bench", "blocks", "--json", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_bench_blocks_json_meets_targets() -> None:
    result = bench_blocks("--num-requests", "300", "--decode-seqs", "64", "--steps", "30")
    assert result["kv_utilization_paged"] >= 0.96
    assert result["kv_utilization_paged"] >= 2.5 * result["kv_utilization_reserved"]
    assert result["max_concurrent_paged"] > result["max_concurrent_reserved"] == 16
    assert result["preemptions_per_request"] == pytest.approx(result["num_preemptions_paged"] / 300, abs=1e-4)
    assert 0 < result["kv_occupancy_paged"] <= 1 and result["computed_tokens_over_trace_paged"] >= 0.99
    for key in ("step_us_inprocess_p50", "step_rpc_us_p50", "step_rpc_us_p99"):
        assert result[key] > 0


def test_bench_blocks_preempts_at_most_once_in_ten_requests_at_full_utilization() -> None:
    """The issue's target on the whole trace, through the real scheduler: <= 0.1 preemptions a request at a
    utilization >= 0.95; admitting until a block runs out (no growth reserve) preempts five times as often."""
    quick = ("--no-rpc", "--decode-seqs", "8", "--steps", "10")
    result = bench_blocks(*quick)
    assert result["preemptions_per_request"] <= 0.1 and result["kv_utilization_paged"] >= 0.95
    assert result["scheduler"]["reserve_growth"] is True
    without = bench_blocks(*quick, "--no-reserve-growth")
    assert without["preemptions_per_request"] >= 5 * result["preemptions_per_request"]
    assert without["computed_tokens_over_trace_paged"] > result["computed_tokens_over_trace_paged"]


def test_bench_executor_json_smoke() -> None:
    """The executor benchmark runs both sides and reports every key (its numbers are not asserted: timing)."""
    cmd = [sys.executable, "-m", "pagedserve", "bench", "executor", "--json", "--batches", "1,2", "--new-tokens", "3",
           "--repeats", "1", "--decode-seqs", "8", "--decode-context", "20", "--decode-bound", "--prefill-prompts", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for batch in (1, 2):
        assert result[f"ours_tok_s_batch{batch}"] > 0 and result[f"hf_tok_s_batch{batch}"] > 0
        # the ratio comes from unrounded medians; the tok/s figures are rounded to 0.1
        assert result[f"ratio_batch{batch}"] == pytest.approx(
            result[f"ours_tok_s_batch{batch}"] / result[f"hf_tok_s_batch{batch}"], rel=0.15
        )
    # the decode step at 8 sequences of 20 tokens, and the same matmuls alone
    assert result["decode_context_8"] == 20
    assert result["decode_step_ms_8"] > 0 and result["decode_matmul_ms_8"] > 0
    # the median of paired ratios (each step over the matmuls timed right after it): not compared with the ratio of
    # the medians, which a loaded host moves apart (timing is the benchmark's to report, never a test's to assert)
    assert result["decode_step_over_matmul_8"] > 0
    # --decode-bound: the step at context 1, and the bound (its keys computed in tests/engine/test_offline.py)
    assert result["decode_step_ms_8_context1"] > 0 and result["decode_step_bound_over_matmul_8"] > 0
    # --prefill-prompts 2: a step of two 128-token prompts, its rate the step's own
    assert result["prefill_matmul_ms_256"] > 0 and result["prefill_step_over_matmul_256"] > 0
    assert result["prefill_tok_s_256"] == pytest.approx(256 / (result["prefill_step_ms_256"] / 1e3), rel=1e-3)


def test_bench_serve_json_smoke(tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    """The serving benchmark end to end on a tiny model: every key, no leaked blocks, the prefix cache and
    parallel sampling visibly at work, and a PNG. Throughput and latencies are not asserted (timing)."""
    plot = tmp_path / "serve.png"
    cmd = [sys.executable, "-m", "pagedserve", "bench", "serve", "--json", "--model", str(tiny_chat_model_dir),
           "--num-requests", "6", "--scale", "0.1", "--request-rate", "20", "--prefix-prompts", "6",
           "--prefix-prompt-len", "64", "--n4-prompts", "1", "--n4-prompt-len", "64", "--n4-max-tokens", "16",
           "--block-size", "8", "--kv-cache-mib", "16", "--hf-batch-size", "4", "--plot", str(plot),
           "--out", str(tmp_path / "serve.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("throughput_tok_s", "throughput_ratio_vs_hf", "hf_throughput_tok_s", "ttft_ms_p50", "ttft_ms_p99",
                "tpot_ms_p50", "tpot_ms_p99", "goodput_rps", "num_preemptions", "prefix_hit_rate",
                "prefill_tokens_saved_frac", "parallel_sampling_block_ratio", "leaked_blocks"):
        assert key in result, key
    assert result["leaked_blocks"] == 0
    assert result["prefill_tokens_saved_frac"] > 0.3
    assert 0 < result["parallel_sampling_block_ratio"] < 0.7
    assert result["throughput_tok_s"] > 0 and result["hf_throughput_tok_s"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "serve.json").read_text()) == result



def test_bench_autoscale_json_on_a_short_day(tmp_path: Path) -> None:
    """A 4-hour load cycle at a 30 s scrape step through the operator's own policy: every key, sane numbers,
    the static baseline searched to reach our attainment, and a PNG."""
    plot, out = tmp_path / "autoscale.png", tmp_path / "autoscale.json"
    cmd = [sys.executable, "-m", "pagedserve", "bench", "autoscale", "--json", "--hours", "4", "--interval-s", "30",
           "--bursts", "1", "--plot", str(plot), "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for key in ("slo_attainment", "slo_attainment_static", "slo_attainment_pressure_only", "slo_attainment_queue_only",
                "slo_attainment_outside_bursts"):
        assert 0.0 <= result[key] <= 1.0, key
    assert 1 <= result["min_replicas"] <= result["max_replicas_used"] <= result["max_replicas"]
    assert result["slo_attainment_static"] >= result["slo_attainment"]  # the fewest fixed pods that reach ours
    assert result["replica_hours_static"] == result["static_replicas"] * 4
    assert result["replica_hours"] < result["replica_hours_static"]  # load falls to 10 % of its peak
    assert result["replica_hours_vs_static"] == pytest.approx(
        result["replica_hours"] / result["replica_hours_static"], abs=0.01)
    for key in ("replica_hours_pressure_only", "replica_hours_queue_only"):
        assert result["min_replicas"] * 4 <= result[key] <= result["max_replicas"] * 4
    assert result["num_scale_events"] > 0 and result["startup_s"] == 60.0
    assert result["calibration"]["slots_per_pod"] > 1 and result["calibration"]["pod_saturation_rps"] > 0
    assert result["trace"]["num_requests"] > 0 and len(result["trace"]["bursts_start_h"]) == 1
    assert result["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.read_text()) == result


def test_bench_offline_json_smoke(tmp_path: Path) -> None:
    """The offline benchmark without its peer on a tiny workload: every key, positive rates, matches in [0, 1]
    (greedy agreement is reported, not asserted). `--peer vllm` without the peer venv names the setup script."""
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "pagedserve", "bench", "offline", "--json", "--prompts", "2", "--new-tokens", "4",
           "--kv-cache-mib", "64", "--out", str(tmp_path / "offline.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tok_s"] > 0 and result["hf_tok_s"] > 0
    assert result["ratio_vs_hf"] == pytest.approx(result["tok_s"] / result["hf_tok_s"], rel=0.05)
    assert 0.0 <= result["greedy_match_vs_hf"] <= result["greedy_prefix_vs_hf"] <= 1.0
    assert result["prompts"] == 2 and result["new_tokens"] == 4 and result["torch_threads"] > 0
    assert result["cpu_model"] and "peer_tok_s" not in result
    assert json.loads((tmp_path / "offline.json").read_text()) == result

    missing = subprocess.run([*cmd[:-2], "--peer", "vllm", "--peer-venv", str(tmp_path / "no-venv")],
                             capture_output=True, text=True, timeout=300, env=env)
    assert missing.returncode != 0 and "benchmarks/peers/setup-vllm.sh" in missing.stderr


@pytest.mark.parametrize("argv", [["host-step", "--repeats", "0"], ["host-step", "--tokens", "-3"],
                                  ["overhead", "--stream-interval", "0"], ["overhead", "--tokens", "0"]])
def test_bench_counts_must_be_positive(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser(["bench", *argv]).parse_args(["bench", *argv])
    assert "must be >= 1" in capsys.readouterr().err


def test_the_peer_ratio_is_against_the_faster_of_its_tuned_and_default_runs() -> None:
    from pagedserve.benchmarks.offline import peer_keys

    def peer(tok_s: float, ids: list[list[int]], cpus: list[int]) -> dict[str, Any]:
        return {"tok_s": tok_s, "token_ids": ids, "vllm_version": "v", "torch_version": "t", "enforce_eager": False,
                "omp_cpus": cpus, "preloaded": ["libiomp5.so"], "missing_preloads": ["libtcmalloc_minimal.so.4"]}

    ids = [[1, 2], [3, 4]]
    rounds = [{"tuned": peer(400.0, ids, [0, 1]), "default": peer(250.0, ids, [0])},
              {"tuned": peer(200.0, ids, [0, 1]), "default": peer(300.0, [[1, 2], [3, 5]], [0])}]
    keys = peer_keys(rounds, [500.0, 450.0], ids, ids)
    assert keys["ratio_vs_peer_rounds"] == [1.25, 1.5]  # 500 / 400 (tuned faster), 450 / 300 (default faster)
    assert keys["peer_tok_s_tuned"] == 300.0 and keys["peer_tok_s_default"] == 275.0 and keys["peer_tok_s"] == 350.0
    assert keys["greedy_match_peer_tuned_vs_default"] == 0.5
    assert keys["peer_missing_preloads"] == ["libtcmalloc_minimal.so.4"] and keys["peer_omp_cpus_tuned"] == [0, 1]


def test_tuned_preloads_finds_libiomp5_in_the_peer_venv_and_names_what_is_missing(tmp_path: Path) -> None:
    from pagedserve.benchmarks.vllm_peer import tuned_preloads

    found, missing = tuned_preloads(tmp_path)
    assert "libiomp5.so" in missing and not any(f.endswith("libiomp5.so") for f in found)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    found, missing = tuned_preloads(tmp_path)
    assert str(tmp_path / "lib" / "libiomp5.so") in found and "libiomp5.so" not in missing


def test_process_cpu_counts_every_process_under_a_server(tmp_path: Path) -> None:
    """bench serve's CPU per token: a server whose work runs two levels down (vLLM's model) is counted whole."""
    from pagedserve.benchmarks.serve_peer import process_cpu_s

    script = tmp_path / "tree.py"
    script.write_text("import subprocess, sys, time\n"
                      "if sys.argv[1:] == ['leaf']:\n    end = time.monotonic() + 30\n"
                      "    while time.monotonic() < end:\n        pass\n"
                      "elif sys.argv[1:] == ['mid']:\n    subprocess.run([sys.executable, __file__, 'leaf'])\n"
                      "else:\n    subprocess.run([sys.executable, __file__, 'mid'])\n")
    root = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 30
        while (spent := process_cpu_s(root.pid)).get("workers", 0.0) < 0.5:  # the leaf, two levels down, spinning
            assert time.monotonic() < deadline, spent
            time.sleep(0.1)
        assert set(spent) == {"server", "workers"} and spent["server"] < spent["workers"]
    finally:
        for child in subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout.split():
            os.kill(int(child), signal.SIGKILL)
        root.wait()
