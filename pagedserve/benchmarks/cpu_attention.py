"""`pagedserve bench cpu-attention`: the CPU's decode attention, the C kernel against the torch path.

One layer of decode attention over a paged fp32 cache, per shape (sequences x context tokens, SmolLM2's 9
query / 3 KV heads of 64 by default, block size 16) and thread count: `torch_ms` is the torch path
(`paged_decode_attention_gathered`, its gather plan built once outside the timing, as the executor does per
step), `c_ms` the C kernel (`paged_decode_attention_cpu`, the `cpu` backend), `speedup` their ratio, and
`c_bf16_ms` the C kernel over the same caches in bf16 (`--kv-cache-dtype bfloat16`: half the bytes),
`bf16_over_fp32` the median of each round's ratio of the two. Each round calls all three on `--layers` layers
whose caches hold 4x the blocks the shape needs, shuffled, so that most reads come from DRAM as in a step, in a
new order each round (medians of `--rounds`). `max_abs_diff` compares the torch path's output with the
kernel's, `bf16_diff_vs_widened` the kernel over bf16 with the kernel over that cache widened to fp32 (0:
widening is exact), `bf16_max_abs_diff` the bf16 cache's output with the fp32 cache's (what rounding changes).

`--ab-source FILE.c` builds another version of `kernels/paged_attention_cpu.c` (an edited copy) the way the
kernels are built and times it beside them, alternated in the same rounds: `ab_c_ms`, `ab_c_bf16_ms`, and
`ab_over_c`, `ab_bf16_over_c_bf16` (the median of each round's ratio: load elsewhere hits both alike), with
`ab_max_abs_diff` (its output against the kernel's). A change to the kernel is measured that way, not by two runs.

    pagedserve bench cpu-attention --json [--shapes 64x80,1x2000] [--threads 1,2] [--ab-source FILE.c] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .report import emit, paired_ratio

SHAPES = "64x80,64x512,8x500,1x2000"
BLOCK_SIZE = 16


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        seqs, _, context = item.partition("x")
        shapes.append((int(seqs), int(context)))
    return shapes


def bench_shape(num_seqs: int, context: int, args: argparse.Namespace, generator: torch.Generator
                ) -> dict[str, Any]:
    from ..kernels import decode_gather, paged_decode_attention_cpu, paged_decode_attention_gathered

    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = 4 * num_seqs * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(args.layers)]
    narrow = [(k.bfloat16(), v.bfloat16()) for k, v in caches]
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * blocks_per_seq]
    tables = tables.view(num_seqs, blocks_per_seq).int().contiguous()
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    q = torch.randn(num_seqs, heads + 2 * kv_heads, head_dim, generator=generator)[:, :heads]  # as the model's
    scale = head_dim**-0.5
    gather = decode_gather(tables, lens, BLOCK_SIZE, kv_heads, context, heads)

    def torch_path(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention_gathered(q, k, v, gather, scale)

    def c_kernel(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention_cpu(q, k, v, tables, lens, scale)

    def ab_kernel(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention_cpu(q, k, v, tables, lens, scale, library=args.ab_library)

    wide, rounded = c_kernel(*caches[0]), c_kernel(*narrow[0])
    result: dict[str, Any] = {
        "max_abs_diff": (torch_path(*caches[0]) - wide).abs().max().item(),
        "bf16_diff_vs_widened": (rounded - c_kernel(*(t.float() for t in narrow[0]))).abs().max().item(),
        "bf16_max_abs_diff": (rounded - wide).abs().max().item(),
    }
    contestants = [("torch", torch_path, caches), ("c", c_kernel, caches), ("c_bf16", c_kernel, narrow)]
    if args.ab_library is not None:
        result["ab_max_abs_diff"] = max((ab_kernel(*layer) - c_kernel(*layer)).abs().max().item()
                                        for layer in (caches[0], narrow[0]))
        contestants += [("ab_c", ab_kernel, caches), ("ab_c_bf16", ab_kernel, narrow)]
    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name, _, _ in contestants}
        order = random.Random(threads)
        for _ in range(args.rounds):
            # in a new order each round: whichever runs right after the torch path ran 10-12 % slower
            for name, fn, layers in order.sample(contestants, len(contestants)):
                start = time.perf_counter()
                for k, v in layers:
                    fn(k, v)
                times[name].append((time.perf_counter() - start) / args.layers * 1e3)
        torch_ms, c_ms, bf16_ms = (statistics.median(times[name]) for name in ("torch", "c", "c_bf16"))
        result[f"threads_{threads}"] = {"torch_ms": round(torch_ms, 4), "c_ms": round(c_ms, 4),
                                        "speedup": round(torch_ms / c_ms, 3), "c_bf16_ms": round(bf16_ms, 4),
                                        "bf16_over_fp32": paired_ratio(times["c_bf16"], times["c"])}
        if args.ab_library is not None:
            per_thread = result[f"threads_{threads}"]
            for name in ("ab_c", "ab_c_bf16"):
                per_thread[f"{name}_ms"] = round(statistics.median(times[name]), 4)
            per_thread["ab_over_c"] = paired_ratio(times["ab_c"], times["c"])
            per_thread["ab_bf16_over_c_bf16"] = paired_ratio(times["ab_c_bf16"], times["c_bf16"])
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..kernels import cpu_unavailable_reason
    from ..kernels.cpu_native import library_from

    reason = cpu_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the C kernel is unavailable here: {reason}")
    with tempfile.TemporaryDirectory(prefix="pagedserve-ab-") as directory:
        args.ab_library = library_from(args.ab_source, Path(directory)) if args.ab_source else None
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    threads_before = torch.get_num_threads()
    args.threads = args.threads or sorted({1, threads_before})
    generator = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {
        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "block_size": BLOCK_SIZE,
        "layers": args.layers, "rounds": args.rounds, "threads": args.threads,
        **({"ab_source": str(args.ab_source)} if args.ab_source else {}),
    }
    try:
        for num_seqs, context in parse_shapes(args.shapes):
            result[f"{num_seqs}x{context}"] = bench_shape(num_seqs, context, args, generator)
    finally:
        torch.set_num_threads(threads_before)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated SEQUENCESxCONTEXT")
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")],
                        help="comma-separated torch thread counts (default: 1 and torch's default)")
    parser.add_argument("--heads", type=int, default=9, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8, help="layers (caches) per round")
    parser.add_argument("--rounds", type=int, default=12, help="alternating rounds; medians are reported")
    parser.add_argument("--ab-source", type=Path,
                        help="another version of kernels/paged_attention_cpu.c, timed beside it (ab_* keys)")


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
