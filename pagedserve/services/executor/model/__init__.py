"""Llama-family models over the paged KV cache, their loaders (safetensors, GGUF) and tokenizers.

The exports below are imported on first use: the frontend imports `registry` and `tokenizer` from this
package and must not load torch (or transformers' model code) by doing so.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
_MODULE_OF = {
    "ModelConfig": "config", "RopeScaling": "config", "KVCache": "llama", "LlamaForCausalLM": "llama",
    "load_model": "loader", "NAMED_MODELS": "registry", "ModelSource": "registry", "resolve_model": "registry",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
