"""`bench cpu-gemm` on two layers: every key, an edited build timed beside the kernels' own, its bits compared;
no timing asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.benchmarks import cpu_gemm
from pagedserve.cli import build_parser
from pagedserve.kernels import cpu_unavailable_reason

pytestmark = pytest.mark.skipif(cpu_unavailable_reason() is not None, reason="the C kernels do not build here")
SOURCE = Path(cpu_gemm.__file__).parents[1] / "kernels" / "cpu_gemm.c"
ROWS = "3,20,70"  # one tile a panel, several, and (with AVX-512) the two-panel tiles


def bench(tmp_path: Path, *extra: str) -> dict:
    argv = ["bench", "cpu-gemm", "--rows", ROWS, "--layers", "2", "--rounds", "2", *extra, "--json",
            "--out", str(tmp_path / "g.json")]
    cpu_gemm.main(build_parser(argv).parse_args(argv))
    return json.loads((tmp_path / "g.json").read_text())


def test_bench_cpu_gemm_reports_each_row_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = bench(tmp_path)
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
    assert result["shapes"] == [[960, 576], [576, 576], [3072, 576], [576, 1536]]  # SmolLM2-135M's layer
    assert result["weights_mb"] == pytest.approx(2 * (960 + 576 + 3072) * 576 * 4e-6 + 2 * 576 * 1536 * 4e-6, abs=0.1)
    for rows in (3, 20, 70):
        keys = result[f"rows_{rows}"]
        assert keys["ms"] > 0 and keys["gflops"] > 0 and "ab_ms" not in keys
        assert keys["us_per_row"] == pytest.approx(keys["ms"] * 1e3 / rows, rel=0.01)


def test_an_edited_build_is_timed_beside_it_and_its_bits_compared(tmp_path: Path) -> None:
    text = SOURCE.read_text()
    # a change that only moves data (the prefetch distance) keeps every bit
    assert "#define PREFETCH_ROWS 48" in text
    moved = tmp_path / "moved.c"
    moved.write_text(text.replace("#define PREFETCH_ROWS 48", "#define PREFETCH_ROWS 16"))
    result = bench(tmp_path, "--ab-source", str(moved))
    assert result["ab_source"] == str(moved)
    for rows in (3, 20, 70):
        keys = result[f"rows_{rows}"]
        assert keys["ab_equal"] is True and keys["ab_ms"] > 0 and keys["ab_over_c"] > 0
    # one that changes the arithmetic (the plain matmul's outputs doubled) is caught, at every row count
    assert "memcpy(y, sums, (size_t)cols * sizeof(float));" in text
    doubled = tmp_path / "doubled.c"
    doubled.write_text(text.replace("memcpy(y, sums, (size_t)cols * sizeof(float));",
                                    "for (int64_t j = 0; j < cols; j++) y[j] = 2.0f * sums[j];"))
    result = bench(tmp_path, "--ab-source", str(doubled))
    assert all(result[f"rows_{rows}"]["ab_equal"] is False for rows in (3, 20, 70))


def test_a_build_with_other_panels_is_refused(tmp_path: Path) -> None:
    text = SOURCE.read_text()
    assert "#define NB (2 * VW)" in text
    wider = tmp_path / "wider.c"
    wider.write_text(text.replace("#define NB (2 * VW)", "#define NB (4 * VW)"))
    with pytest.raises(SystemExit, match="packs panels of"):
        bench(tmp_path, "--ab-source", str(wider))
