"""Llama-family models over the paged KV cache, their loaders (safetensors, GGUF) and tokenizers.

Importing this package does not import transformers: only `tokenizer` needs it (import it from there).
"""

from .config import ModelConfig, RopeScaling
from .llama import KVCache, LlamaForCausalLM
from .loader import load_model
from .registry import NAMED_MODELS, ModelSource, resolve_model

__all__ = [
    "NAMED_MODELS",
    "KVCache",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelSource",
    "RopeScaling",
    "load_model",
    "resolve_model",
]
