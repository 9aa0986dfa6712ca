"""A linear layer's matmul: torch's `F.linear`, or on the CPU one over the weight packed once.

`F.linear` on the CPU hands each call to MKL's GEMM, which repacks the weight into its own blocked layout
every time: at a decode step's shapes (64 rows against SmolLM2's 576 x 3072 gate/up weight) that copy is a
fifth of the GEMM. `linear_packed` keeps each weight packed (`PackedWeight`, made at the layer's first call) and
multiplies by it directly. Results differ from `F.linear` by summation order only.

An fp32 weight is packed into column panels for `cpu_gemm.c` (where the CPU kernels build here: cpu_native.py):
each output one chain of fused multiply-adds in order, so a token's result is the same bits in a batch of any
size, and the weights are streamed near the machine's read rate, which is what a decode step of few rows waits
on (docs/kernels.md). Where the kernels do not build, oneDNN's packed layout and kernels take fp32 too.

oneDNN keeps what it builds for each number of rows it sees (~0.5 MiB a shape) and does not give it back when its
cache evicts one: one weight multiplied by every row count up to 2048 grew a process by 0.9 GiB, and by 7.3 GiB
once the cache had cycled. A server's prefill chunks come in every size, so the rows oneDNN sees are rounded up to
one of 72 sizes below 2048 (`padded_rows`: exact below 16, then eight a power of two), the padding zeros and the
extra rows cut from the result: the same sweep then grows it by 58 MiB, once.

An MLP's gate/up weight (gate's rows, then up's) may be packed gated (`PackedWeight(gate_up=True)`): its rows
interleaved so that each panel holds half a panel of gate's outputs and the same outputs of up, and
`linear_silu_and_mul_packed` runs the matmul with SiLU(gate) * up as its epilogue (cpu_gemm.c), never writing the
[rows, 2 x intermediate] gate/up product out and reading it back; its bits are the matmul's and then
silu_and_mul_cpu's, fused or not.

The packed copy is kept beside the weight (the torch backend, the state dict and tied embeddings read the
weight), so the linear layers' weights take twice their memory on the CPU backend, until the weight is let go
(`PackedWeight.release`: what a served model does with its linear layers' weights once loaded).

A bf16 model's weights are packed for oneDNN's bf16 kernels (bf16 in and out, fp32 sums): AMX tiles or
AVX-512-BF16 where the CPU has them, AVX-512 with conversions where it has neither. A CPU without AVX-512 (AVX2)
has no oneDNN bf16 kernel in torch: there the plain weight stands in for the packed one and the matmul is
`F.linear`'s. `bf16_path` names which of these a process takes.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from .cpu_layer_ops import silu_and_mul_cpu
from .cpu_native import cpu_unavailable_reason, native_library

PACKED_LINEAR_AVAILABLE = torch.backends.mkldnn.is_available()
_linear_pointwise = torch.ops.mkldnn._linear_pointwise if PACKED_LINEAR_AVAILABLE else None
# torch's own test: oneDNN has bf16 kernels on this CPU (AVX-512 or newer)
PACKED_BF16_AVAILABLE = PACKED_LINEAR_AVAILABLE and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
LINEAR_DTYPES = (torch.float32, torch.bfloat16)
BF16_PATHS = ("amx", "avx512_bf16", "avx512-convert", "torch")


def bf16_path() -> str:
    """How this process multiplies bf16 linear layers on the CPU (one of BF16_PATHS): oneDNN on packed weights with
    AMX tiles ("amx"), with AVX-512-BF16 dot products ("avx512_bf16"), or with AVX-512 converting to fp32
    ("avx512-convert"); or torch's `F.linear` on the plain weights ("torch": no oneDNN bf16 kernel here, as on
    an AVX2-only CPU)."""
    if not PACKED_BF16_AVAILABLE:
        return "torch"
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512-convert"


def packs(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` are multiplied through oneDNN's packed layout here (else `F.linear`'s)."""
    return (dtype == torch.float32 and PACKED_LINEAR_AVAILABLE) or (dtype == torch.bfloat16 and PACKED_BF16_AVAILABLE)


