"""The shape of a Llama-family decoder, read from a Hugging Face config.json or from GGUF metadata.

Both readers refuse what the model cannot run (sliding windows, MLP biases, partial rotary, RoPE types
other than default / linear / llama3) instead of silently computing something else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .gguf_file import GGUFFile


RopeType = Literal["linear", "llama3"]
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class RopeScaling:
    """Context extension applied to the rotary inverse frequencies (see rope.py)."""

    rope_type: RopeType
    factor: float
    # llama3 only: the band of wavelengths between the two is interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = ""

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelConfig:
        """From a parsed config.json of LlamaForCausalLM or Qwen2ForCausalLM, in the transformers 4 layout
        (`rope_theta` + `rope_scaling`) or the transformers 5 one (`rope_parameters`)."""
        architectures = config.get("architectures") or ["LlamaForCausalLM"]
        architecture = architectures[0]
        if architecture not in SUPPORTED_HF_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r}; supported: {SUPPORTED_HF_ARCHITECTURES}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (SwiGLU needs silu)")
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if config.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        if any(isinstance(v, dict) for v in rope.values()):
            raise ValueError("per-layer-type RoPE parameters are not supported")
        rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        max_positions = int(config.get("max_position_embeddings", 4096))
        num_heads = int(config["num_attention_heads"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or 0),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling_from_hf(rope, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and its config does not say so.
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=as_token_ids(config.get("eos_token_id")),
            name=str(config.get("_name_or_path") or config.get("model_type") or architecture),
        )

    @classmethod
    def from_gguf_metadata(cls, gguf: GGUFFile) -> ModelConfig:
        """From the metadata (and the tensor list, for biases and tied embeddings) of a GGUF file."""
        metadata = gguf.metadata
        arch = _field(metadata, "general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_GGUF_ARCHITECTURES}")
        tensor_names = gguf.tensor_names()
        if "rope_freqs.weight" in tensor_names:
            # llama.cpp stores llama3 RoPE scaling as per-frequency factors, not as metadata.
            raise ValueError("GGUF files with rope_freqs (llama3 RoPE scaling) are not supported")
        hidden = int(_field(metadata, f"{arch}.embedding_length"))
        num_heads = int(_field(metadata, f"{arch}.attention.head_count"))
        head_dim = int(_field(metadata, f"{arch}.attention.key_length", hidden // num_heads))
        if int(_field(metadata, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
            raise ValueError("partial rotary embeddings are not supported")
        vocab = _field(metadata, f"{arch}.vocab_size", None)
        if vocab is None:
            vocab = len(metadata["tokenizer.ggml.tokens"])
        bos = _field(metadata, "tokenizer.ggml.bos_token_id", None)
        eos_ids = tuple(
            int(v) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if (v := _field(metadata, key, None)) is not None
        )
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(_field(metadata, f"{arch}.feed_forward_length")),
            num_layers=int(_field(metadata, f"{arch}.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(_field(metadata, f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(_field(metadata, f"{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(_field(metadata, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling_from_gguf(metadata, arch),
            max_position_embeddings=int(_field(metadata, f"{arch}.context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            name=str(_field(metadata, "general.name", arch)),
        )


def as_token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """A config's token id field, which may be absent, one id or a list, as a tuple."""
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


_MISSING = object()


def _field(metadata: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    if key not in metadata:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return metadata[key]


def _rope_scaling_from_hf(rope: dict[str, Any], max_positions: int) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", max_positions)),
        )
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3")


def _rope_scaling_from_gguf(metadata: dict[str, Any], arch: str) -> RopeScaling | None:
    rope_type = _field(metadata, f"{arch}.rope.scaling.type", "none")
    factor = float(_field(metadata, f"{arch}.rope.scaling.factor", 1.0))
    if rope_type == "none" or (rope_type == "linear" and factor == 1.0):
        return None
    if rope_type == "linear":
        return RopeScaling("linear", factor)
    raise ValueError(f"unsupported GGUF rope scaling {rope_type!r}; supported: none, linear")
