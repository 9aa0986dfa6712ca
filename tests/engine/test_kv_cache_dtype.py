"""`--kv-cache-dtype bfloat16`: a bf16 KV cache under fp32 weights on the CPU, sized, reported and refused where
it cannot run. (Its kernels: tests/kernels/test_cpu_native.py and test_cpu_layer_ops.py; its effect on a real
model: tests/executor/test_smollm2.py; in the engine: tests/engine/test_engine.py.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from pagedserve.services.executor.engine_config import build_runner, kv_cache_dtype
from pagedserve.services.executor.options import ExecutorConfig, add_executor_arguments

MiB = 1 << 20


def test_a_bf16_cache_holds_twice_the_blocks_of_the_same_budget(tiny_llama_dir: Path) -> None:
    built = {name: build_runner(ExecutorConfig(model=str(tiny_llama_dir), device="cpu", kv_cache_bytes=2 * MiB,
                                               cpu_swap_bytes=MiB, kv_cache_dtype=name))
             for name in ("auto", "bfloat16")}
    (wide, wide_info), (narrow, narrow_info) = built["auto"], built["bfloat16"]
    assert {t.dtype for layer in wide.kv_caches for t in layer} == {torch.float32}
    assert (wide_info.dtype, wide_info.kv_cache_dtype) == ("float32", "")
    assert (narrow_info.dtype, narrow_info.kv_cache_dtype) == ("float32", "bfloat16")
    assert narrow_info.num_blocks == 2 * wide_info.num_blocks > 0
    assert narrow_info.num_cpu_blocks == 2 * wide_info.num_cpu_blocks > 0
    for caches in (narrow.kv_caches, narrow.cpu_caches):
        assert {t.dtype for layer in caches for t in layer} == {torch.bfloat16}
    assert narrow.model.norm.weight.dtype == torch.float32  # the weights and the arithmetic stay fp32


def test_a_bf16_cache_is_refused_where_it_cannot_run() -> None:
    bf16 = ExecutorConfig(kv_cache_dtype="bfloat16")
    assert kv_cache_dtype(bf16, torch.float32, "cpu") == torch.bfloat16
    assert kv_cache_dtype(bf16, torch.float32, "torch") == torch.bfloat16
    assert kv_cache_dtype(bf16, torch.bfloat16, "triton") == torch.bfloat16  # the weights' own: nothing to do
    assert kv_cache_dtype(ExecutorConfig(), torch.float16, "torch") == torch.float16  # auto: the weights'
    with pytest.raises(ValueError, match="narrower than float32 weights only"):
        kv_cache_dtype(bf16, torch.float16, "torch")
    with pytest.raises(ValueError, match="not triton"):
        kv_cache_dtype(bf16, torch.float32, "triton")
    with pytest.raises(ValueError, match="paged KV layout"):
        kv_cache_dtype(ExecutorConfig(kv_cache_dtype="bfloat16", kv_layout="virtual"), torch.float32, "cpu")
    with pytest.raises(ValueError, match="is not one of"):
        kv_cache_dtype(ExecutorConfig(kv_cache_dtype="fp8"), torch.float32, "cpu")


def test_the_flag_round_trips_through_the_executors_argv() -> None:
    parser = argparse.ArgumentParser()
    add_executor_arguments(parser)
    for name in ("auto", "bfloat16"):
        config = ExecutorConfig(kv_cache_dtype=name, num_threads=1)
        assert ExecutorConfig.from_args(parser.parse_args(config.to_argv())) == config
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "float16"])
