"""`pagedserve bench cpu-gemm`: a step's fp32 matmuls through `cpu_gemm.c`, per row count.

Every decoder layer's four matmuls at SmolLM2-135M's shapes by default (QKV 960 x 576, O 576 x 576, gate/up
3,072 x 576 with SiLU x up as its epilogue, down 576 x 1,536), over `--layers` layers of random weights packed as
the executor packs them: 30 layers are 424 MB, so a round reads them from memory as a step does. Per row count
(`--rows`: a decode step's sequences, or a prefill step's tokens): `ms` (a round, every layer's four; median of
`--rounds`), `us_per_row` and `gflops` (two flops a weight a row over that time).

`--ab-source FILE.c` builds another version of `kernels/cpu_gemm.c` (an edited copy) the way the kernels are built
and times it beside the kernels' own build, alternated in the same rounds in a new order each round: `ab_ms`,
`ab_over_c` (the median of each round's ratio: load elsewhere hits both alike) and `ab_equal` (its outputs equal
the kernels' bit for bit, which a change that only moves data, such as a prefetch, must keep). A change to the
matmul is measured that way, not by two runs.

    pagedserve bench cpu-gemm --json [--rows 8,64,512] [--layers 30] [--rounds 8] [--ab-source FILE.c] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .report import emit, paired_ratio

GEMM_FUNCTIONS = ("gemm_panel_columns", "gemm_pack_f32", "gemm_f32", "gemm_silu_mul_f32")
Matmul = tuple[int, bool, torch.Tensor]  # outputs, gated, the packed weight


def layer_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """A decoder layer's matmuls as [outputs, inputs]: QKV, O, gate/up, down."""
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    return [(q + 2 * kv, args.hidden), (args.hidden, q), (2 * args.intermediate, args.hidden),
            (args.hidden, args.intermediate)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..kernels import cpu_unavailable_reason
    from ..kernels.cpu_native import library_from

    reason = cpu_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the C kernels are unavailable here: {reason}")
    with tempfile.TemporaryDirectory(prefix="pagedserve-ab-") as directory:
        ab = library_from(args.ab_source, Path(directory), GEMM_FUNCTIONS) if args.ab_source else None
        return _run(args, ab)


def _run(args: argparse.Namespace, ab: ctypes.CDLL | None) -> dict[str, Any]:
    from ..kernels.cpu_native import native_library
    from ..kernels.linear_ops import gated_panels_fit, pack_panels

    own = native_library()  # the kernels' own build (run() checked that it builds here)
    if ab is not None and ab.gemm_panel_columns() != own.gemm_panel_columns():
        raise SystemExit(f"{args.ab_source} packs panels of {ab.gemm_panel_columns()} columns, the kernels"
                         f" {own.gemm_panel_columns()}: the packed weights would not fit it")
    generator = torch.Generator().manual_seed(0)
    shapes = layer_shapes(args)
    layers: list[list[Matmul]] = []
    for _ in range(args.layers):
        layer = []
        for index, (outputs, inputs) in enumerate(shapes):
            weight = torch.randn(outputs, inputs, generator=generator) * 0.02
            gated = index == 2 and gated_panels_fit(weight)  # gate/up with its epilogue, where it packs so
            layer.append((outputs, gated, pack_panels(weight, gated=gated)))
        layers.append(layer)
    weights = sum(outputs * inputs for outputs, inputs in shapes) * args.layers
    result: dict[str, Any] = {
        "shapes": [list(shape) for shape in shapes], "layers": args.layers, "rounds": args.rounds,
        "weights_mb": round(weights * 4 / 1e6, 1), "threads": torch.get_num_threads(),
        "panel_columns": own.gemm_panel_columns(), **({"ab_source": str(args.ab_source)} if ab is not None else {}),
    }
    for rows in args.rows:
        result[f"rows_{rows}"] = bench_rows(rows, layers, shapes, weights, args.rounds, ab, generator)
    return result


def bench_rows(rows: int, layers: list[list[Matmul]], shapes: list[tuple[int, int]], weights: int, rounds: int,
               ab: ctypes.CDLL | None, generator: torch.Generator) -> dict[str, Any]:
    from ..kernels.linear_ops import panels_linear

    inputs = [torch.randn(rows, features, generator=generator) for _, features in shapes]

    def step(library: ctypes.CDLL | None, layer_list: list[list[Matmul]]) -> list[torch.Tensor]:
        return [panels_linear(x, panels, outputs, None, gated=gated, library=library)
                for layer in layer_list for (outputs, gated, panels), x in zip(layer, inputs, strict=True)]

    contestants: list[tuple[str, ctypes.CDLL | None]] = [("c", None)] + ([("ab", ab)] if ab is not None else [])
    times: dict[str, list[float]] = {name: [] for name, _ in contestants}
    order = random.Random(rows)
    for _ in range(rounds):
        for name, library in order.sample(contestants, len(contestants)):
            start = time.perf_counter()
            step(library, layers)
            times[name].append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times["c"])
    keys: dict[str, Any] = {"ms": round(ms, 3), "us_per_row": round(ms * 1e3 / rows, 3),
                            "gflops": round(2 * rows * weights / ms / 1e6, 1)}
    if ab is not None:
        keys["ab_ms"] = round(statistics.median(times["ab"]), 3)
        keys["ab_over_c"] = paired_ratio(times["ab"], times["c"])
        keys["ab_equal"] = all(torch.equal(a, c) for a, c in zip(step(ab, layers[:1]), step(None, layers[:1]),
                                                                  strict=True))
    return keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[8, 64, 512],
                        help="comma-separated row counts (a decode's sequences, a prefill's tokens)")
    parser.add_argument("--layers", type=int, default=30, help="layers of weights (30: read from memory each round)")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds; medians are reported")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--ab-source", type=Path,
                        help="another version of kernels/cpu_gemm.c, timed beside it (ab_* keys)")


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
