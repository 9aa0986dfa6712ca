"""The executor's options, torch-free: `pagedserve serve` (a supervisor that loads no model) parses them too.

`ExecutorConfig` is what `engine_config.build_runner` builds from; the flags are shared by `pagedserve
executor` and `pagedserve serve`, which passes them on to the executor it starts.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

MiB = 1 << 20
DTYPE_NAMES = ("bfloat16", "float16", "float32")
# auto: the weights' dtype; bfloat16 under fp32 weights on the CPU: half the bytes per block (twice the blocks
# in a budget, half the reading in decode attention), keys and values rounded to bf16 as they are written
KV_CACHE_DTYPES = ("auto", "bfloat16")
# paged: blocks anywhere in one pool, shared between sequences (the default); virtual: one contiguous region
# per sequence, reserved at max_model_len, memory committed page by page as it grows (docs/layouts.md);
# static: one max_model_len slot per sequence, committed up front (the baseline paging replaced)
KV_LAYOUTS = ("paged", "virtual", "static")
# triton: the GPU kernels; cpu: torch with decode attention and per-token ops in C (fp32 on the CPU);
# torch: the references
KERNEL_BACKENDS = ("triton", "cpu", "torch")


@dataclass(frozen=True)
class ExecutorConfig:
    model: str = "smollm2-135m"
    dtype: str | None = None  # default: float32 on the CPU, bfloat16 on a GPU
    device: str | None = None  # default: cuda when available
    block_size: int = 16
    kv_cache_bytes: int = 512 * MiB  # the CPU budget
    gpu_memory_utilization: float = 0.9  # the GPU budget: share of device memory for weights + activations + KV
    num_blocks: int | None = None  # overrides either budget
    cpu_swap_bytes: int = 0  # the CPU swap pool
    max_model_len: int | None = None  # default: the model's
    max_num_batched_tokens: int = 2048  # the largest step, profiled on a GPU
    num_threads: int = 0  # torch's CPU threads; 0: torch's default (all physical cores)
    kv_layout: str = "paged"  # one of KV_LAYOUTS
    kernel_backend: str | None = None  # one of KERNEL_BACKENDS; default: triton on a GPU, else cpu where it builds
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    @staticmethod
    def from_args(args: argparse.Namespace) -> ExecutorConfig:
        return ExecutorConfig(
            model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_mib * MiB, gpu_memory_utilization=args.gpu_memory_utilization,
            num_blocks=args.num_blocks, cpu_swap_bytes=args.cpu_swap_mib * MiB, max_model_len=args.max_model_len,
            num_threads=args.threads, kv_layout=args.kv_layout, kernel_backend=args.kernel_backend,
            kv_cache_dtype=args.kv_cache_dtype,
        )

    def to_argv(self) -> list[str]:
        """The `pagedserve executor` flags that build this configuration."""
        if self.kv_cache_bytes % MiB or self.cpu_swap_bytes % MiB:
            raise ValueError("an executor process takes its KV and swap budgets in whole MiB")
        argv = ["--model", self.model, "--block-size", str(self.block_size),
                "--kv-cache-mib", str(self.kv_cache_bytes // MiB), "--cpu-swap-mib", str(self.cpu_swap_bytes // MiB),
                "--gpu-memory-utilization", str(self.gpu_memory_utilization), "--threads", str(self.num_threads),
                "--kv-layout", self.kv_layout, "--kv-cache-dtype", self.kv_cache_dtype]
        for flag, value in (("--dtype", self.dtype), ("--device", self.device), ("--num-blocks", self.num_blocks),
                            ("--max-model-len", self.max_model_len), ("--kernel-backend", self.kernel_backend)):
            if value is not None:
                argv += [flag, str(value)]
        return argv


def add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="a registered name, an HF directory or a .gguf file")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--block-size", type=int, default=16, help="token slots per KV block")
    parser.add_argument("--kv-cache-mib", type=int, default=512,
                        help="the KV budget in MiB on the CPU (on a GPU --gpu-memory-utilization decides)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU memory share to use")
    parser.add_argument("--num-blocks", type=int, help="exact number of KV blocks (overrides the budget)")
    parser.add_argument("--cpu-swap-mib", type=int, default=0,
                        help="CPU swap pool in MiB (preemption by swap needs one)")
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default="paged",
                        help="paged blocks (shared prefixes, copy-on-write); virtual: a contiguous region per"
                             " sequence, memory committed page by page (block size = tokens per page, no"
                             " sharing, no swap); static: a max-model-len slot per sequence (docs/layouts.md)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="auto: the weights' dtype; bfloat16: a bf16 cache under fp32 weights on the CPU (half"
                             " the bytes: twice the blocks, faster decode attention; keys and values rounded)")
    parser.add_argument("--kernel-backend", choices=KERNEL_BACKENDS,
                        help="triton (GPU), cpu (fp32 on the CPU: C kernels built at start) or torch"
                             " (default: triton on a GPU; on the CPU cpu where a C compiler builds it, else torch)")
    # In a pod the executor shares the CPU with the frontend and block manager; an OpenMP team that
    # expects every core stalls at each barrier when one of its threads is descheduled (seen here: 10x).
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="torch CPU threads (default: all cores but one; 0: torch's default, all physical cores)")
