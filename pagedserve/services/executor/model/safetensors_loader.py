"""A Hugging Face checkpoint directory: config.json plus one model.safetensors or an indexed set of shards.

EOS ids are the union of config.json's and generation_config.json's: instruct models often list their
end-of-turn token only in the latter (Llama 3's <|eot_id|>), and generation must stop at either.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .config import ModelConfig, as_token_ids
from .registry import hf_weight_files


class SafetensorsCheckpoint:
    """Tensors by transformers name, read lazily (safetensors memory-maps each file)."""

    def __init__(self, directory: Path) -> None:
        config = ModelConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
        generation_config = directory / "generation_config.json"
        if generation_config.is_file():
            extra = as_token_ids(json.loads(generation_config.read_text()).get("eos_token_id"))
            config = replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
        self.config = config
        self._files: dict[str, Any] = {}  # tensor name -> open safetensors file
        for path in hf_weight_files(directory):
            handle = safe_open(str(path), framework="pt", device="cpu")
            # safe_open is neither a mapping nor iterable: keys() is its only listing.
            for name in handle.keys():  # noqa: SIM118
                self._files[name] = handle

    def tensor(self, name: str) -> torch.Tensor:
        handle = self._files.get(name)
        if handle is None:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return handle.get_tensor(name)

    def rows(self, name: str) -> None:
        """Not read by rows here (safetensors slices by ranges, not by lists of ids): the loaded tensor is kept."""
        return None