def check_linear_dtype(**tensors: torch.Tensor) -> None:
    """The packed matmul's operands: fp32 or bf16 CPU tensors; anything else is a ValueError naming the argument."""
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or tensor.dtype not in LINEAR_DTYPES:
            raise ValueError(f"{name} must be an fp32 or bf16 CPU tensor, got {tensor.dtype} on {tensor.device}")


def padded_rows(rows: int) -> int:
    """The row count oneDNN is given for `rows`: rows below 16 as they are, more rounded up to a multiple of an
    eighth of their power of two (at most 12.5 % extra rows)."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ the packed weight (+ bias) through oneDNN, its rows padded to `padded_rows` with zeros and
    the result cut back to them (its leading rows: contiguous)."""
    assert _linear_pointwise is not None, "oneDNN is not available in this torch"
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded == rows:
        return _linear_pointwise(x, packed, bias, "none", [], "")
    x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    return _linear_pointwise(x, packed, bias, "none", [], "")[:rows]


@functools.cache
def _gemm() -> ctypes.CDLL | None:
    """The library with cpu_gemm.c's fp32 matmul, or None where the CPU kernels do not build here."""
    return native_library() if cpu_unavailable_reason() is None else None


def gated_panels_fit(weight: torch.Tensor) -> bool:
    """Whether a gate/up weight [2 x intermediate, in] packs gated: its halves split into whole half panels."""
    library = _gemm()
    return library is not None and weight.shape[0] % library.gemm_panel_columns() == 0


def pack_panels(weight: torch.Tensor, *, gated: bool = False) -> torch.Tensor:
    """An fp32 weight [out, in] as cpu_gemm.c's column panels [ceil(out / width), in, width], zeros past `out`;
    gated (`gated_panels_fit`), a gate/up weight with each panel's columns half gate's, half up's (the same outputs)."""
    library = _gemm()
    assert library is not None, "the CPU kernels do not build here"
    width = library.gemm_panel_columns()
    outputs, features = weight.shape
    if gated:
        assert gated_panels_fit(weight), f"a gate/up weight of {outputs} rows does not split into panels of {width}"
        weight = weight.reshape(2, outputs // width, width // 2, features).transpose(0, 1).reshape(outputs, features)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    panels = torch.empty(-(-outputs // width), features, width)
    library.gemm_pack_f32(weight.data_ptr(), weight.stride(0), outputs, features, panels.data_ptr(),
                          torch.get_num_threads())
    return panels


def panels_linear(x: torch.Tensor, panels: torch.Tensor, outputs: int, bias: torch.Tensor | None, *,
                  gated: bool = False, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] (fp32, rows any distance apart) @ the weight packed by `pack_panels` (+ bias): [rows, outputs];
    gated (a gate/up weight packed gated, no bias), silu(x @ gate.T) * (x @ up.T): [rows, outputs / 2]. `library`:
    another build of cpu_gemm.c (`cpu_native.library_from`, `bench cpu-gemm --ab-source`), else the kernels' own."""
    library = library or _gemm()
    assert library is not None, "the CPU kernels do not build here"
    assert not (gated and bias is not None), "a gated matmul takes no bias"
    if x.stride(1) != 1 and x.shape[1] > 1:
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    out = torch.empty(x.shape[0], outputs // 2 if gated else outputs)
    if x.shape[0] and gated:
        library.gemm_silu_mul_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], panels.data_ptr(), outputs,
                                  out.data_ptr(), torch.get_num_threads())
    elif x.shape[0]:
        library.gemm_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], panels.data_ptr(), outputs,
                         None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


