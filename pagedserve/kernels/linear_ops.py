"""A linear layer's matmul: torch's `F.linear`, or on the CPU oneDNN's with the weight packed once.

`F.linear` on the CPU hands each call to MKL's GEMM, which repacks the weight into its own blocked layout
every time: at a decode step's shapes (64 rows against SmolLM2's 576 x 3072 gate/up weight) that copy is a
fifth of the GEMM. `linear_packed` keeps each weight in oneDNN's blocked layout (`PackedWeight`, made at the
layer's first call) and multiplies by it directly: the layers of a 64-sequence decode step 110 -> 77 ms, the
LM head 43 -> 19 ms (docs/performance.md). Results differ from `F.linear` by summation order only.

The packed copy is kept beside the weight (the torch backend, the state dict and tied embeddings read the
weight), so the linear layers' weights take twice their memory on the CPU backend, until the weight is let go
(`PackedWeight.release`: what a served model does with its linear layers' weights once loaded).

oneDNN keeps what it builds for each number of rows it sees (~0.5 MiB a shape) and does not give it back when its
cache evicts one: one weight multiplied by every row count up to 2048 grew a process by 0.9 GiB, and by 7.3 GiB
once the cache had cycled. A server's prefill chunks come in every size, so the rows oneDNN sees are rounded up to
one of 72 sizes below 2048 (`padded_rows`: exact below 16, then eight a power of two), the padding zeros and the
extra rows cut from the result: the same sweep then grows it by 58 MiB, once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_native import check_fp32_cpu

PACKED_LINEAR_AVAILABLE = torch.backends.mkldnn.is_available()
_linear_pointwise = torch.ops.mkldnn._linear_pointwise if PACKED_LINEAR_AVAILABLE else None


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


class PackedWeight:
    """One linear layer's weight in oneDNN's layout, packed from the weight at its first use, and packed again
    whenever the weight is replaced or changed in place (its version counter), so it is never stale; or, once
    released, the only copy there is."""

    __slots__ = ("_key", "_packed", "_released", "_source")

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None  # held, so that its id cannot be reused while it is the key
        self._key: tuple[int, int] = (-1, -1)
        self._packed: torch.Tensor | None = None
        self._released = False

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        if self._released:  # the weight given is the meta stand-in `release` returned: this copy is all there is
            assert self._packed is not None
            return self._packed
        key = (weight._version, weight.data_ptr())
        if self._packed is None or weight is not self._source or key != self._key:
            check_fp32_cpu(weight=weight)
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self._source, self._key = weight, key
        return self._packed

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


def linear_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """linear_ref through oneDNN with `weight` packed once into `packed`: fp32 CPU tensors. oneDNN writes a
    tensor of its own, so `out` is not used (the allocator reuses the freed one from the step before)."""
    check_fp32_cpu(x=x)  # the weight's dtype and device: checked where it is packed
    if x.shape[-1] != weight.shape[1]:  # oneDNN's own message would not say which
        raise ValueError(f"x has {x.shape[-1]} features, the weight {tuple(weight.shape)} takes {weight.shape[1]}")
    rows = onednn_linear(x.reshape(-1, x.shape[-1]), packed.of(weight), bias)
    return rows.view(*x.shape[:-1], weight.shape[0])
