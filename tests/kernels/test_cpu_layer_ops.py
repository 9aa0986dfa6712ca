"""The CPU backend's per-token layer ops in C (kernels/cpu_layer_ops.py) against their torch references:
RMSNorm, the rotary embedding and SiLU * up within a few ulp, the cache write bit for bit; bad inputs refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedserve.kernels import cpu_unavailable_reason
from pagedserve.kernels.cache_write import cache_write_ref
from pagedserve.kernels.cpu_layer_ops import (
    add_rms_norm_cpu,
    cache_write_cpu,
    rms_norm_cpu,
    rotary_cpu,
    silu_and_mul_cpu,
)
from pagedserve.kernels.layer_ops import add_rms_norm_ref, rms_norm_ref, rotary_ref, silu_and_mul_ref

pytestmark = pytest.mark.skipif(cpu_unavailable_reason() is not None, reason=f"{cpu_unavailable_reason()}")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"{n}threads")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def assert_close_ulps(ours: torch.Tensor, ref: torch.Tensor, rel: float = 4e-7) -> None:
    """Within a few float32 ulp of the reference, scaled by the row's magnitude (a sum's order shifts its
    last bits by the row's size, not the element's)."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    if ref.numel() == 0:
        return
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    err = ((ours - ref).abs() / scale).max().item()
    assert err <= rel, f"max error {err:.2e} of the row's magnitude"


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64, 100])
@pytest.mark.parametrize("hidden", [16, 576, 1000])
def test_rms_norm_matches_torch(num_tokens: int, hidden: int, threads: int) -> None:
    x = torch.randn(num_tokens, hidden) * 3e3  # the residual stream of SmolLM2 reaches ~2e4
    weight = torch.randn(hidden)
    assert_close_ulps(rms_norm_cpu(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))


def test_rms_norm_of_a_strided_view_and_the_same_bits_at_any_thread_count() -> None:
    wide = torch.randn(64, 700)
    x, weight = wide[:, 50:626], torch.randn(576)  # rows 700 floats apart
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(rms_norm_cpu(x, weight, 1e-6))
    finally:
        torch.set_num_threads(before)
    assert_close_ulps(outs[0], rms_norm_ref(x.contiguous(), weight, 1e-6))
    assert all(torch.equal(outs[0], other) for other in outs[1:])
    columns = torch.randn(576, 64).t()  # elements of a row not adjacent: copied first
    assert_close_ulps(rms_norm_cpu(columns, weight, 1e-6), rms_norm_ref(columns.contiguous(), weight, 1e-6))


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64, 100])
@pytest.mark.parametrize("hidden", [16, 576, 1000])
def test_add_rms_norm_is_the_add_then_the_norm(num_tokens: int, hidden: int, threads: int) -> None:
    x, delta, weight = torch.randn(num_tokens, hidden) * 3e3, torch.randn(num_tokens, hidden) * 50, torch.randn(hidden)
    added, ref_x = x + delta, x.clone()
    ours = add_rms_norm_cpu(x, delta, weight, 1e-5)
    assert torch.equal(x, added)  # the residual stream, added to in place, as torch adds
    assert torch.equal(ours, rms_norm_cpu(added, weight, 1e-5))  # the same sum in the same order: bit for bit
    assert_close_ulps(ours, add_rms_norm_ref(ref_x, delta, weight, 1e-5))
    assert torch.equal(ref_x, added)


def test_add_rms_norm_of_a_strided_delta_and_its_refusals() -> None:
    x, wide, weight = torch.randn(64, 576), torch.randn(64, 700), torch.randn(576)
    delta = wide[:, 50:626]  # rows 700 floats apart, as a slice of a wider output would be
    expected_x = x + delta
    assert torch.equal(add_rms_norm_cpu(x, delta, weight, 1e-6), rms_norm_cpu(expected_x, weight, 1e-6))
    assert torch.equal(x, expected_x)
    with pytest.raises(ValueError, match="contiguous"):  # written in place: a view's gaps would be skipped
        add_rms_norm_cpu(wide[:, :576], x, weight, 1e-6)
    with pytest.raises(ValueError, match="the same shape"):
        add_rms_norm_cpu(x, x[:, :575], weight, 1e-6)
    with pytest.raises(ValueError, match="fp32 or bf16 CPU"):
        add_rms_norm_cpu(x, x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="the others' dtype"):  # bf16 and fp32 mixed
        add_rms_norm_cpu(x, x.bfloat16(), weight, 1e-6)


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 64])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_matches_torch(num_tokens: int, head_dim: int, threads: int) -> None:
    heads = 12
    qkv = torch.randn(num_tokens, (heads + 3) * head_dim)  # q and k heads, then v: as the fused QKV output
    x = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    angles = torch.rand(num_tokens, 1, head_dim // 2) * 100
    rope = (angles.cos(), angles.sin())
    ours = rotary_cpu(x, rope)
    assert ours.is_contiguous()
    assert_close_ulps(ours, rotary_ref(x, rope), rel=3e-7)


@pytest.mark.parametrize("num_tokens", [0, 1, 64])
@pytest.mark.parametrize("intermediate", [8, 1536, 1000])
def test_silu_and_mul_matches_torch(num_tokens: int, intermediate: int, threads: int) -> None:
    gate_up = torch.randn(num_tokens, 2 * intermediate) * 8
    ref = silu_and_mul_ref(gate_up.clone())  # in place in its input
    before = gate_up.clone()
    ours = silu_and_mul_cpu(gate_up)
    assert torch.equal(gate_up, before), "the C version leaves its input as it was"
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-30)


