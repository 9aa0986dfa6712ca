"""Decode attention over the paged cache: achieved bandwidth and speed against unpaged torch SDPA.

For batch x context x GQA shape (head_dim 128, bf16, block size 16, every sequence at the full context):
- `paged_ms`: median time of the Triton decode kernel (CUDA events, L2 flushed before each call), with
  the split-K choice of `choose_num_splits`;
- `bandwidth_share`: K/V bytes read / time, as a share of the device-to-device copy bandwidth measured
  in the same run (a copy moves each byte twice: read and write);
- `speedup_vs_sdpa`: SDPA's time over the paged kernel's, SDPA reading the same K/V stored contiguously
  ([batch, kv_heads, context, head_dim]; the group's query heads ride as query rows, which is exact for
  one query token), so the paging overhead shows directly.
Shapes whose paged and contiguous K/V would not fit the free device memory are listed under `skipped`.

`--tiny` (automatic without a GPU) runs one small shape on the CPU through the Triton interpreter, in
fp16 (the interpreter cannot multiply bf16), to keep this script tested, not to measure anything.

    python -m pagedserve.benchmarks.kernels --json [--out FILE] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .report import emit

BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 32768)
GQA_HEADS = {"8:1": (64, 8), "1:1": (32, 32)}  # (query heads, KV heads): Llama-3-70B and Llama-2-7B
HEAD_DIM = 128
BLOCK_SIZE = 16
MEMORY_HEADROOM = 0.85  # share of free device memory the two K/V copies may take


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def kv_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of K and V that one decode step reads."""
        element_size = torch.empty(0, dtype=dtype).element_size()
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * element_size


@dataclass
class Inputs:
    q: torch.Tensor  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, blocks_per_seq] int32, shuffled blocks
    seq_lens: torch.Tensor  # [batch] int32
    k_dense: torch.Tensor  # [batch, num_kv_heads, context, head_dim], the same keys unpaged
    v_dense: torch.Tensor


def build_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    dense_shape = (shape.batch, shape.num_kv_heads, shape.context, shape.head_dim)
    k_dense = torch.randn(dense_shape, generator=gen, device=device, dtype=dtype)
    v_dense = torch.randn(dense_shape, generator=gen, device=device, dtype=dtype)
    blocks_per_seq = -(-shape.context // BLOCK_SIZE)
    num_blocks = shape.batch * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
    v_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
    block_ids = torch.randperm(num_blocks, generator=gen, device=device).view(shape.batch, blocks_per_seq)
    padded = blocks_per_seq * BLOCK_SIZE
    for seq in range(shape.batch):  # one sequence at a time keeps the temporary copy small
        for dense, cache in ((k_dense, k_cache), (v_dense, v_cache)):
            tokens = F.pad(dense[seq].transpose(0, 1), (0, 0, 0, 0, 0, padded - shape.context))
            cache.index_copy_(0, block_ids[seq], tokens.reshape(blocks_per_seq, *cache_shape[1:]))
    q = torch.randn(shape.batch, shape.num_heads, shape.head_dim, generator=gen, device=device, dtype=dtype)
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    return Inputs(q, k_cache, v_cache, block_ids.int(), seq_lens, k_dense, v_dense)


def sdpa_decode(inputs: Inputs, scale: float) -> torch.Tensor:  # [batch, num_heads, head_dim]
    batch, num_heads, head_dim = inputs.q.shape
    num_kv_heads = inputs.k_dense.shape[1]
    q = inputs.q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, inputs.k_dense, inputs.v_dense, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            began = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - began) * 1e3)
        return statistics.median(samples)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)  # larger than the L2 cache
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def copy_bandwidth_gbps(device: torch.device, num_bytes: int, warmup: int, iters: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup, iters)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def bench_shape(
    shape: Shape, dtype: torch.dtype, device: torch.device, copy_gbps: float, warmup: int, iters: int
) -> dict[str, Any]:
    from ..kernels import choose_num_splits, paged_decode_attention
    from ..kernels._common import num_sms

    inputs = build_inputs(shape, dtype, device, seed=shape.batch * 100_003 + shape.context)
    scale = shape.head_dim**-0.5
    num_splits = choose_num_splits(shape.batch, shape.num_kv_heads, shape.context, num_sms(device))

    def paged() -> torch.Tensor:
        return paged_decode_attention(
            inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens, scale,
            max_seq_len=shape.context,
        )  # fmt: skip

    max_abs_diff = (paged().float() - sdpa_decode(inputs, scale).float()).abs().max().item()
    paged_ms = median_ms(paged, device, warmup, iters)
    sdpa_ms = median_ms(lambda: sdpa_decode(inputs, scale), device, warmup, iters)
    kv_bytes = shape.kv_bytes(dtype)
    paged_gbps = kv_bytes / (paged_ms * 1e-3) / 1e9
    return {
        **asdict(shape),
        "gqa": f"{shape.num_heads // shape.num_kv_heads}:1",
        "num_splits": num_splits,
        "kv_bytes": kv_bytes,
        "paged_ms": round(paged_ms, 4),
        "paged_gbps": round(paged_gbps, 3),
        "bandwidth_share": round(paged_gbps / copy_gbps, 3),
        "sdpa_ms": round(sdpa_ms, 4),
        "speedup_vs_sdpa": round(sdpa_ms / paged_ms, 3),
        "max_abs_diff_vs_sdpa": max_abs_diff,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    on_gpu = torch.cuda.is_available()
    tiny = args.tiny or not on_gpu
    if not on_gpu:
        # Must precede the first import of the kernels: @triton.jit picks the interpreter at decoration.
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float16
    if tiny:
        shapes = [Shape(2, 80, 16, 2, 64)]
        warmup, iters, copy_bytes = 1, 3, 2**24
    else:
        shapes = [
            Shape(batch, context, heads, kv_heads, HEAD_DIM)
            for heads, kv_heads in GQA_HEADS.values()
            for batch in BATCHES
            for context in CONTEXTS
        ]
        warmup, iters, copy_bytes = 5, args.iters, 2**31
    copy_gbps = copy_bandwidth_gbps(device, copy_bytes, warmup, iters)

    results, skipped = [], []
    for shape in shapes:
        needed = 2 * shape.kv_bytes(dtype)  # paged and contiguous copies
        if on_gpu:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
            if needed > MEMORY_HEADROOM * free:
                reason = f"needs {needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
                skipped.append({**asdict(shape), "reason": reason})
                continue
        results.append(bench_shape(shape, dtype, device, copy_gbps, warmup, iters))
        if not args.json:
            print(json.dumps(results[-1]), flush=True)
    return {
        "benchmark": "paged_decode_attention",
        "mode": "tiny" if tiny else "full",
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu (triton interpreter)",
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": BLOCK_SIZE,
        "copy_bandwidth_gbps": round(copy_gbps, 1),
        "results": results,
        "skipped": skipped,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--tiny", action="store_true", help="one small shape (automatic without a GPU)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement")


def main(args: argparse.Namespace) -> None:
    emit(run(args), args, table=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pagedserve.benchmarks.kernels", description=__doc__)
    add_arguments(parser)
    main(parser.parse_args())
