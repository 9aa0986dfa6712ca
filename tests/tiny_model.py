"""A tiny random-weight Llama: a real model (saved as safetensors, loaded by our loader) that runs in
milliseconds, for tests of everything around the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 96
EOS = 95


def randomize_norms_and_biases(model: Any) -> None:
    """transformers inits norms to ones and biases to zeros, which would hide a swapped norm or a dropped bias."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)


def save_tiny_llama(path: Path) -> Path:
    import torch
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
    model.save_pretrained(path, safe_serialization=True)
    return path


def save_tiny_chat_llama(path: Path) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template (vocabulary 49152): text in,
    text out, for tests of the serving stack that need real tokenization but not a good model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedserve.services.executor.model.registry import resolve_model
    from pagedserve.services.executor.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits: greedy choices far from ties, and varied text
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
