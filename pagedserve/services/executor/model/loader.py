"""`load_model`: resolve a name or path, read its checkpoint, fuse Q/K/V and gate/up, place the weights.

The model is built on the meta device and its parameters are then assigned the loaded tensors, so no
memory goes to a random initialisation and each weight is materialised once, in its final dtype and
device. Formats only have to hand out tensors by transformers name (`Checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ....kernels import KernelBackend
from ....kernels.linear_ops import linear_packed
from .config import ModelConfig
from .gguf_loader import GGUFCheckpoint
from .llama import LlamaForCausalLM
from .registry import ModelSource, resolve_model
from .safetensors_loader import SafetensorsCheckpoint


class Checkpoint(Protocol):
    config: ModelConfig

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor of this transformers name, on the CPU, in the checkpoint's dtype (KeyError if absent)."""
        ...

    def rows(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The same tensor's rows read only when looked up (ids -> [n, columns] in `tensor`'s dtype), or None
        where the format cannot (then the loaded tensor is all there is)."""
        ...


def open_checkpoint(source: ModelSource) -> Checkpoint:
    if source.kind == "gguf":
        return GGUFCheckpoint(source.path)
    return SafetensorsCheckpoint(source.path)


def load_model(
    source: str | ModelSource, dtype: torch.dtype, device: torch.device, backend: KernelBackend
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model in eval mode, without gradients, every parameter and buffer in `dtype` on `device`."""
    resolved = resolve_model(source) if isinstance(source, str) else source
    checkpoint = open_checkpoint(resolved)
    config = checkpoint.config
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    state = fused_state_dict(checkpoint, dtype, device)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device=device, dtype=dtype)  # the rotary tables, computed on the CPU in fp32
    model.requires_grad_(False)
    if config.tie_word_embeddings and backend.linear is linear_packed and device.type == "cpu":
        # the head's packed copy will be the only dense one (release_plain_weights): the embedding reads rows
        model.embedding_rows = checkpoint.rows("model.embed_tokens.weight")
    return model.eval(), config


def fused_state_dict(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Our parameter names (see LlamaForCausalLM) -> tensors, each converted as soon as it is read."""
    config = checkpoint.config

    def load(*names: str) -> torch.Tensor:
        parts = [checkpoint.tensor(name).to(device=device, dtype=dtype) for name in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    state = {"embed_tokens.weight": load("model.embed_tokens.weight"), "norm.weight": load("model.norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = load("lm_head.weight")
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        qkv = [f"{hf}.self_attn.{p}_proj" for p in "qkv"]
        state[f"{ours}.self_attn.qkv_proj.weight"] = load(*(f"{name}.weight" for name in qkv))
        if config.attention_bias:
            state[f"{ours}.self_attn.qkv_proj.bias"] = load(*(f"{name}.bias" for name in qkv))
        state[f"{ours}.self_attn.o_proj.weight"] = load(f"{hf}.self_attn.o_proj.weight")
        state[f"{ours}.mlp.gate_up_proj.weight"] = load(f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight")
        state[f"{ours}.mlp.down_proj.weight"] = load(f"{hf}.mlp.down_proj.weight")
        state[f"{ours}.input_layernorm.weight"] = load(f"{hf}.input_layernorm.weight")
        state[f"{ours}.post_attention_layernorm.weight"] = load(f"{hf}.post_attention_layernorm.weight")
    return state
