"""Rotary position embeddings in the "rotate_half" layout of Hugging Face checkpoints.

A head's dimension i is paired with i + head_dim / 2 (not with its neighbour, as in the original paper and
in llama.cpp's GGUF layout: the GGUF loader un-permutes Q/K rows so that this layout holds for both).
The cos/sin tables cover every position up to max_position_embeddings once, computed in fp32 exactly as
transformers does (position * inv_freq, then cos/sin), then cast with the module; a step only gathers rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import RopeScaling

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, head_dim // 2]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The inverse frequency of each dimension pair: [head_dim // 2] fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by the factor, interpolate the band in between.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # [max_positions, head_dim // 2]
    sin_cache: torch.Tensor  # [max_positions, head_dim // 2]

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        # Built on the CPU even under a meta-device context (the loader's): tables are computed, not loaded.
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The rows of `positions` ([num_tokens] int64, each < max_positions), gathered once per step for
        every layer: ([num_tokens, 1, head_dim // 2], same) broadcast over heads."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin

