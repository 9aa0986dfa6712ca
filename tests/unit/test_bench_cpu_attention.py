"""`bench cpu-attention` on small shapes: every key, outputs that agree, no timing asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.benchmarks import cpu_attention
from pagedserve.cli import build_parser


def test_bench_cpu_attention_reports_both_paths_per_shape_and_thread_count(tmp_path: Path, capsys: object) -> None:
    argv = ["bench", "cpu-attention", "--shapes", "3x40,1x100", "--threads", "1,2", "--layers", "2", "--rounds", "2",
            "--json", "--out", str(tmp_path / "a.json")]
    args = build_parser(argv).parse_args(argv)
    cpu_attention.main(args)
    result = json.loads((tmp_path / "a.json").read_text())
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result  # type: ignore[attr-defined]
    assert result["threads"] == [1, 2]
    for shape in ("3x40", "1x100"):
        assert result[shape]["max_abs_diff"] < 1e-5  # the two paths compute the same attention
        assert result[shape]["bf16_diff_vs_widened"] == 0  # widening a bf16 cache is exact
        assert 0 < result[shape]["bf16_max_abs_diff"] < 0.05  # rounding the cache: ~2^-9 relative
        for threads in (1, 2):
            keys = result[shape][f"threads_{threads}"]
            assert keys["torch_ms"] > 0 and keys["c_ms"] > 0 and keys["c_bf16_ms"] > 0
            assert keys["speedup"] == pytest.approx(keys["torch_ms"] / keys["c_ms"], rel=0.02)  # ms rounded to 4 places
