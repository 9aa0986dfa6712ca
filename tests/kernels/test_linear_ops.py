"""The packed linear (fp32: cpu_gemm.c's panels; bf16: oneDNN) against fp64 matmuls, a row's fp32 result the same
bits in any batch, on any thread count and in every build of cpu_gemm.c with FMA, its packed copy never stale, and
the few row counts it hands oneDNN; the gate/up matmul with SiLU * up fused, against the two ops one after the
other."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import linear_ops
from pagedserve.kernels.cpu_layer_ops import silu_and_mul_cpu
from pagedserve.kernels.linear_ops import (
    PACKED_LINEAR_AVAILABLE,
    PackedWeight,
    linear_packed,
    linear_ref,
    linear_silu_and_mul_packed,
    padded_rows,
)

pytestmark = pytest.mark.skipif(not PACKED_LINEAR_AVAILABLE, reason="this torch build has no oneDNN")


def seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("rows", "features", "outputs"), [(1, 576, 960), (64, 576, 3072), (64, 1536, 576),
                                                           (7, 64, 49152), (513, 96, 40), (0, 64, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_as_close_to_fp64_as_f_linear(rows: int, features: int, outputs: int, bias: bool) -> None:
    x, weight = seeded(rows, features, seed=rows), seeded(outputs, features, seed=features) / features**0.5
    b = seeded(outputs, seed=outputs) if bias else None
    got = linear_packed(x, weight, b, PackedWeight())
    assert got.shape == (rows, outputs) and got.dtype == torch.float32
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    torchs = (linear_ref(x, weight, b, PackedWeight()).double() - expected).abs().max().item() if rows else 0.0
    error = (got.double() - expected).abs().max().item() if rows else 0.0
    assert error <= max(4 * torchs, 1e-5), (error, torchs)  # summation order only


def test_any_leading_shape_and_strided_rows() -> None:
    weight, packed = seeded(40, 24, seed=1), PackedWeight()
    x3 = seeded(2, 5, 24, seed=2)
    assert torch.allclose(linear_packed(x3, weight, None, packed), x3 @ weight.t(), atol=1e-5)
    columns = seeded(24, 6, seed=3).t()  # [6, 24], not contiguous
    assert torch.allclose(linear_packed(columns, weight, None, packed), columns @ weight.t(), atol=1e-5)


def test_rows_are_padded_to_few_sizes_at_little_cost() -> None:
    """oneDNN keeps memory for every row count it sees (kernels/linear_ops.py): below 2048 rows it sees 72 counts,
    exact below 16 and at most an eighth more rows than asked for above, never fewer."""
    sizes = [padded_rows(rows) for rows in range(2049)]
    assert sizes[:16] == list(range(16))
    assert all(rows <= size <= rows * 9 / 8 for rows, size in enumerate(sizes))
    assert sizes == sorted(sizes) and len(set(sizes[1:])) == 72
    assert all(padded_rows(size) == size for size in sizes)  # a padded count is its own


def test_only_padded_row_counts_reach_onednn_and_the_padding_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = linear_ops._linear_pointwise
    assert real is not None

    def recording(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(linear_ops, "_linear_pointwise", recording)
    weight, b = seeded(40, 24, seed=6), seeded(40, seed=7)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)  # fp32 in oneDNN's layout: where cpu_gemm.c is not
    for rows in (1, 15, 17, 33, 100, 129, 300):
        x = seeded(rows, 24, seed=rows)
        got = linear_ops.onednn_linear(x, packed, b)
        assert got.shape == (rows, 40) and got.is_contiguous()
        assert torch.allclose(got, x @ weight.t() + b, atol=1e-5)
    assert seen == [1, 15, 18, 36, 104, 144, 320]


def test_packs_once_and_again_when_the_weight_changes() -> None:
    weight, packed, x = seeded(16, 8, seed=4), PackedWeight(), seeded(3, 8, seed=5)
    first = linear_packed(x, weight, None, packed)
    held = packed.of(weight)
    assert packed.of(weight) is held  # not packed again
    weight.mul_(2)  # in place (a state dict loaded into the model): the version counter moves
    assert packed.of(weight) is not held
    assert torch.allclose(linear_packed(x, weight, None, packed), 2 * first, atol=1e-5)
    replaced = seeded(16, 8, seed=6)  # another tensor: packed from it
    assert torch.allclose(linear_packed(x, replaced, None, packed), x @ replaced.t(), atol=1e-5)


def test_refuses_other_dtypes_and_mismatched_features() -> None:
    weight = seeded(16, 8, seed=7)
    with pytest.raises(ValueError, match="fp32 or bf16 CPU"):
        linear_packed(seeded(3, 8, seed=8).double(), weight, None, PackedWeight())
    with pytest.raises(ValueError, match="one dtype"):
        linear_packed(seeded(3, 8, seed=8).bfloat16(), weight, None, PackedWeight())
    with pytest.raises(ValueError, match="x has 9 features"):
        linear_packed(seeded(3, 9, seed=9), weight, None, PackedWeight())


def test_ref_writes_into_out_when_it_can() -> None:
    x, weight = seeded(4, 8, seed=10), seeded(16, 8, seed=11)
    out = torch.empty(4, 16)
    assert linear_ref(x, weight, None, PackedWeight(), out).data_ptr() == out.data_ptr()
    assert torch.allclose(out, x @ weight.t(), atol=1e-6)


def test_a_released_weight_leaves_only_the_packed_copy() -> None:
    weight, packed, x = seeded(16, 8, seed=12), PackedWeight(), seeded(3, 8, seed=13)
    before = linear_packed(x, weight, None, packed)
    stand_in = packed.release(weight)
    assert stand_in.device.type == "meta" and stand_in.shape == weight.shape and stand_in.dtype == weight.dtype
    assert torch.equal(linear_packed(x, stand_in, None, packed), before)  # the same packed copy, bit for bit
    with pytest.raises(ValueError, match="x has 9 features"):  # the stand-in's shape still checks the input
        linear_packed(seeded(3, 9, seed=14), stand_in, None, packed)


@pytest.mark.parametrize(("rows", "features", "outputs"), [(1, 576, 960), (64, 576, 3072), (64, 1536, 576)])
def test_bf16_as_close_to_fp64_as_f_linear_in_bf16(rows: int, features: int, outputs: int) -> None:
    """bf16 in and out, fp32 sums: within a bf16 rounding of the exact product of the bf16 operands, as F.linear."""
    x = seeded(rows, features, seed=rows).bfloat16()
    weight = (seeded(outputs, features, seed=features) / features**0.5).bfloat16()
    got = linear_packed(x, weight, None, PackedWeight())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    expected = x.double() @ weight.double().t()
    torchs = (torch.nn.functional.linear(x, weight).double() - expected).abs().max().item()
    error = (got.double() - expected).abs().max().item()
    assert error <= max(2 * torchs, 2**-8 * expected.abs().max().item()), (error, torchs)


def test_bf16_without_a_onednn_bf16_kernel_multiplies_the_plain_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    # A mock of the CPU, not of the code: an AVX2-only CPU (no oneDNN bf16 kernel in torch) cannot be had here
    monkeypatch.setattr(linear_ops, "PACKED_BF16_AVAILABLE", False)
    weight, x, packed = seeded(40, 24, seed=14).bfloat16(), seeded(3, 24, seed=15).bfloat16(), PackedWeight()
    assert not linear_ops.packs(torch.bfloat16) and linear_ops.packs(torch.float32)
    assert linear_ops.bf16_path() == "torch"
    got = linear_packed(x, weight, None, packed)
    assert torch.equal(got, torch.nn.functional.linear(x, weight))
    assert packed.of(weight).data_ptr() == weight.data_ptr()  # kept as it is, not copied
    packed.release(weight)
    assert torch.equal(linear_packed(x, torch.empty(40, 24, dtype=torch.bfloat16, device="meta"), None, packed), got)


def test_an_fp32_rows_result_is_the_same_bits_in_any_batch_and_on_any_thread_count() -> None:
    """cpu_gemm.c sums each output in one order whatever the tiling: a token's logits do not depend on its batch."""
    assert linear_ops._gemm() is not None  # `make test` installs a C compiler
    weight, b, packed = seeded(980, 600, seed=16) / 600**0.5, seeded(980, seed=17), PackedWeight()  # an odd panel
    assert packed.of(weight).dim() == 3  # cpu_gemm.c's panels
    x = seeded(130, 600, seed=18)  # from 64 rows, tiles of 6 rows over two panels (AVX-512), below 12 rows over one
    whole = linear_packed(x, weight, b, packed)
    for start, stop in [(0, 1), (5, 6), (3, 16), (10, 23), (0, 13), (40, 64), (1, 64), (0, 64), (3, 70), (60, 130)]:
        assert torch.equal(linear_packed(x[start:stop], weight, b, packed), whole[start:stop])
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(linear_packed(x, weight, b, packed), whole)
    finally:
        torch.set_num_threads(threads)


