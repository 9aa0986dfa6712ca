"""A decoder layer's per-token ops in torch: the references, and what the torch and Triton backends run.

In fp32 each is transformers' arithmetic to the bit (tests/executor/test_smollm2.py checks the whole model
against it); the CPU backend's one-pass C versions (cpu_layer_ops.py) are bounded against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    if x.dtype == torch.float32:  # torch's kernel: the same fp32 arithmetic as below
        return F.rms_norm(x, weight.shape, weight, eps)
    # In fp32 whatever the model dtype, cast back before the weight: transformers' LlamaRMSNorm.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]: the residual stream, added to in place
    delta: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    """The residual add and the norm after it: x += delta, then rms_norm_ref(x)."""
    return rms_norm_ref(x.add_(delta), weight, eps)


def rotary_ref(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]: the query and key heads side by side, as the fused QKV has them
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [num_tokens, 1, head_dim // 2]
) -> torch.Tensor:  # [num_tokens, heads, head_dim], contiguous
    """Rotate every head by its token's position ("rotate_half": dimension i pairs with i + head_dim / 2). Q and
    K heads go through together: half the elementwise ops."""
    # Equals transformers' x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), bit for bit: the same products
    # and sums, each half written straight into the output (no cat).
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, heads, head_dim // 2] each
    out = torch.empty(x.shape, dtype=torch.result_type(x, cos), device=x.device)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).sub_(x2 * sin)
    torch.mul(x2, cos, out=out2).add_(x1 * sin)
    return out


def silu_and_mul_ref(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate]: the gate's columns, then up's
) -> torch.Tensor:  # [num_tokens, intermediate]
    """silu(gate) * up, in place in the gate half of `gate_up` (a temporary of the layer): no new tensor."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)