def test_silu_at_the_extremes() -> None:
    gate = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 200.0, -200.0, 1e30, -1e30, float("nan")]])
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)], dim=1)
    ours = silu_and_mul_cpu(gate_up)
    ref = silu_and_mul_ref(gate_up.clone())
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-30, equal_nan=True)
    assert ours[0, -1].isnan()


def _caches(num_blocks: int = 6, block_size: int = 4, heads: int = 3, head_dim: int = 8
            ) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, heads, head_dim)
    return torch.randn(shape), torch.randn(shape)


def test_cache_write_equals_the_reference_bit_for_bit() -> None:
    qkv = torch.randn(5, 9 * 8)  # key and value as views of the QKV output: rows 72 floats apart
    key, value = qkv[:, 24:48].view(5, 3, 8), qkv[:, 48:].view(5, 3, 8)
    slots = torch.tensor([3, -1, 17, 0, 23])  # -1: padding, skipped
    ours, ref = _caches(), _caches()
    ref = (ours[0].clone(), ours[1].clone())
    cache_write_cpu(key, value, *ours, slots)
    cache_write_ref(key, value, *ref, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert torch.equal(ours[0].view(-1, 3, 8)[17], key[2])


def test_cache_write_into_a_bf16_cache_rounds_as_torch_does() -> None:
    # ties to even both ways, the largest values that round to bf16's maximum and to infinity, infinities,
    # NaN (any NaN is NaN after), denormals and signed zeros; then ordinary keys
    specials = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3961e38, 3.3962e38, float("inf"),
                             float("-inf"), float("nan"), 1e-40, -0.0, 0.0, 2**-133], dtype=torch.float32)
    key = torch.randn(6, 3, 8) * 50
    key.view(-1)[: specials.numel()] = specials
    value = torch.randn(6, 3, 8)
    slots = torch.tensor([3, -1, 17, 0, 23, 8])
    ours = tuple(cache.bfloat16() for cache in _caches())
    ref = (ours[0].clone(), ours[1].clone())
    cache_write_cpu(key, value, *ours, slots)
    cache_write_ref(key, value, *ref, slots)
    nan = ours[0].isnan()
    assert torch.equal(nan, ref[0].isnan()) and bool(nan.any())  # the NaN stays NaN
    assert torch.equal(ours[0].masked_fill(nan, 0), ref[0].masked_fill(nan, 0)) and torch.equal(ours[1], ref[1])
    assert torch.equal(ours[0].view(-1, 3, 8)[17].float(), key[2].bfloat16().float())
    assert ours[0].view(-1)[3 * 24 : 3 * 24 + 5].tolist() == [1.0, 1 + 2**-6, -1.0, 3.3895313892515355e38,
                                                               float("inf")]


def test_cache_write_past_the_cache_writes_nothing() -> None:
    k_cache, v_cache = _caches()
    before = (k_cache.clone(), v_cache.clone())
    key = value = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="past the cache"):
        cache_write_cpu(key, value, k_cache, v_cache, torch.tensor([0, 24]))  # 6 blocks of 4: slots 0..23
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="fp32 or bf16 CPU"):
        rms_norm_cpu(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"weight \[hidden\]"):
        rms_norm_cpu(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="cos and sin"):
        rotary_cpu(torch.randn(2, 3, 8), (torch.ones(2, 1, 8), torch.ones(2, 1, 8)))
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul_cpu(torch.randn(2, 7))
    with pytest.raises(ValueError, match="fp32 or bf16 CPU"):
        silu_and_mul_cpu(torch.randn(2, 8, dtype=torch.float16))