def _unfused(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_cpu(linear_packed(x, weight, None, PackedWeight()))


@pytest.mark.parametrize(("features", "intermediate"), [(576, 1536), (40, 48)])
def test_the_gated_gate_up_matmul_gives_the_matmul_then_silu_and_mul_bit_for_bit(features: int,
                                                                                 intermediate: int) -> None:
    """SiLU * up as the gate/up GEMM's epilogue: the activations of the matmul followed by silu_and_mul_cpu, bit for
    bit, in any batch (below 12 rows one panel a tile, from 64 rows two: AVX-512) and on any thread count; and the
    plain matmul of the gated copy gives the columns back in the weight's order. (48: three AVX-512 half panels,
    so the last panels go unpaired.)"""
    weight = seeded(2 * intermediate, features, seed=24) / features**0.5
    x, packed = seeded(130, features, seed=25) * 2, PackedWeight(gate_up=True)  # x 2: gates far into SiLU's tails
    whole = linear_silu_and_mul_packed(x, weight, packed)
    assert packed.gated and whole.shape == (130, intermediate)
    assert torch.equal(whole, _unfused(x, weight))
    for start, stop in [(0, 1), (5, 6), (3, 16), (0, 64), (3, 70), (60, 130)]:
        assert torch.equal(linear_silu_and_mul_packed(x[start:stop], weight, packed), whole[start:stop])
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(linear_silu_and_mul_packed(x, weight, packed), whole)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(linear_packed(x, weight, None, packed), linear_packed(x, weight, None, PackedWeight()))
    gate, up = (x.double() @ weight.double().t()).chunk(2, dim=1)
    torch.testing.assert_close(whole.double(), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-4)


def test_a_gate_up_weight_that_does_not_split_into_panels_or_is_bf16_goes_unfused() -> None:
    width = linear_ops._gemm().gemm_panel_columns()  # type: ignore[union-attr]
    weight, x = seeded(2 * (width // 2 + 1), 24, seed=26), seeded(9, 24, seed=27)  # half a panel and one more
    packed = PackedWeight(gate_up=True)
    assert torch.equal(linear_silu_and_mul_packed(x, weight, packed), _unfused(x, weight)) and not packed.gated
    bf16, packed = seeded(2 * width, 24, seed=28).bfloat16(), PackedWeight(gate_up=True)
    got = linear_silu_and_mul_packed(x.bfloat16(), bf16, packed)
    assert torch.equal(got, silu_and_mul_cpu(linear_packed(x.bfloat16(), bf16, None, PackedWeight())))
    assert not packed.gated
    with pytest.raises(ValueError, match=r"x has 20 features, the weight .* takes 24"):
        linear_silu_and_mul_packed(x[:, :20], weight, packed)


def test_without_the_cpu_kernels_fp32_goes_through_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    # A mock of the machine, not of the code: a host without a C compiler cannot be had where the tests run
    monkeypatch.setattr(linear_ops, "_gemm", lambda: None)
    weight, x, packed = seeded(40, 24, seed=19), seeded(3, 24, seed=20), PackedWeight()
    assert packed.of(weight).dim() == 2  # oneDNN's layout
    assert torch.allclose(linear_packed(x, weight, None, packed), x @ weight.t(), atol=1e-5)


def _gemm_build(tmp_path: Path, march: str) -> ctypes.CDLL:
    """cpu_gemm.c alone for another instruction set, without OpenMP (its loops then run on one thread)."""
    source = Path(linear_ops.__file__).with_name("cpu_gemm.c")
    target = tmp_path / f"gemm-{march}.so"
    subprocess.run(["gcc", "-O3", f"-march={march}", "-shared", "-fPIC", "-o", str(target), str(source)], check=True)
    library = ctypes.CDLL(str(target))
    library.gemm_panel_columns.restype = ctypes.c_int64
    return library


def _gemm_with(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    i64, width = ctypes.c_int64, library.gemm_panel_columns()
    (outputs, features), rows = weight.shape, x.shape[0]
    panels, out = torch.empty(-(-outputs // width), features, width), torch.empty(rows, outputs)
    library.gemm_pack_f32(ctypes.c_void_p(weight.data_ptr()), i64(features), i64(outputs), i64(features),
                          ctypes.c_void_p(panels.data_ptr()), i64(1))
    library.gemm_f32(ctypes.c_void_p(x.data_ptr()), i64(features), i64(rows), i64(features),
                     ctypes.c_void_p(panels.data_ptr()), i64(outputs), ctypes.c_void_p(b.data_ptr()),
                     ctypes.c_void_p(out.data_ptr()), i64(1))
    return out


def _gated_with(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gate/up matmul with SiLU * up fused in `library`, its weight interleaved for its panels by hand."""
    i64, width = ctypes.c_int64, library.gemm_panel_columns()
    (outputs, features), rows = weight.shape, x.shape[0]
    interleaved = weight.view(2, outputs // width, width // 2, features).transpose(0, 1).reshape(outputs, features)
    panels, out = torch.empty(outputs // width, features, width), torch.empty(rows, outputs // 2)
    library.gemm_pack_f32(ctypes.c_void_p(interleaved.data_ptr()), i64(features), i64(outputs), i64(features),
                          ctypes.c_void_p(panels.data_ptr()), i64(1))
    library.gemm_silu_mul_f32(ctypes.c_void_p(x.data_ptr()), i64(features), i64(rows), i64(features),
                              ctypes.c_void_p(panels.data_ptr()), i64(outputs), ctypes.c_void_p(out.data_ptr()), i64(1))
    return out


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="x86-64 builds, by gcc")
def test_the_avx2_build_gives_this_builds_bits_and_the_plain_one_is_as_close_to_fp64(tmp_path: Path) -> None:
    """This machine's build (AVX-512 here, or AVX2) against cpu_gemm.c built for AVX2 with FMA (an AMD host's path)
    and for plain x86-64 (no FMA: its C loops): every FMA build sums in the same order, so the bits are equal. 70
    rows: AVX-512 pairs panels there (the second one short at 50 outputs, one left over at 70). The gate/up matmul with
    SiLU * up fused, too (its weight interleaved for each build's panel width)."""
    avx2, plain = _gemm_build(tmp_path, "x86-64-v3"), _gemm_build(tmp_path, "x86-64")
    for outputs in (50, 70):
        weight, b, x = seeded(outputs, 300, seed=21) / 300**0.5, seeded(outputs, seed=22), seeded(70, 300, seed=23)
        here = linear_packed(x, weight, b, PackedWeight())
        assert torch.equal(_gemm_with(avx2, x, weight, b), here)
        expected = torch.nn.functional.linear(x.double(), weight.double(), b.double())
        assert (_gemm_with(plain, x, weight, b).double() - expected).abs().max().item() <= 1e-5
    gate_up, x = seeded(192, 300, seed=24) / 300**0.5, seeded(70, 300, seed=25) * 2  # SiLU * up fused, too
    here = linear_silu_and_mul_packed(x, gate_up, PackedWeight(gate_up=True))
    assert torch.equal(_gated_with(avx2, x, gate_up), here)
