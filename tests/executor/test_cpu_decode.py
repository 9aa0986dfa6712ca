"""The cpu backend's decode forward (cpu_decode.py) against the generic layer loop it stands in for.

Both run the same C kernels in the same order, so a decode step's hidden states and the KV it writes must be
equal bit for bit, for every small variant (default, llama3 and linear RoPE, tied embeddings, q/k/v biases).
Greedy continuations through it against transformers are test_smollm2.py's (the runner takes this path for
every decode step on the cpu backend).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_testing import SMALL_VARIANTS, PagedRunner, make_hf_model, prefill_logits, random_prompts

from pagedserve.kernels import cpu_unavailable_reason, get_backend
from pagedserve.kernels.layer_ops import rotary_ref
from pagedserve.services.executor.attention import AttentionMetadata, build_attention_metadata
from pagedserve.services.executor.model import LlamaForCausalLM, cpu_decode, load_model
from pagedserve.services.executor.runner import model_forward

pytestmark = pytest.mark.skipif(cpu_unavailable_reason() is not None, reason=f"{cpu_unavailable_reason()}")
pytest.importorskip("transformers")

BLOCK_SIZE = 4
PROMPT_LENGTHS = (11, 3, 8, 1, 6)  # 8: the decode starts a new block; 3: one fills its first block


@pytest.fixture(scope="module", params=sorted(SMALL_VARIANTS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    directory = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, seed=3).save_pretrained(directory, safe_serialization=True)
    loaded, _ = load_model(str(directory), torch.float32, torch.device("cpu"), get_backend("cpu"))
    return loaded


def decode_inputs(runner: PagedRunner, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One decode of each sequence (seq i gets tokens[i]), as PagedRunner would run it, without running it."""
    positions, slots, tables = [], [], []
    for seq in range(len(tokens)):
        position = runner.seq_lens[seq]
        table = runner.block_tables[seq]
        if len(table) * BLOCK_SIZE <= position:
            table.append(runner.free_blocks.pop())
        positions.append(position)
        slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        tables.append(list(table))
    meta = build_attention_metadata([1] * len(tokens), [p + 1 for p in positions], tables, slots, torch.device("cpu"))
    return torch.tensor(tokens), torch.tensor(positions), meta


def prefilled(model: LlamaForCausalLM, lengths: tuple[int, ...] = PROMPT_LENGTHS,
              kv_dtype: torch.dtype | None = None) -> tuple[PagedRunner, list[int]]:
    runner = PagedRunner(model, num_blocks=64, block_size=BLOCK_SIZE, kv_dtype=kv_dtype)
    prompts = random_prompts(lengths, model.config.vocab_size, seed=5)
    last = [int(logits[-1].argmax()) for logits in prefill_logits(runner, prompts)]
    return runner, last


