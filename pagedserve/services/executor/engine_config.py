"""How an executor is configured and built: model, dtype, device, kernel backend, and the KV budget.

The KV budget: on a GPU, a fraction of the device memory minus the weights and the activation peak of a
profiling step at the largest batch; on the CPU, an explicit byte budget. The resulting block count is
reported (Info), and the block manager is started to agree with it. The same budget holds for every KV
layout: paged blocks, virtual pages (a block is the pages it commits), or static max_model_len slots (a block
is one slot).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import cast, get_args

import torch

from ...kernels import KernelBackend, cpu_unavailable_reason, get_backend
from ...kernels.backend import BackendName
from ...kernels.linear_ops import bf16_path
from ..common.kv_geometry import blocks_for
from .model.config import ModelConfig
from .model.llama import LlamaForCausalLM
from .model.loader import load_model
from .model.registry import resolve_model
from .options import DTYPE_NAMES, KERNEL_BACKENDS, KV_CACHE_DTYPES, KV_LAYOUTS, ExecutorConfig, MiB
from .runner import ModelRunner, kv_bytes_per_block
from .step_types import GREEDY, ExecutorInfo, SequenceInput, StepInput
from .virtual_kv import SequenceKV, StaticKV, VirtualKV, os_page_size, tokens_per_page, transparent_hugepages

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert sorted(DTYPES) == sorted(DTYPE_NAMES), "options.DTYPE_NAMES and the torch dtypes disagree"
assert get_args(BackendName) == KERNEL_BACKENDS, "options.KERNEL_BACKENDS and kernels.BackendName disagree"


def build_runner(config: ExecutorConfig) -> tuple[ModelRunner, ExecutorInfo]:
    """Loads the model, sizes the cache, runs a warm-up step."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    dtype = DTYPES[config.dtype] if config.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    backend = get_backend(check_backend(config.kernel_backend, device, dtype) or backend_name(device, dtype))
    kv_dtype = kv_cache_dtype(config, dtype, backend.name)
    source = resolve_model(config.model)
    model, model_config = load_model(source, dtype, device, backend)
    released = model.release_plain_weights()  # served weights never change: one copy, the one the backend reads
    if released:
        return_freed_memory()
        log.info("linear weights packed for %s; %.0f MiB of plain copies released", backend.name, released / MiB)
    if device.type == "cpu" and dtype == torch.bfloat16:
        log.info("bf16 matmuls on the CPU: %s", bf16_path())
    max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                        model_config.max_position_embeddings)
    page_size = kv_page_size(device) if config.kv_layout == "virtual" else 0
    block_size = check_kv_layout(config, model_config, kv_dtype, max_model_len, page_size)
    per_block = kv_bytes_per_block(model_config, block_size, kv_dtype)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    elif device.type == "cuda":
        num_blocks = _gpu_num_blocks(model, model_config, backend, config, per_block, max_model_len)
    else:
        num_blocks = config.kv_cache_bytes // per_block
    num_cpu_blocks = config.cpu_swap_bytes // per_block
    sequence_kv = build_sequence_kv(config.kv_layout, model_config, kv_dtype, device, block_size, num_blocks,
                                    max_model_len, page_size)
    runner = ModelRunner(model, model_config, backend, block_size, num_blocks, num_cpu_blocks, max_model_len,
                         sequence_kv, kv_dtype)
    warm_up(runner)
    log.info("%s on %s (%s), %s KV layout in %s: %d blocks of %d tokens (%.1f MiB), %d CPU swap blocks",
             source.name, device, dtype, config.kv_layout, kv_dtype, num_blocks, block_size,
             num_blocks * per_block / MiB, num_cpu_blocks)
    if config.kv_layout == "virtual" and device.type == "cpu":
        log.info("virtual KV: %d-byte pages, transparent huge pages %s", page_size, transparent_hugepages())
    info = ExecutorInfo(
        model=source.name, model_digest=source.digest, dtype=dtype_name(dtype), device=str(device),
        vocab_size=model_config.vocab_size, max_model_len=max_model_len, block_size=block_size,
        num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, eos_token_ids=tuple(model_config.eos_token_ids),
        kernel_backend=backend.name, kv_layout=config.kv_layout,
        kv_cache_dtype="" if kv_dtype == dtype else dtype_name(kv_dtype),
    )
    return runner, info


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: the name Info and the frontend use (options.DTYPE_NAMES)."""
    return str(dtype).removeprefix("torch.")


def kv_cache_dtype(config: ExecutorConfig, dtype: torch.dtype, backend: BackendName) -> torch.dtype:
    """The KV cache's dtype (`--kv-cache-dtype`); ValueError naming the fix where it cannot run. A bf16 cache
    under fp32 weights is read by the CPU's kernels (widened as loaded) and the torch references, over blocks."""
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {config.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if config.kv_cache_dtype == "auto" or DTYPES[config.kv_cache_dtype] == dtype:
        return dtype
    if dtype != torch.float32:
        raise ValueError(f"a {config.kv_cache_dtype} KV cache is narrower than float32 weights only, not {dtype}")
    if backend == "triton":
        raise ValueError(f"a {config.kv_cache_dtype} KV cache under float32 weights runs on the cpu or torch kernel "
                         "backend, not triton: use --dtype bfloat16 on a GPU")
    if config.kv_layout != "paged":
        raise ValueError(f"a {config.kv_cache_dtype} KV cache needs the paged KV layout, not {config.kv_layout}")
    return DTYPES[config.kv_cache_dtype]


def check_backend(name: str | None, device: torch.device, dtype: torch.dtype) -> BackendName | None:
    """The backend asked for (`--kernel-backend`), refused where it cannot run; None when none was asked for.
    get_backend refuses one this machine cannot build or run (no compiler, no GPU) with the reason."""
    if name is None:
        return None
    if name == "cpu" and (device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"kernel backend 'cpu' runs in float32 or bfloat16 on the CPU, not {dtype} on {device}")
    if name == "triton" and device.type != "cuda":
        raise ValueError(f"kernel backend 'triton' runs on a CUDA device, not {device}")
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}")
    return cast(BackendName, name)


