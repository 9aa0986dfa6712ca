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


def test_another_build_of_the_kernel_is_timed_beside_it(tmp_path: Path) -> None:
    # the kernel's own source, edited to answer 2x: built as the kernels are, run on the same caches, each
    # round's time over the kernel's (--ab-source: how a change to the kernel is measured)
    source = Path(cpu_attention.__file__).parents[1] / "kernels" / "paged_attention_cpu.c"
    text = source.read_text()
    assert "store(out + g * h->head_dim + LANES * (c + i), acc[g][i] * inverse[g])" in text
    edited = tmp_path / "edited.c"
    edited.write_text(text.replace("acc[g][i] * inverse[g])", "acc[g][i] * inverse[g] * 2.f)"))
    argv = ["bench", "cpu-attention", "--shapes", "3x40", "--threads", "1", "--layers", "2", "--rounds", "2",
            "--ab-source", str(edited), "--json", "--out", str(tmp_path / "a.json")]
    cpu_attention.main(build_parser(argv).parse_args(argv))
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["ab_source"] == str(edited)
    assert result["3x40"]["ab_max_abs_diff"] > 0.1  # it ran the edited build, not the kernels' own
    keys = result["3x40"]["threads_1"]
    assert keys["ab_c_ms"] > 0 and keys["ab_c_bf16_ms"] > 0
    assert keys["ab_over_c"] > 0 and keys["ab_bf16_over_c_bf16"] > 0
