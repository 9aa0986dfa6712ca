"""A bf16 model's C kernels (cpu_layer_ops.c's second half) against torch in fp32 on the same bf16 inputs.

Each kernel loads bf16, computes in fp32 and rounds each result once to bf16. The reference is the same formula in
fp32 on the bf16 inputs widened (exact), unrounded; so the kernel is within half a bf16 ulp of it (relative 2^-8,
`BF16_HALF_ULP`) plus the few fp32 ulps that the order of a sum and exp's polynomial move it (`FP32_SLACK`, of the
row's magnitude). The residual add and the value copied into the cache are exact: torch's bf16 add, and the bits.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_unavailable_reason
from pagedserve.kernels.cpu_layer_ops import add_rms_norm_cpu, rms_norm_cpu, silu_and_mul_cpu
from pagedserve.kernels.cpu_native import native_library
from pagedserve.kernels.paged_decode_attention import paged_decode_attention_ref

pytestmark = pytest.mark.skipif(cpu_unavailable_reason() is not None, reason=f"{cpu_unavailable_reason()}")

BF16_HALF_ULP = 2.0**-8  # a bf16 rounding's largest error, relative to the value
FP32_SLACK = 4e-6  # of the row's magnitude: summation order, exp's polynomial, fused multiply-adds


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}threads")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def assert_rounded_from(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """`ours` (bf16) is `ref` (fp32, unrounded) rounded once, up to FP32_SLACK of each row's magnitude."""
    assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
    if ref.numel() == 0:
        return
    scale = ref.abs().amax(dim=-1, keepdim=True)
    bound = BF16_HALF_ULP * ref.abs() + FP32_SLACK * scale + 1e-30
    excess = ((ours.float() - ref).abs() - bound).max().item()
    assert excess <= 0, f"off by {excess:.3g} beyond a bf16 rounding"


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64])
@pytest.mark.parametrize("hidden", [16, 576, 1000])
def test_rms_norm(num_tokens: int, hidden: int, threads: int) -> None:
    x = (torch.randn(num_tokens, hidden) * 3e3).bfloat16()  # the residual stream of SmolLM2 reaches ~2e4
    weight = torch.randn(hidden).bfloat16()
    assert_rounded_from(rms_norm_cpu(x, weight, 1e-5), rms_norm_fp32(x, weight, 1e-5))


def test_rms_norm_of_a_strided_view() -> None:
    wide = torch.randn(64, 700).bfloat16()
    x, weight = wide[:, 50:626], torch.randn(576).bfloat16()  # rows 700 elements apart
    assert_rounded_from(rms_norm_cpu(x, weight, 1e-6), rms_norm_fp32(x, weight, 1e-6))


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_add_rms_norm_rounds_the_sum_as_torch_then_normalizes_it(num_tokens: int, threads: int) -> None:
    x, delta = (torch.randn(num_tokens, 576) * 50).bfloat16(), torch.randn(num_tokens, 576).bfloat16()
    weight = torch.randn(576).bfloat16()
    expected_x = x + delta  # torch's bf16 add: the fp32 sum rounded once
    out = add_rms_norm_cpu(x, delta, weight, 1e-6)
    assert torch.equal(x.view(torch.int16), expected_x.view(torch.int16))  # in place, bit for bit
    assert_rounded_from(out, rms_norm_fp32(expected_x, weight, 1e-6))


@pytest.mark.parametrize("num_tokens", [0, 3, 64])
@pytest.mark.parametrize("intermediate", [8, 1536])
def test_silu_and_mul(num_tokens: int, intermediate: int, threads: int) -> None:
    gate_up = (torch.randn(num_tokens, 2 * intermediate) * 4).bfloat16()
    gate_up[:, :4] = torch.tensor([-200.0, -88.0, 0.0, 90.0]).bfloat16()  # clamped exp, 0, large: finite
    gate, up = gate_up.float().chunk(2, dim=-1)
    before = gate_up.clone()
    assert_rounded_from(silu_and_mul_cpu(gate_up), F.silu(gate) * up)
    assert torch.equal(gate_up, before)  # a new tensor: the input is left as it was


