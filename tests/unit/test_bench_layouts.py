"""`bench layouts` on the tiny chat model and a tiny trace: every key of every layout and pass, and their sense."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.benchmarks import layouts
from pagedserve.cli import build_parser


def test_bench_layouts_reports_every_key_with_sane_values(tiny_chat_model_dir: Path, tmp_path: Path,
                                                         capsys: object) -> None:
    # 2 layers x 2 KV heads x 16 dims in fp32: 128-byte K rows, so a virtual block is 32 tokens (one 4 KiB page)
    argv = ["bench", "layouts", "--model", str(tiny_chat_model_dir), "--num-requests", "8", "--scale", "0.15",
            "--max-model-len", "128", "--kv-cache-mib", "1", "--virtual-block-size", "32", "--prefix-prompts", "3",
            "--prefix-len", "48", "--n4-prompts", "2", "--n4-prompt-len", "24", "--n4-max-tokens", "4",
            "--threads", "1", "--json", "--out", str(tmp_path / "layouts.json"), "--plot", str(tmp_path / "l.png")]
    args = build_parser(argv).parse_args(argv)
    layouts.main(args)
    result = json.loads((tmp_path / "layouts.json").read_text())
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result  # type: ignore[attr-defined]
    assert (tmp_path / "l.png").stat().st_size > 0
    for layout in layouts.LAYOUTS:
        for name in ("trace", "shared_prefix", "n4"):
            keys = result[layout][name]
            assert set(layouts.KEYS) <= set(keys), (layout, name)
            assert 0.0 <= keys["kv_waste_frac"] <= 1.0
            assert keys["max_concurrent_seqs"] >= 1 and keys["page_faults"] >= 0
            assert 0 < keys["ttft_ms_p50"] <= keys["ttft_ms_p99"] and keys["tpot_ms_p50"] <= keys["tpot_ms_p99"]
    paged, virtual, static = (result[layout] for layout in layouts.LAYOUTS)
    assert static["block_size"] == 128 and virtual["block_size"] == 32
    for name in ("trace", "shared_prefix", "n4"):  # a max-length slot wastes what paging does not
        assert static[name]["kv_waste_frac"] >= paged[name]["kv_waste_frac"]
    assert virtual["trace"]["kv_page_commits"] > 0 and paged["trace"]["kv_page_commits"] == 0
    assert virtual["trace"]["kv_resident_mib_peak"] < paged["trace"]["kv_resident_mib_peak"]
    # sharing: paged reuses the prefix and prefills an n = 4 prompt once; the others compute it again
    assert paged["shared_prefix"]["prefix_cached_tokens"] > 0 == virtual["shared_prefix"]["prefix_cached_tokens"]
    assert paged["shared_prefix"]["tokens_computed"] < virtual["shared_prefix"]["tokens_computed"]
    assert paged["shared_prefix"]["kv_assigned_mib_peak"] < virtual["shared_prefix"]["kv_assigned_mib_peak"]
    assert paged["n4"]["tokens_computed"] < virtual["n4"]["tokens_computed"] == static["n4"]["tokens_computed"]
    assert paged["trace"]["tokens_computed"] == virtual["trace"]["tokens_computed"]
    assert result["setup"]["page_size"] > 0