def backend_name(device: torch.device, dtype: torch.dtype) -> BackendName:
    """Triton on a GPU; on the CPU the native kernels (fp32 or bf16) where they build, else torch's."""
    if device.type == "cuda":
        return "triton"
    if dtype not in (torch.float32, torch.bfloat16):
        log.info("decode attention on the torch path: the native CPU kernels run in fp32 or bf16, not %s", dtype)
        return "torch"
    reason = cpu_unavailable_reason()
    if reason is None:
        return "cpu"
    log.warning("decode attention on the torch path: the native CPU kernel is unavailable (%s)", reason)
    return "torch"


def kv_page_size(device: torch.device) -> int:
    """The virtual layout's commit unit: the OS page on the CPU, the CUDA VMM granularity on a GPU."""
    if device.type == "cuda":
        from .cuda_vmm import allocation_granularity

        return allocation_granularity(device)
    return os_page_size()


def check_kv_layout(
    config: ExecutorConfig, model_config: ModelConfig, kv_dtype: torch.dtype, max_model_len: int, page_size: int
) -> int:
    """The block size the layout uses; ValueError naming the fix when the configuration cannot work."""
    if config.kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: {config.kv_layout!r} is not one of {', '.join(KV_LAYOUTS)}")
    if config.kv_layout == "paged":
        return config.block_size
    if config.cpu_swap_bytes:
        raise ValueError(f"the {config.kv_layout} KV layout has no CPU swap pool: drop --cpu-swap-mib")
    if config.kv_layout == "static":
        return max_model_len  # one block is one sequence's whole slot
    token_bytes = model_config.num_kv_heads * model_config.head_dim * torch.empty((), dtype=kv_dtype).element_size()
    unit = tokens_per_page(token_bytes, page_size)
    if config.block_size % unit:
        raise ValueError(
            f"block_size: the virtual layout's block is the pages it commits; {config.block_size} tokens of"
            f" {token_bytes} bytes per layer are not whole {page_size}-byte pages: use a multiple of {unit}"
        )
    return config.block_size


def build_sequence_kv(
    kv_layout: str, model_config: ModelConfig, kv_dtype: torch.dtype, device: torch.device, block_size: int,
    num_blocks: int, max_model_len: int, page_size: int,
) -> SequenceKV | None:
    """None for the paged layout; else where each sequence's contiguous K/V lives."""
    if kv_layout == "paged":
        return None
    capacity = blocks_for(max_model_len, block_size) * block_size  # whole pages per slab
    shape = (model_config.num_layers, 2, capacity, model_config.num_kv_heads, model_config.head_dim)
    if kv_layout == "static":
        return StaticKV(num_blocks, shape, kv_dtype, device)
    return VirtualKV(shape, kv_dtype, device, page_size)


def return_freed_memory() -> None:
    """Hands memory freed inside glibc's heap back to the system (`malloc_trim`): weights of a few MB each are
    allocated there, and their pages would otherwise stay in this process's resident set. Not glibc: nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def warm_up(runner: ModelRunner) -> None:
    """One tiny prefill through the whole path (kernels compile, allocators settle). It writes into block 0,
    which holds nothing yet: every slot is written before it is read. A per-sequence layout gives its
    region back after."""
    n = min(runner.block_size, 8)
    runner.run(StepInput([SequenceInput(0, [0] * n, 0, [0], list(range(n)), GREEDY)]))
    runner.reset()


def _gpu_num_blocks(
    model: LlamaForCausalLM, model_config: ModelConfig, backend: KernelBackend, config: ExecutorConfig,
    per_block: int, max_model_len: int,
) -> int:
    """Blocks that fit in gpu_memory_utilization of the device after the weights and a profiled peak."""
    tokens = min(config.max_num_batched_tokens, max_model_len)
    profile_blocks = blocks_for(tokens, config.block_size)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    profiler = ModelRunner(model, model_config, backend, config.block_size, profile_blocks, 0, max_model_len)
    table = list(range(profile_blocks))
    profiler.run(StepInput([SequenceInput(0, [0] * tokens, 0, table, list(range(tokens)), GREEDY)]))
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
