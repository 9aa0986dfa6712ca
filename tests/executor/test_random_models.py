"""Small random-weight Llama / Qwen2 checkpoints saved by transformers, loaded by our safetensors loader.

Covers default, llama3 and linear RoPE, q/k/v biases, tied embeddings, sharded checkpoints; then the
paged-batch properties: a ragged batch, a chunked prefill and a prefix-cache hit all equal one-shot runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from model_testing import (
    SMALL_VARIANTS,
    PagedRunner,
    assert_same_continuation,
    greedy_generate,
    hf_greedy,
    hf_logits,
    make_hf_model,
    prefill_logits,
    random_prompts,
)

from pagedserve.kernels import get_backend
from pagedserve.services.executor.model import LlamaForCausalLM, RopeScaling, load_model, resolve_model

pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4
BLOCK_SIZE = 4  # small, so that every prompt spans several (shuffled) blocks
PROMPT_LENGTHS = (11, 3, 24, 1)


def load_ours(directory: Path) -> LlamaForCausalLM:
    model, _ = load_model(str(directory), torch.float32, torch.device("cpu"), get_backend("torch"))
    return model


@pytest.fixture(scope="module", params=sorted(SMALL_VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, Any]:
    """(ours, transformers') for one variant; the tied one is saved in shards, to go through the index."""
    hf_model = make_hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    sharded = hf_model.config.tie_word_embeddings
    hf_model.save_pretrained(directory, safe_serialization=True, **({"max_shard_size": "40KB"} if sharded else {}))
    assert (directory / "model.safetensors.index.json").exists() == sharded
    return load_ours(directory), hf_model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    directory = tmp_path_factory.mktemp("qwen2")
    make_hf_model("qwen2-bias", seed=1).save_pretrained(directory, safe_serialization=True)
    return load_ours(directory)


def test_config_read_from_config_json(pair: tuple[LlamaForCausalLM, Any]) -> None:
    ours, hf_model = pair
    config, hf = ours.config, hf_model.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.attention_bias == (hf.model_type == "qwen2")
    assert config.tie_word_embeddings == hf.tie_word_embeddings == (ours.lm_head is None)
    rope = hf.rope_parameters
    if rope["rope_type"] == "llama3":
        assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    elif rope["rope_type"] == "linear":
        assert config.rope_scaling == RopeScaling("linear", 2.0)
    else:
        assert config.rope_scaling is None


def test_prefill_logits_match_transformers(pair: tuple[LlamaForCausalLM, Any]) -> None:
    ours, hf_model = pair
    prompts = random_prompts(PROMPT_LENGTHS, ours.config.vocab_size)
    runner = PagedRunner(ours, num_blocks=64, block_size=BLOCK_SIZE)
    for prompt, logits in zip(prompts, prefill_logits(runner, prompts), strict=True):
        diff = (logits - hf_logits(hf_model, prompt)).abs().max().item()
        assert diff < LOGIT_ATOL, f"max |logit diff| {diff:.2e} for a prompt of {len(prompt)} tokens"


def test_greedy_continuations_match_generate(pair: tuple[LlamaForCausalLM, Any]) -> None:
    ours, hf_model = pair
    prompts = random_prompts(PROMPT_LENGTHS, ours.config.vocab_size, seed=1)
    outputs = greedy_generate(PagedRunner(ours, num_blocks=128, block_size=BLOCK_SIZE, seed=2), prompts, 32)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_same_continuation(out, hf_greedy(hf_model, prompt, 32), ours.config.eos_token_ids)


def test_ragged_batch_equals_each_sequence_alone(qwen2: LlamaForCausalLM) -> None:
    prompts = random_prompts((9, 17, 5), qwen2.config.vocab_size, seed=3)
    runner = PagedRunner(qwen2, num_blocks=64, block_size=BLOCK_SIZE)
    batched = prefill_logits(runner, prompts)
    # Then a mixed step: one new prompt's prefill alongside a decode of each earlier sequence.
    extra = random_prompts((6,), qwen2.config.vocab_size, seed=4)[0]
    mixed = runner.step([(0, [7]), (3, extra), (1, [8]), (2, [9])])
    for seq, prompt in enumerate(prompts):
        alone = PagedRunner(qwen2, num_blocks=64, block_size=BLOCK_SIZE, seed=seq + 10)
        torch.testing.assert_close(batched[seq], alone.step([(0, prompt)])[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(mixed[[0, 2, 3][seq]], alone.step([(0, [7 + seq])])[0], atol=1e-5, rtol=0)
    alone = PagedRunner(qwen2, num_blocks=64, block_size=BLOCK_SIZE, seed=20)
    torch.testing.assert_close(mixed[1], alone.step([(0, extra)])[0], atol=1e-5, rtol=0)


def test_chunked_prefill_equals_one_shot(qwen2: LlamaForCausalLM) -> None:
    prompt = random_prompts((23,), qwen2.config.vocab_size, seed=5)[0]
    one_shot = PagedRunner(qwen2, num_blocks=32, block_size=BLOCK_SIZE).step([(0, prompt)])[0]
    runner = PagedRunner(qwen2, num_blocks=32, block_size=BLOCK_SIZE, seed=1)
    first = runner.step([(0, prompt[:10])])[0]  # the split falls inside a block
    second = runner.step([(0, prompt[10:])])[0]
    torch.testing.assert_close(torch.cat([first, second]), one_shot, atol=1e-5, rtol=0)


def test_prefix_hit_prefill_equals_one_shot(qwen2: LlamaForCausalLM) -> None:
    prefix, suffix = random_prompts((12, 9), qwen2.config.vocab_size, seed=6)
    one_shot = PagedRunner(qwen2, num_blocks=32, block_size=BLOCK_SIZE).step([(0, prefix + suffix)])[0]
    runner = PagedRunner(qwen2, num_blocks=32, block_size=BLOCK_SIZE, seed=1)
    runner.step([(0, [*prefix, 3, 4])])  # another sequence computed the prefix's KV (and went on)
    runner.share_prefix(src=0, dst=1, num_tokens=len(prefix))
    hit = runner.step([(1, suffix)])[0]
    torch.testing.assert_close(hit, one_shot[len(prefix):], atol=1e-5, rtol=0)


def test_resolve_hf_directory_and_generation_config_eos(tmp_path: Path) -> None:
    make_hf_model("llama").save_pretrained(tmp_path, safe_serialization=True)
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.path, source.name) == ("hf", tmp_path, tmp_path.name)
    assert source.digest.startswith("sha256:") and source.digest == resolve_model(str(tmp_path)).digest
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    _, config = load_model(source, torch.float32, torch.device("cpu"), get_backend("torch"))
    assert config.eos_token_ids == (7, 9)