def rotate_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half over [tokens, heads, head_dim] in fp32; cos, sin [tokens, head_dim / 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@pytest.mark.parametrize("lengths", [(5, 1, 17, 9), (33,)], ids=["4-seqs", "1-seq"])
def test_decode_attention_layer(lengths: tuple[int, ...], threads: int) -> None:
    """Rotary, cache write and attention of a bf16 decode layer (cpu_decode.py's call), against fp32 torch: the
    key written is the rotated key rounded, the value its bits, the output the fp32 attention over the cache rounded.
    """
    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 64, 4, 40
    n, width = len(lengths), (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(n, width + 8) * 2).bfloat16()  # rows 8 elements wider: a strided view of the GEMM's output
    angles = torch.rand(n, head_dim // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).bfloat16()
    blocks = torch.randperm(num_blocks)
    max_blocks = -(-max(lengths) // block_size)
    tables = torch.stack([blocks[i * max_blocks:(i + 1) * max_blocks] for i in range(n)]).int()
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    slots = torch.tensor([int(tables[s, (length - 1) // block_size]) * block_size + (length - 1) % block_size
                          for s, length in enumerate(lengths)])
    qk = torch.empty(n, heads + kv_heads, head_dim)
    attended, out = torch.empty(n, heads * head_dim), torch.empty(n, heads * head_dim, dtype=torch.bfloat16)
    status = native_library().decode_attention_layer_bf16(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), qk.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), num_blocks, block_size, slots.data_ptr(), tables.data_ptr(), max_blocks,
        seq_lens.data_ptr(), attended.data_ptr(), out.data_ptr(), n, heads, kv_heads, head_dim, head_dim**-0.5,
        torch.get_num_threads())
    assert status == 0
    rows = qkv[:, :width].view(n, heads + 2 * kv_heads, head_dim)
    rotated = rotate_fp32(rows[:, : heads + kv_heads], cos, sin)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    assert_rounded_from(flat_k[slots], rotated[:, heads:])
    assert torch.equal(flat_v[slots].view(torch.int16), rows[:, heads + kv_heads:].reshape(n, kv_heads, head_dim)
                       .view(torch.int16))
    expected = paged_decode_attention_ref(rotated[:, :heads].contiguous(), k_cache.float(), v_cache.float(), tables,
                                          seq_lens, head_dim**-0.5)
    assert_rounded_from(out, expected.reshape(n, -1))


def test_a_slot_past_the_cache_is_refused_before_anything_is_written() -> None:
    heads, kv_heads, head_dim = 2, 1, 8
    qkv = torch.randn(1, (heads + 2 * kv_heads) * head_dim).bfloat16()
    cache = torch.zeros(2, 4, kv_heads, head_dim, dtype=torch.bfloat16)
    k_cache, v_cache = cache.clone(), cache.clone()
    cos, sin = torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    slots = torch.tensor([8])
    qk, attended = torch.empty(1, heads + kv_heads, head_dim), torch.empty(1, heads * head_dim)
    out = torch.empty(1, heads * head_dim, dtype=torch.bfloat16)
    status = native_library().decode_attention_layer_bf16(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), qk.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), 2, 4, slots.data_ptr(), tables.data_ptr(), 1, lens.data_ptr(), attended.data_ptr(),
        out.data_ptr(), 1, heads, kv_heads, head_dim, 1.0, 1)
    assert status == 4  # cpu_native.ERRORS[4]: a slot past the cache
    assert torch.equal(k_cache, cache) and torch.equal(v_cache, cache)


def test_mixed_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="the others' dtype"):
        rms_norm_cpu(torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="fp32 or bf16 CPU"):
        silu_and_mul_cpu(torch.randn(2, 8, dtype=torch.float16))
