"""A minimal paged driver for model tests, and transformers references to compare it with.

`PagedRunner` plays the block manager and the runner at once: per-layer KV caches, a shuffled free list
(so that a sequence's blocks are never contiguous by luck), one block table per sequence, and steps that
put multi-token chunks first as `build_attention_metadata` requires.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tiny_model import randomize_norms_and_biases

from pagedserve.kernels import KernelBackend
from pagedserve.services.common.kv_geometry import slot_of
from pagedserve.services.executor.attention import build_attention_metadata
from pagedserve.services.executor.model import LlamaForCausalLM
from pagedserve.services.executor.runner import model_forward

CPU = torch.device("cpu")

SMALL_CONFIG: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    # Logits spread wide enough that greedy choices are not near-ties; no EOS, so generate() never stops.
    "initializer_range": 0.1, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# name -> (transformers model_type, overrides of SMALL_CONFIG)
SMALL_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-linear-rope-tied": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                          "tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {}),
}


def make_hf_model(variant: str, seed: int = 0) -> Any:
    """A random-weight transformers model, norms and biases randomised too (transformers inits them to
    ones and zeros, which would hide a swapped norm or a dropped bias)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = SMALL_VARIANTS[variant]
    config = AutoConfig.for_model(model_type, **{**SMALL_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_norms_and_biases(model)
    return model


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


class PagedRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, seed: int = 0,
                 kv_dtype: torch.dtype | None = None) -> None:
        """`kv_dtype`: the caches' (default: the model's)."""
        config = model.config
        dtype = kv_dtype or model.embed_tokens.weight.dtype
        self.model = model
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(config.num_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    def share_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Start `dst` on `src`'s first num_tokens (whole blocks): a prefix-cache hit, KV already computed."""
        assert num_tokens % self.block_size == 0 and num_tokens <= self.seq_lens[src]
        self.block_tables[dst] = self.block_tables[src][: num_tokens // self.block_size]
        self.seq_lens[dst] = num_tokens

    @torch.inference_mode()
    def step(self, chunks: Sequence[tuple[int, Sequence[int]]]) -> list[torch.Tensor]:
        """Runs one forward over (seq_id, new tokens) chunks; returns each chunk's logits [len(tokens), vocab]
        fp32, in the order given (the batch itself puts multi-token chunks first)."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i][1]) == 1)
        logits = self._forward([chunks[i] for i in order])
        by_chunk = dict(zip(order, logits, strict=True))
        return [by_chunk[i] for i in range(len(chunks))]

    def _forward(self, chunks: Sequence[tuple[int, Sequence[int]]]) -> list[torch.Tensor]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for seq, tokens in chunks:
            start = self.seq_lens.get(seq, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            input_ids += tokens
            positions += range(start, end)
            slots += [slot_of(table, p, self.block_size) for p in range(start, end)]
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(list(table))
            self.seq_lens[seq] = end
        meta = build_attention_metadata(query_lens, seq_lens, tables, slots, CPU)
        hidden = model_forward(self.model, torch.tensor(input_ids), torch.tensor(positions), meta,
                               self.kv_caches)  # type: ignore[arg-type]
        return list(self.model.compute_logits(hidden).split(query_lens))


def prefill_logits(runner: PagedRunner, prompts: Sequence[Sequence[int]], first_seq: int = 0) -> list[torch.Tensor]:
    """All prompts as one ragged prefill step; each prompt's logits [len, vocab]."""
    return runner.step([(first_seq + i, p) for i, p in enumerate(prompts)])


def greedy_generate(runner: PagedRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations. Prompt i is admitted at step i, so steps mix a prefill with running decodes."""
    outputs: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(out) < max_new_tokens for out in outputs):
        chunks: list[tuple[int, Sequence[int]]] = []
        if step < len(prompts):
            chunks.append((step, prompts[step]))
        chunks += [(seq, [out[-1]]) for seq, out in enumerate(outputs) if out and len(out) < max_new_tokens]
        for (seq, _), logits in zip(chunks, runner.step(chunks), strict=True):
            outputs[seq].append(int(logits[-1].argmax()))
        step += 1
    return outputs


@torch.inference_mode()
def hf_logits(hf_model: torch.nn.Module, prompt: Sequence[int]) -> torch.Tensor:  # [len, vocab]
    return hf_model(torch.tensor([list(prompt)])).logits[0].float()  # type: ignore[no-any-return]


@torch.inference_mode()
def hf_greedy(hf_model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' generate(do_sample=False), which may stop early at an EOS token."""
    out = hf_model.generate(  # type: ignore[operator]
        torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens, do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return [int(t) for t in out[0, len(prompt):]]


def assert_same_continuation(ours: list[int], reference: list[int], eos_ids: Sequence[int]) -> None:
    """Ours never stops; the reference stops after an EOS, so it must be a prefix of ours ending in EOS."""
    assert ours[: len(reference)] == reference, f"ours {ours}\nhf   {reference}"
    assert len(reference) == len(ours) or reference[-1] in eos_ids, "reference stopped without EOS"


def transformers_attention_backend(base: KernelBackend) -> KernelBackend:
    """`base` with a prefill computed as transformers' sdpa path does it (K/V heads repeated, is_causal),
    for one sequence prefilled in one chunk. With it the model's logits equal transformers' to the bit,
    which separates the model's correctness from the attention kernels' summation order."""

    def prefill_attention(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, *, max_query_len: int | None = None,
    ) -> torch.Tensor:
        num_tokens, block_size = q.shape[0], k_cache.shape[1]
        assert cu_seqlens_q.tolist() == [0, num_tokens] and seq_lens.tolist() == [num_tokens], "one-shot only"
        blocks = block_tables[0, : -(-num_tokens // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:num_tokens]  # [num_tokens, num_kv_heads, head_dim]
        v = v_cache[blocks].flatten(0, 1)[:num_tokens]
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1)[None] for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True, scale=scale)
        return out[0].transpose(0, 1)

    return dataclasses.replace(base, prefill_attention=prefill_attention)
