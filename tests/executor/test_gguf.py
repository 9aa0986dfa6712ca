"""GGUF reading: dequantization per type, llama.cpp's Q/K row permutation, metadata -> ModelConfig.

Files are written here with gguf's own GGUFWriter, so every case is small and known.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from model_testing import PagedRunner, hf_logits, make_hf_model, prefill_logits, random_prompts

from pagedserve.kernels import cpu_unavailable_reason, get_backend
from pagedserve.services.executor.model import ModelConfig, RopeScaling, load_model
from pagedserve.services.executor.model.gguf_file import GGUFFile
from pagedserve.services.executor.model.gguf_loader import GGUFRows, dequantize_tensor, unpermute_rope_rows
from pagedserve.services.executor.model.llama import RowsEmbedding

# Tolerance against the original values, as a fraction of the tensor's largest |value|: a half step of
# the format's grid (per-block scales in fp16 add a little), with margin.
QUANT_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], metadata: dict[str, Any],
               configure: Callable[[gguf.GGUFWriter], None] = lambda writer: None) -> None:
    """`metadata` through the writer's `add_<key>` methods; `configure` may add anything else first."""
    writer = gguf.GGUFWriter(path, arch)
    configure(writer)
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    for name, (values, qtype) in tensors.items():
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_dequantize_tensor(qtype: Q, tmp_path: Path) -> None:
    original = np.random.default_rng(0).normal(size=(3, 96)).astype(np.float32)  # 3 rows of 3 blocks of 32
    write_gguf(tmp_path / "t.gguf", "llama", {"w": (original, qtype)}, {})
    (tensor,) = GGUFFile(tmp_path / "t.gguf").tensors
    ours = dequantize_tensor(tensor)
    assert ours.dtype == torch.float32 and ours.shape == (3, 96)
    reference = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype).reshape(3, 96)
    assert torch.equal(ours, torch.from_numpy(reference))
    error = np.abs(ours.numpy() - original).max() / np.abs(original).max()
    assert error <= QUANT_TOLERANCE[qtype], f"{qtype.name}: relative error {error:.3g}"


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE), ids=lambda q: q.name)
def test_rows_read_when_looked_up_are_the_dequantized_tensors_rows(qtype: Q, tmp_path: Path) -> None:
    original = np.random.default_rng(1).normal(size=(5, 96)).astype(np.float32)
    write_gguf(tmp_path / "t.gguf", "llama", {"token_embd.weight": (original, qtype)}, {})
    (tensor,) = GGUFFile(tmp_path / "t.gguf").tensors
    rows, ids = GGUFRows(tensor), torch.tensor([4, 0, 4, 2])
    assert rows.shape == (5, 96)
    assert torch.equal(rows(ids), dequantize_tensor(tensor)[ids])  # bit for bit, repeats and order kept
    assert rows(torch.tensor([], dtype=torch.int64)).shape == (0, 96)
    assert not np.shares_memory(rows.data, tensor.data)  # its own bytes: the file's map may close


def llama_cpp_permute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (with n_head already set to n_head_kv for K)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.mark.parametrize("shape", [(3 * 8, 5), (3 * 8,)], ids=["weight", "bias"])
def test_unpermute_undoes_llama_cpp_permute(shape: tuple[int, ...]) -> None:
    original = torch.randn(shape)
    permuted = llama_cpp_permute(original, num_heads=3)
    assert not torch.equal(permuted, original)
    assert torch.equal(unpermute_rope_rows(permuted, num_heads=3), original)
    # Head 1, pair i = 2: its two rotary partners (rows 2 and 2 + head_dim / 2) sit next to each other in GGUF.
    assert torch.equal(permuted[8 + 4], original[8 + 2]) and torch.equal(permuted[8 + 5], original[8 + 6])


def hf_to_gguf(hf_model: Any, path: Path, rope_scaling_factor: float | None, embedding: Q = Q.F32) -> None:
    """What llama.cpp's converter writes for a small Llama / Qwen2 (F32 tensors, so weights stay exact; the
    embedding in `embedding`'s format)."""
    config = hf_model.config
    arch = config.model_type
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    tensors: dict[str, tuple[np.ndarray, Q]] = {}
    for name, param in hf_model.state_dict().items():
        value = param.detach()
        if name.startswith("model.layers."):
            parts = name.split(".")  # model.layers.{layer}.{module}.{weight|bias}
            layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
                value = llama_cpp_permute(value, heads)
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        tensors[gguf_name] = (value.numpy(), embedding if gguf_name == "token_embd.weight" else Q.F32)
    metadata: dict[str, Any] = {
        "name": f"tiny-{arch}", "vocab_size": config.vocab_size, "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
        "block_count": config.num_hidden_layers, "head_count": config.num_attention_heads,
        "head_count_kv": config.num_key_value_heads, "layer_norm_rms_eps": config.rms_norm_eps,
        "rope_freq_base": config.rope_parameters["rope_theta"],
        "rope_dimension_count": config.hidden_size // config.num_attention_heads,
        "bos_token_id": 5, "eos_token_id": 6,
    }
    if rope_scaling_factor is not None:
        metadata |= {"rope_scaling_type": gguf.RopeScalingType.LINEAR, "rope_scaling_factor": rope_scaling_factor}
    write_gguf(path, arch, tensors, metadata)


