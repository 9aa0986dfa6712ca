"""Turning logits into tokens: greedy, temperature, top-k, top-p, with reproducible seeded draws.

The random draw for a token depends only on (seed, position): no generator state lives between steps,
so a preempted and recomputed sequence, or one resumed on another executor, draws the same tokens.
The draw is the exponential-race form of categorical sampling: argmax(p / E) with E ~ Exp(1) i.i.d.
picks token i with probability p_i.
"""

from __future__ import annotations

import torch

from .step_types import SampledToken, SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # decorrelates (seed, position) pairs before they seed a generator


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    params: list[SamplingParams],
    positions: list[int],  # position of each sequence's next token: part of the draw's seed
    seq_ids: list[int],
) -> list[SampledToken]:
    logprobs = torch.log_softmax(logits, dim=-1)  # [num_seqs, vocab]
    # the greedy choice (replaced below for sampled rows); max() finds the first maximum like argmax(), faster
    chosen = logits.max(dim=-1).indices  # [num_seqs]
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows)
        probs = _filtered_probs(logits[rows], [params[i] for i in sampled_rows])  # [num_sampled, vocab]
        noise = torch.stack([_exponential(params[i].seed, positions[i], logits.shape[1]) for i in sampled_rows])
        noise = noise.to(logits.device)
        chosen[rows] = (probs / noise).argmax(dim=-1)
    chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1)
    k = max((p.num_top_logprobs for p in params), default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, None][:, :0])
    chosen_ids, chosen_values = chosen.tolist(), chosen_logprobs.tolist()
    top_id_rows, top_value_rows = top_ids.tolist(), top_values.tolist()
    return [
        SampledToken(seq_ids[i], chosen_ids[i], chosen_values[i], top_id_rows[i][:n], top_value_rows[i][:n])
        for i, n in enumerate(p.num_top_logprobs for p in params)
    ]


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the top-k and the top-p nucleus of each row."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[1], device=logits.device)[None, :]
    top_k = torch.tensor([p.top_k or scaled.shape[1] for p in params], device=logits.device)
    drop = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params], device=logits.device)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # keep a token while the mass above it < top_p
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def _exponential(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed * _GOLDEN + position) % (2**63))
    return torch.empty(vocab_size).exponential_(generator=generator)
