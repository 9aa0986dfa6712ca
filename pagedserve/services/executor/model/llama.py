"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2) over a flat token batch and a paged KV cache.

Tokens of all sequences are concatenated, with no padding and no batch dimension, as in vLLM: prefill
chunks first, then one token per decoding sequence, in the order `AttentionMetadata` describes. Every
attention layer goes through `paged_attention`, so a prefix already in the cache is never recomputed; with
a per-sequence KV layout (virtual, static) a layer gets a `DenseLayer` instead and attends densely.
Q/K/V and gate/up are each one Linear (fused by the loaders), so a layer runs four matmuls, not seven.
The norms (each with the residual add before it), the rotary embedding and SiLU * up are the kernel
backend's (`KernelBackend`): with the torch and Triton backends, transformers' own arithmetic (fp32 results
match it to rounding); with the CPU backend, one-pass C kernels within a few ulp of it. So are the matmuls
of the linear layers and the LM head: `F.linear`, or on the CPU backend oneDNN's with packed weights. The model
knows no backend's fast path: on the cpu backend the runner runs a step of decodes only through
`cpu_decode.decode_forward` instead of `forward_layers` (the same kernels in the same order, its checks, buffers
and lookups once per step rather than once per layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ....kernels import KernelBackend
from ....kernels.linear_ops import PackedWeight, linear_packed
from ..attention import AttentionMetadata, paged_attention
from ..dense_attention import DenseAttentionMetadata, DenseLayer, dense_attention
from .config import ModelConfig
from .rope import RopeTables, RotaryEmbedding

# paged: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; per-sequence layouts: the layer index
KVCache = tuple[torch.Tensor, torch.Tensor] | DenseLayer
Metadata = AttentionMetadata | DenseAttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, backend: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:  # [num_tokens, hidden]
        """rms_norm(x); with `delta`, the residual add before it in the same call: x += delta in place."""
        if delta is None:
            return self.backend.rms_norm(x, self.weight, self.eps)
        return self.backend.add_rms_norm(x, delta, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear through the kernel backend's matmul, which may keep a copy of the weight in a layout of its
    own (`packed`: the CPU backend's panels or oneDNN layout, made again if the weight changes). `gate_up`: an MLP's
    gate/up layer, which the backend may pack for its SiLU * up fused (`PackedWeight`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: KernelBackend, *,
                 gate_up: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.backend = backend
        self.packed = PackedWeight(gate_up=gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias, self.packed)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, backend)
        self.o_proj = Linear(self.q_size, config.hidden_size, False, backend)
        self.backend = backend

    def forward(
        self,
        rope: RopeTables,
        x: torch.Tensor,  # [num_tokens, hidden]
        meta: Metadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        qk = self.backend.rotary(qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [num_tokens, heads, head_dim] each
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if isinstance(kv_cache, DenseLayer):
            assert isinstance(meta, DenseAttentionMetadata), "a dense layer was given paged metadata"
            out = dense_attention(q, k, v, meta, kv_cache.layer, self.scale)
        else:
            assert isinstance(meta, AttentionMetadata), "a paged layer was given dense metadata"
            k_cache, v_cache = kv_cache
            out = paged_attention(q, k, v, k_cache, v_cache, meta, self.backend, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, backend, gate_up=True)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, backend)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        fused, gate_up = self.backend.linear_silu_and_mul, self.gate_up_proj
        activated = self.backend.silu_and_mul(gate_up(x)) if fused is None else fused(x, gate_up.weight, gate_up.packed)
        return self.down_proj(activated)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.mlp = MLP(config, backend)

    def forward(
        self, rope: RopeTables, x: torch.Tensor, delta: torch.Tensor | None, meta: Metadata, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, hidden] each
        """x: the residual stream, the model's own tensor (the embedding's output), added to in place; `delta`:
        the previous layer's MLP output, not added yet (None in the first layer). Each sublayer's output is added
        by the norm after it, in one call (`RMSNorm(x, delta)`); this layer's MLP output is returned for the next
        norm to add."""
        x_normed = self.input_layernorm(x, delta)
        x_normed = self.post_attention_layernorm(x, self.self_attn(rope, x_normed, meta, kv_cache))
        return x, self.mlp(x_normed)


class RowsEmbedding(nn.Module):
    """An embedding whose rows the checkpoint gives as they are looked up (`Checkpoint.rows`: kept in the file's
    format, the loaded values bit for bit), so that no dense table is held: what a tied LM head leaves behind once
    its packed copy is the only dense one. `weight` is a meta tensor of the table's shape: nothing reads it."""

    def __init__(self, rows: Callable[[torch.Tensor], torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows, self.dtype = rows, dtype
        self.weight = torch.empty(shape, dtype=dtype, device="meta")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(input_ids.cpu()).to(device=input_ids.device, dtype=self.dtype)


class LlamaForCausalLM(nn.Module):
    """Parameter names are those of transformers with q/k/v fused into `qkv_proj` (rows in q, k, v order)
    and gate/up into `gate_up_proj` (gate rows first); `lm_head` is absent when embeddings are tied."""

    def __init__(self, config: ModelConfig, backend: KernelBackend) -> None:
        super().__init__()
        self.config = config
        # no random init: the loader assigns every weight, and nn.Embedding's normal_ on the meta device imports
        # torch's compile machinery first (~2 s of every executor start)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)
        self.head_packed = PackedWeight()  # the LM head's weight (the embedding's if tied), as the backend keeps it
        # the loader's way to read the embedding's rows from the checkpoint (None: it cannot): release_plain_weights
        self.embedding_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.backend = backend
        self.plain_weights_released = False

    def release_plain_weights(self) -> int:
        """On a backend that multiplies by packed copies (the cpu backend's oneDNN layout), packs every linear
        weight now and lets the plain ones go (meta tensors of their shapes stand in), instead of
        holding both: for a served model, whose weights never change. Returns the bytes let go (0 on another
        backend). The model then runs on packing backends only. An untied LM head is released too; so is a tied
        one where the loader can read the embedding's rows from the checkpoint (`embedding_rows`: a GGUF file),
        which the embedding then does; otherwise the embedding keeps the weight it shares with the head."""
        if self.backend.linear is not linear_packed:
            return 0
        layers: list[tuple[nn.Linear, PackedWeight]] = [
            (module, module.packed) for module in self.modules() if isinstance(module, Linear)]
        if self.lm_head is not None:
            layers.append((self.lm_head, self.head_packed))
        released = 0
        with torch.no_grad():
            for module, packed in layers:
                weight = module.weight
                if weight.device.type != "meta":
                    module.weight = nn.Parameter(packed.release(weight), requires_grad=False)
                    released += weight.numel() * weight.element_size()
            table = self.embed_tokens.weight
            if self.lm_head is None and self.embedding_rows is not None and table.device.type == "cpu":
                self.head_packed.release(table)
                self.embed_tokens = RowsEmbedding(self.embedding_rows, table.shape, table.dtype)  # type: ignore[assignment]
                released += table.numel() * table.element_size()
        self.plain_weights_released = True
        return released

    def use_backend(self, backend: KernelBackend) -> KernelBackend:
        """Runs every layer on `backend` from now on; returns the one it replaces."""
        if self.plain_weights_released and backend.linear is not linear_packed:
            raise ValueError(f"backend {backend.name!r} multiplies by the plain linear weights, which this model "
                             "released (release_plain_weights): it runs on a packing backend only")
        previous = self.backend
        for module in self.modules():
            if isinstance(module, (LlamaForCausalLM, Attention, MLP, RMSNorm, Linear)):
                module.backend = backend
        return previous

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: Metadata,
        kv_caches: list[KVCache],  # one per layer
    ) -> torch.Tensor:  # [num_tokens, hidden], after the final norm
        x, rope = self.embed(input_ids, positions)
        return self.forward_layers(x, rope, meta, kv_caches)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, RopeTables]:
        """The embedded tokens [num_tokens, hidden] and the rotary tables of their positions: what every forward
        over the layers starts from (this model's `forward_layers`, or a backend's own, chosen by the runner)."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        return x, self.rotary(positions, x.dtype)

    def forward_layers(self, x: torch.Tensor, rope: RopeTables, meta: Metadata, kv_caches: list[KVCache]
                       ) -> torch.Tensor:
        """The decoder layers and the final norm over the embedded tokens `x` (added to in place): every
        backend, every batch."""
        assert len(kv_caches) == len(self.layers), f"{len(kv_caches)} KV caches for {len(self.layers)} layers"
        delta: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, delta = layer(rope, x, delta, meta, kv_cache)
        return self.norm(x, delta)

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        """`out` ([n, vocab] fp32, contiguous), when given, may receive the logits of an fp32 model (a buffer
        reused across steps); the returned tensor holds them either way."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        fp32 = hidden.dtype == torch.float32
        return self.backend.linear(hidden, weight, None, self.head_packed, out if fp32 else None).float()