@pytest.mark.parametrize("variant", ["llama", "llama-linear-rope-tied", "qwen2-bias"])
def test_gguf_model_matches_transformers(variant: str, tmp_path: Path) -> None:
    hf_model = make_hf_model(variant)
    scaling = hf_model.config.rope_parameters.get("factor")
    hf_to_gguf(hf_model, tmp_path / "tiny.gguf", scaling)
    ours, config = load_model(str(tmp_path / "tiny.gguf"), torch.float32, torch.device("cpu"), get_backend("torch"))
    hf = hf_model.config
    expected = ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rms_norm_eps=pytest.approx(hf.rms_norm_eps), rope_theta=hf.rope_parameters["rope_theta"],
        rope_scaling=None if scaling is None else RopeScaling("linear", scaling),
        max_position_embeddings=hf.max_position_embeddings, tie_word_embeddings=hf.tie_word_embeddings,
        attention_bias=variant.startswith("qwen2"), bos_token_id=5, eos_token_ids=(6,), name=f"tiny-{hf.model_type}",
    )
    assert config == expected
    prompts = random_prompts((13, 6), config.vocab_size)
    for prompt, logits in zip(prompts, prefill_logits(PagedRunner(ours, 32, 4), prompts), strict=True):
        diff = (logits - hf_logits(hf_model, prompt)).abs().max().item()
        assert diff < 1e-4, f"max |logit diff| {diff:.2e}"


@pytest.mark.skipif(cpu_unavailable_reason() is not None, reason=f"{cpu_unavailable_reason()}")
def test_a_tied_gguf_model_released_keeps_no_dense_embedding_and_gives_the_same_bits(tmp_path: Path) -> None:
    """On the cpu backend a served model keeps only the packed copy of each weight; with a tied head read from a
    GGUF file, the embedding then reads its rows from the file's map: no dense table is left, nothing changes."""
    hf_model = make_hf_model("llama-linear-rope-tied")
    hf_to_gguf(hf_model, tmp_path / "tiny.gguf", hf_model.config.rope_parameters.get("factor"), embedding=Q.Q8_0)
    kept, released = (load_model(str(tmp_path / "tiny.gguf"), torch.float32, torch.device("cpu"),
                                 get_backend("cpu"))[0] for _ in range(2))
    assert released.lm_head is None
    table = released.embed_tokens.weight
    linears = [lin for layer in released.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    expected = sum(t.numel() * t.element_size() for t in [table, *(lin.weight for lin in linears)])
    assert released.release_plain_weights() == expected
    assert isinstance(released.embed_tokens, RowsEmbedding) and released.embed_tokens.weight.device.type == "meta"
    prompts = random_prompts((9, 3, 5), released.config.vocab_size, seed=4)
    outputs = []
    for model in (kept, released):
        with torch.inference_mode():  # a prefill through the generic layers, then two decode steps (the fast path)
            runner = PagedRunner(model, 32, 4)
            first = prefill_logits(runner, prompts)
            last = [int(logits[-1].argmax()) for logits in first]
            steps = [torch.cat(runner.step([(seq, [token]) for seq, token in enumerate(last)])) for _ in range(2)]
        outputs.append([torch.cat(first), *steps])
    assert all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))


@pytest.mark.skipif(cpu_unavailable_reason() is not None, reason=f"{cpu_unavailable_reason()}")
def test_an_f32_embedding_is_not_read_by_rows(tmp_path: Path) -> None:
    """Rows in F32 would take as much memory as the loaded table: the checkpoint offers none, and the embedding keeps
    its table."""
    hf_model = make_hf_model("llama-linear-rope-tied")
    hf_to_gguf(hf_model, tmp_path / "tiny.gguf", hf_model.config.rope_parameters.get("factor"))
    model, _ = load_model(str(tmp_path / "tiny.gguf"), torch.float32, torch.device("cpu"), get_backend("cpu"))
    assert model.embedding_rows is None
    model.release_plain_weights()
    assert model.embed_tokens.weight.device.type == "cpu"  # the table, shared with the head's packed copy's source


def test_rows_are_kept_only_where_the_packed_head_will_be_the_only_dense_copy(tmp_path: Path) -> None:
    """The torch backend multiplies by the embedding's own table: no copy of the file's bytes is kept for it."""
    hf_model = make_hf_model("llama-linear-rope-tied")
    hf_to_gguf(hf_model, tmp_path / "tiny.gguf", hf_model.config.rope_parameters.get("factor"), embedding=Q.Q8_0)
    model, _ = load_model(str(tmp_path / "tiny.gguf"), torch.float32, torch.device("cpu"), get_backend("torch"))
    assert model.embedding_rows is None
