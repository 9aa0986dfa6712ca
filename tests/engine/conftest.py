"""A tiny random-weight Llama (a real model, saved as safetensors) and engines built around it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.executor.engine_config import ExecutorConfig, build_runner
from pagedserve.services.frontend.engine import Engine, EngineLimits, ModelIdentity
from pagedserve.services.frontend.ports import LocalBlockManager, LocalExecutor
from pagedserve.services.frontend.scheduler import Scheduler, SchedulerConfig

VOCAB = 96
EOS = 95


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits than the default init, so greedy choices are far from ties
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


EngineFactory = Callable[..., tuple[Engine, BlockManager]]


@pytest.fixture(scope="session")
def make_engine(tiny_llama_dir: Path) -> EngineFactory:
    runners: dict[tuple[int, int], object] = {}

    def make(num_blocks: int = 256, block_size: int = 4, cpu_blocks: int = 0, max_num_seqs: int = 16,
             max_num_batched_tokens: int = 64, preemption_mode: str = "recompute") -> tuple[Engine, BlockManager]:
        key = (num_blocks, block_size)
        if key not in runners:  # one model load per cache shape; the swap pool is sized per runner below
            runners[key] = build_runner(ExecutorConfig(
                model=str(tiny_llama_dir), num_blocks=num_blocks, block_size=block_size,
                cpu_swap_bytes=1 << 30, device="cpu", dtype="float32",
            ))
        runner, info = runners[key]  # type: ignore[misc]
        manager = BlockManager(num_blocks, block_size, num_cpu_blocks=min(cpu_blocks, info.num_cpu_blocks))
        scheduler = Scheduler(
            SchedulerConfig(block_size, info.max_model_len, max_num_seqs, max_num_batched_tokens,
                            preemption_mode),  # type: ignore[arg-type]
            LocalBlockManager(manager),
        )
        limits = EngineLimits(VOCAB, info.max_model_len, num_blocks, block_size, frozenset({EOS}))
        identity = ModelIdentity(info.model_digest, "tiny", "", info.dtype)
        return Engine(scheduler, LocalExecutor(runner), limits, identity), manager

    return make
