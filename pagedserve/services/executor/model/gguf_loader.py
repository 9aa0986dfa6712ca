"""A GGUF file (llama.cpp): tensors dequantized to fp32 and renamed to transformers' names.

llama.cpp's converter permutes the rows of Llama's Q and K projections (weights and biases) so that each
head's rotary pairs are adjacent (its interleaved RoPE); the model here uses transformers' rotate_half
layout, where dimension i pairs with i + head_dim / 2, so those rows are permuted back. Qwen2 is
converted without the permutation (llama.cpp runs it with NeoX-style RoPE, i.e. rotate_half).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from .config import ModelConfig
from .gguf_file import GGUFFile, GGUFTensor

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFCheckpoint:
    """Tensors by transformers name; each is dequantized when asked for (the file is memory-mapped)."""

    def __init__(self, path: Path) -> None:
        gguf = GGUFFile(path)
        self.config = ModelConfig.from_gguf_metadata(gguf)
        self._permuted = gguf.metadata["general.architecture"] == "llama"
        self._tensors = {name: t for t in gguf.tensors if (name := hf_name(t.name)) is not None}

    def tensor(self, name: str) -> torch.Tensor:
        entry = self._tensors.get(name)
        if entry is None:
            raise KeyError(f"GGUF file has no tensor for {name!r}")
        weights = dequantize_tensor(entry)
        if self._permuted and ".q_proj." in name:
            weights = unpermute_rope_rows(weights, self.config.num_heads)
        elif self._permuted and ".k_proj." in name:
            weights = unpermute_rope_rows(weights, self.config.num_kv_heads)
        return weights

    def rows(self, name: str) -> GGUFRows | None:
        """A 2-D tensor's rows, kept in the file's own format and dequantized when looked up; None where that
        saves nothing (F32) or the loader permutes the rows (Q, K)."""
        entry = self._tensors.get(name)
        if entry is None:
            raise KeyError(f"GGUF file has no tensor for {name!r}")
        if entry.tensor_type == GGMLQuantizationType.F32 or ".q_proj." in name or ".k_proj." in name:
            return None
        return GGUFRows(entry) if len(entry.shape) == 2 else None


class GGUFRows:
    """Rows of a 2-D tensor (an embedding) in the file's format (a copy of its bytes: the file's map is closed
    after loading), dequantized when looked up: each row is the one `dequantize_tensor` gives, bit for bit
    (every format's blocks lie within a row, and dequantizing is elementwise per block). SmolLM2's Q4_1
    embedding: 18 MB of bytes instead of a 113 MB fp32 table."""

    def __init__(self, tensor: GGUFTensor) -> None:
        self.data, self.tensor_type = np.array(tensor.data), tensor.tensor_type
        self.shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # [rows, columns]: GGUF lists the innermost first

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `ids` ([n] integers, on the CPU) as an fp32 tensor [n, columns]."""
        picked = self.data[ids.numpy()]  # quantized formats: [n, bytes per row]; plain ones: [n, columns]
        values = dequantize(picked, self.tensor_type) if len(picked) else np.empty((0, self.shape[1]))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(len(picked), self.shape[1]))


def hf_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF tensor, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """Any type gguf can dequantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, K-quants...) to an fp32 tensor in
    torch's row-major shape (GGUF lists dimensions innermost first)."""
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {tensor.name}: cannot dequantize GGML type {tensor.tensor_type.name}") from e
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # F32 comes back as a read-only view of the memory-mapped file; torch needs memory it may own.
    values = np.array(values, dtype=np.float32, copy=not values.flags.writeable).reshape(shape)
    return torch.from_numpy(values)


def unpermute_rope_rows(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute(w, n_head)`: per head, GGUF row 2i + j holds transformers' row
    j * head_dim / 2 + i. Works on a weight [num_heads * head_dim, in] and on a bias [num_heads * head_dim]."""
    rows = weights.shape[0]
    half = rows // num_heads // 2
    # [num_heads, half, 2, ...] -> [num_heads, 2, half, ...]
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)