def copy_caches(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in caches]


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# With two threads, five sequences are a task each (each sequence's rotary and cache write run on its thread, in the
# attention's team); one sequence's two KV heads are two tasks (its rotary and cache write run first).
@pytest.mark.parametrize("lengths", [PROMPT_LENGTHS, (8,)], ids=["5-seqs", "1-seq"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32-cache", "bf16-cache"])
@torch.inference_mode()
def test_decode_step_equals_the_generic_layers_bit_for_bit(model: LlamaForCausalLM, lengths: tuple[int, ...],
                                                           kv_dtype: torch.dtype, two_threads: None) -> None:
    runner, last = prefilled(model, lengths, kv_dtype)
    input_ids, positions, meta = decode_inputs(runner, last)
    generic_caches, fast_caches = copy_caches(runner.kv_caches), copy_caches(runner.kv_caches)
    x = model.embed_tokens(input_ids)
    rope = model.rotary(positions, x.dtype)
    assert cpu_decode.applies(model.backend, meta, fast_caches, x)
    generic = model.forward_layers(x.clone(), rope, meta, generic_caches)  # type: ignore[arg-type]
    fast = model_forward(model, input_ids, positions, meta, fast_caches)  # type: ignore[arg-type]
    assert torch.equal(fast, generic)
    for (k_fast, v_fast), (k_generic, v_generic), (k_before, _) in zip(
            fast_caches, generic_caches, runner.kv_caches, strict=True):
        assert torch.equal(k_fast, k_generic) and torch.equal(v_fast, v_generic)
        assert not torch.equal(k_fast, k_before)  # the step's keys were written


@torch.inference_mode()
def test_only_a_step_of_decodes_on_the_cpu_backend_as_built_takes_it(model: LlamaForCausalLM) -> None:
    runner, last = prefilled(model)
    input_ids, _, meta = decode_inputs(runner, last)
    x = model.embed_tokens(input_ids)
    caches = runner.kv_caches
    assert cpu_decode.applies(model.backend, meta, caches, x)  # type: ignore[arg-type]
    mixed = build_attention_metadata([2, 1], [5, 4], [[0, 1], [2]], [3, 4, 8], torch.device("cpu"))
    assert not cpu_decode.applies(model.backend, mixed, caches, x)  # type: ignore[arg-type]
    timed = dataclasses.replace(model.backend, rotary=rotary_ref)  # an op replaced (the benchmark's timers)
    assert not cpu_decode.applies(timed, meta, caches, x)  # type: ignore[arg-type]
    assert not cpu_decode.applies(get_backend("torch"), meta, caches, x)  # type: ignore[arg-type]
    assert not cpu_decode.applies(model.backend, meta, caches, x.double())  # type: ignore[arg-type]


@torch.inference_mode()
def test_a_slot_past_the_cache_is_refused_before_anything_is_written(model: LlamaForCausalLM) -> None:
    runner, last = prefilled(model)
    input_ids, positions, meta = decode_inputs(runner, last)
    num_slots = runner.kv_caches[0][0].shape[0] * BLOCK_SIZE
    bad = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.clone().index_fill_(0, torch.tensor([2]),
                                                                                       num_slots))
    caches = copy_caches(runner.kv_caches)
    with pytest.raises(ValueError, match="slot past the cache"):
        model_forward(model, input_ids, positions, bad, caches)  # type: ignore[arg-type]
    assert all(torch.equal(k, k0) and torch.equal(v, v0)
               for (k, v), (k0, v0) in zip(caches, runner.kv_caches, strict=True))


@torch.inference_mode()
def test_a_block_outside_the_cache_is_refused(model: LlamaForCausalLM) -> None:
    runner, last = prefilled(model)
    input_ids, positions, meta = decode_inputs(runner, last)
    tables = meta.decode_block_tables.clone()
    tables[1, 0] = runner.kv_caches[0][0].shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        model_forward(model, input_ids, positions, dataclasses.replace(meta, decode_block_tables=tables),
                      copy_caches(runner.kv_caches))  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", ["qwen2-bias", "llama-linear-rope-tied"])
def test_a_model_that_released_its_plain_weights_gives_the_same_bits(variant: str, tmp_path: Path) -> None:
    make_hf_model(variant, seed=3).save_pretrained(tmp_path, safe_serialization=True)
    kept, released = (load_model(str(tmp_path), torch.float32, torch.device("cpu"), get_backend("cpu"))[0]
                      for _ in range(2))
    linears = [lin for layer in released.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    linears += [released.lm_head] if released.lm_head is not None else []  # an untied head: released too
    expected = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)
    assert released.release_plain_weights() == expected
    assert all(lin.weight.device.type == "meta" and lin.weight.shape == (lin.out_features, lin.in_features)
               for lin in linears)
    assert released.embed_tokens.weight.device.type == "cpu"  # the embedding (a tied head's weight) keeps its own
    outputs = []
    for model in (kept, released):
        with torch.inference_mode():  # a prefill through the generic layers, then two decode steps (fast path)
            runner, last = prefilled(model)
            logits = [runner.step([(seq, [token]) for seq, token in enumerate(last)]) for _ in range(2)]
        outputs.append((last, [torch.cat(step) for step in logits]))
    assert outputs[0][0] == outputs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(outputs[0][1], outputs[1][1], strict=True))
    assert released.release_plain_weights() == 0  # nothing left to release
    with pytest.raises(ValueError, match="released"):
        released.use_backend(get_backend("torch"))
