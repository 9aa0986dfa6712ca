"""A linear layer's matmul: torch's `F.linear`, or on the CPU oneDNN's with the weight packed once.

`F.linear` on the CPU hands each call to MKL's GEMM, which repacks the weight into its own blocked layout
every time: at a decode step's shapes (64 rows against SmolLM2's 576 x 3072 gate/up weight) that copy is a
fifth of the GEMM. `linear_packed` keeps each weight in oneDNN's blocked layout (`PackedWeight`, made at the
layer's first call) and multiplies by it directly: the layers of a 64-sequence decode step 110 -> 77 ms, the
LM head 43 -> 19 ms (docs/performance.md). Results differ from `F.linear` by summation order only.

The packed copy is kept beside the weight (the torch backend, the state dict and tied embeddings read the
weight), so the linear layers' weights take twice their memory on the CPU backend, until the weight is let go
(`PackedWeight.release`: what a served model does with its linear layers' weights once loaded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_native import check_fp32_cpu

PACKED_LINEAR_AVAILABLE = torch.backends.mkldnn.is_available()


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
    return torch.ops.mkldnn._linear_pointwise(x, packed.of(weight), bias, "none", [], "")