class PackedWeight:
    """One linear layer's weight packed (fp32: `pack_panels`, where the CPU kernels build; else oneDNN's layout)
    from the weight at its first use, and packed again whenever the weight is replaced or changed in place (its
    version counter), so it is never stale; or, once released, the only copy there is. A bf16 weight where oneDNN
    has no bf16 kernel (`packs`) is kept as it is. `gate_up`: an MLP's gate/up weight, packed gated where it is
    fp32 panels and fits (`gated`)."""

    __slots__ = ("_key", "_packed", "_released", "_source", "gate_up", "gated")

    def __init__(self, *, gate_up: bool = False) -> None:
        self._source: torch.Tensor | None = None  # held, so that its id cannot be reused while it is the key
        self._key: tuple[int, int] = (-1, -1)
        self._packed: torch.Tensor | None = None
        self._released = False
        self.gate_up = gate_up
        self.gated = False  # the copy is gated panels: `matmul` puts its columns back in the weight's order

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        if self._released:  # the weight given is the meta stand-in `release` returned: this copy is all there is
            assert self._packed is not None
            return self._packed
        key = (weight._version, weight.data_ptr())
        if self._packed is None or weight is not self._source or key != self._key:
            check_linear_dtype(weight=weight)
            with torch.no_grad():
                plain = weight.detach()
                self.gated = False
                if plain.dtype == torch.float32 and _gemm() is not None:
                    self.gated = self.gate_up and gated_panels_fit(plain)
                    self._packed = pack_panels(plain, gated=self.gated)
                elif packs(plain.dtype):
                    self._packed = torch.ops.mkldnn._reorder_linear_weight(plain, None)
                else:
                    self._packed = plain
            self._source, self._key = weight, key
        return self._packed

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] @ `weight` (packed at first use; its shape is enough once released) + bias, unchecked."""
        packed = self.of(weight)
        if self.gated:  # cpu_gemm.c's panels, each one's halves put back as gate's columns, then up's
            rows, half = panels_linear(x, packed, weight.shape[0], bias), packed.shape[2] // 2
            return rows.view(x.shape[0], -1, 2, half).transpose(1, 2).reshape(x.shape[0], weight.shape[0])
        if packed.dim() == 3:  # cpu_gemm.c's panels
            return panels_linear(x, packed, weight.shape[0], bias)
        if packs(x.dtype):
            return onednn_linear(x, packed, bias)
        return F.linear(x, packed, bias)

    def silu_and_mul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """silu(x [rows, in] @ gate.T) * (x @ up.T) in one pass where `weight` is packed gated; else None."""
        packed = self.of(weight)
        return panels_linear(x, packed, weight.shape[0], None, gated=True) if self.gated else None

    def release(self, weight: torch.Tensor) -> torch.Tensor:
        """Packs `weight` and keeps only the packed copy from now on; returns a tensor on the meta device of
        the weight's shape and dtype (no memory) to stand in for it, so that nothing reads stale values."""
        self.of(weight)
        self._source, self._released = None, True
        return torch.empty(weight.shape, dtype=weight.dtype, device="meta")


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in].T + bias; `packed` unused. `out` (contiguous, the result's shape), when
    given and there is no bias, receives the result (a buffer reused across steps: no page faults)."""
    if out is not None and bias is None and x.dim() == 2:
        return torch.mm(x, weight.t(), out=out)
    return F.linear(x, weight, bias)


def _check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_linear_dtype(x=x)  # the weight's device: checked where it is packed
    if x.shape[-1] != weight.shape[1]:  # oneDNN's own message would not say which
        raise ValueError(f"x has {x.shape[-1]} features, the weight {tuple(weight.shape)} takes {weight.shape[1]}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype}, the weight {weight.dtype}: the packed matmul takes one dtype")


def linear_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref with `weight` packed once into `packed`: fp32 or bf16 CPU tensors, x of the weight's dtype (bf16
    where oneDNN has no bf16 kernel: `F.linear` on the weight `packed` keeps). The packed matmuls write a tensor of
    their own, so `out` is not used (the allocator reuses the freed one from the step before)."""
    _check_operands(x, weight)
    rows = packed.matmul(x.reshape(-1, x.shape[-1]), weight, bias)
    return rows.view(*x.shape[:-1], weight.shape[0])


def linear_silu_and_mul_packed(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for an MLP's gate/up weight [2 x intermediate, in] (gate's rows first), packed
    once into `packed`: one pass where it packs gated (fp32 panels), else linear_packed and then silu_and_mul_cpu;
    the same bits either way."""
    _check_operands(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    fused = packed.silu_and_mul(rows, weight)
    if fused is None:
        return silu_and_mul_cpu(linear_packed(x, weight, None, packed))
    return fused.view(*x.shape[:-1], weight.shape[0] // 2)
