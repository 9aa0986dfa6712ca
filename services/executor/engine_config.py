"""How an executor is configured and built: model, dtype, device, kernel backend, and the KV budget.

The KV budget: on a GPU, a fraction of the device memory minus the weights and the activation peak of a
profiling step at the largest batch; on the CPU, an explicit byte budget. The resulting block count is
reported (Info), and the block manager is started to agree with it.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

import torch

from ...kernels import KernelBackend, get_backend
from .model.config import ModelConfig
from .model.llama import LlamaForCausalLM
from .model.loader import load_model
from .model.registry import resolve_model
from .runner import ModelRunner, kv_bytes_per_block
from .step_types import GREEDY, ExecutorInfo, SequenceInput, StepInput

log = logging.getLogger(__name__)
MiB = 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    num_threads: int | None = None  # torch's CPU threads; None: torch's default

    @staticmethod
    def from_args(args: argparse.Namespace) -> ExecutorConfig:
        return ExecutorConfig(
            model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_mib * MiB, gpu_memory_utilization=args.gpu_memory_utilization,
            num_blocks=args.num_blocks, cpu_swap_bytes=args.cpu_swap_mib * MiB, max_model_len=args.max_model_len,
            num_threads=args.threads,
        )


def add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="a registered name, an HF directory or a .gguf file")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--block-size", type=int, default=16, help="token slots per KV block")
    parser.add_argument("--kv-cache-mib", type=int, default=512, help="CPU KV budget in MiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU memory share to use")
    parser.add_argument("--num-blocks", type=int, help="exact number of KV blocks (overrides the budget)")
    parser.add_argument("--cpu-swap-mib", type=int, default=0, help="CPU swap pool in MiB")
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    # In a pod the executor shares the CPU with the frontend and block manager; an OpenMP team that
    # expects every core stalls at each barrier when one of its threads is descheduled (seen here: 10x).
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="torch CPU threads (default: all cores but one)")


def build_runner(config: ExecutorConfig) -> tuple[ModelRunner, ExecutorInfo]:
    """Loads the model, sizes the cache, runs a warm-up step."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    dtype = DTYPES[config.dtype] if config.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = get_backend("triton" if device.type == "cuda" else "torch")
    source = resolve_model(config.model)
    model, model_config = load_model(source, dtype, device, backend)
    max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                        model_config.max_position_embeddings)
    per_block = kv_bytes_per_block(model_config, config.block_size, dtype)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    elif device.type == "cuda":
        num_blocks = _gpu_num_blocks(model, model_config, backend, config, per_block, max_model_len)
    else:
        num_blocks = config.kv_cache_bytes // per_block
    num_cpu_blocks = config.cpu_swap_bytes // per_block
    runner = ModelRunner(model, model_config, backend, config.block_size, num_blocks, num_cpu_blocks, max_model_len)
    warm_up(runner)
    log.info("%s on %s (%s): %d KV blocks of %d tokens (%.1f MiB), %d CPU swap blocks",
             source.name, device, dtype, num_blocks, config.block_size, num_blocks * per_block / MiB, num_cpu_blocks)
    info = ExecutorInfo(
        model=source.name, model_digest=source.digest, dtype=str(dtype).removeprefix("torch."), device=str(device),
        vocab_size=model_config.vocab_size, max_model_len=max_model_len, block_size=config.block_size,
        num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, eos_token_ids=tuple(model_config.eos_token_ids),
        kernel_backend=backend.name,
    )
    return runner, info


def warm_up(runner: ModelRunner) -> None:
    """One tiny prefill through the whole path (kernels compile, allocators settle). It writes into block 0,
    which holds nothing yet: every slot is written before it is read."""
    n = min(runner.block_size, 8)
    runner.execute(StepInput([SequenceInput(0, [0] * n, 0, [0], list(range(n)), GREEDY)]))


def _gpu_num_blocks(
    model: LlamaForCausalLM, model_config: ModelConfig, backend: KernelBackend, config: ExecutorConfig,
    per_block: int, max_model_len: int,
) -> int:
    """Blocks that fit in gpu_memory_utilization of the device after the weights and a profiled peak."""
    tokens = min(config.max_num_batched_tokens, max_model_len)
    profile_blocks = -(-tokens // config.block_size)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    profiler = ModelRunner(model, model_config, backend, config.block_size, profile_blocks, 0, max_model_len)
    table = list(range(profile_blocks))
    profiler.execute(StepInput([SequenceInput(0, [0] * tokens, 0, table, list(range(tokens)), GREEDY)]))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del profiler
    torch.cuda.empty_cache()
    budget = int(torch.cuda.get_device_properties(0).total_memory * config.gpu_memory_utilization)
    available = budget - peak
    if available < per_block:
        raise RuntimeError(
            f"no room for the KV cache: {config.gpu_memory_utilization:.0%} of the GPU is {budget / MiB:.0f} MiB,"
            f" weights and activations peak at {peak / MiB:.0f} MiB"
        )
    return available // per_block
