"""Turning logits into tokens: greedy, temperature, top-k, top-p, with reproducible seeded draws.

The random draw for a token depends only on (seed, position): no generator state lives between steps,
so a preempted and recomputed sequence, or one resumed on another executor, draws the same tokens.
The draw is the exponential-race form of categorical sampling: argmax(p / E) with E ~ Exp(1) i.i.d.
picks token i with probability p_i.
"""

from __future__ import annotations

from itertools import repeat

import torch

from ...kernels.backend import FirstMaxAndLogSumFn
from ...kernels.logits_ops import first_max_and_log_sum_ref
from .step_types import SampledToken, SamplingParams, new_row

_GOLDEN = 0x9E3779B97F4A7C15  # decorrelates (seed, position) pairs before they seed a generator


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    params: list[SamplingParams],
    positions: list[int],  # position of each sequence's next token: part of the draw's seed
    seq_ids: list[int],
    *,
    first_max_and_log_sum: FirstMaxAndLogSumFn = first_max_and_log_sum_ref,  # the kernel backend's
) -> list[SampledToken]:
    # The greedy choice, and each row's normalizer: every row's chosen token needs its logprob, and
    # logprob(x) = (x - row_max) - log_sum, so no log_softmax over the whole vocabulary is made.
    chosen, row_max, log_sum = first_max_and_log_sum(logits)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:  # their draws replace the greedy choice
        rows = torch.tensor(sampled_rows)
        probs = _filtered_probs(logits[rows], [params[i] for i in sampled_rows])  # [num_sampled, vocab]
        noise = torch.stack([_exponential(params[i].seed, positions[i], logits.shape[1]) for i in sampled_rows])
        noise = noise.to(logits.device)
        chosen[rows] = (probs / noise).argmax(dim=-1)
    chosen_ids = chosen.tolist()
    chosen_values = ((logits.gather(1, chosen[:, None]).squeeze(1) - row_max) - log_sum).tolist()
    top_rows = [i for i, p in enumerate(params) if p.num_top_logprobs]
    top_ids: dict[int, list[int]] = {}
    top_values: dict[int, list[float]] = {}
    if top_rows:  # only the rows that asked: the largest logits are the largest logprobs
        k = max(params[i].num_top_logprobs for i in top_rows)
        rows = torch.tensor(top_rows, device=logits.device)
        values, ids = logits[rows].topk(k, dim=-1)
        values = (values - row_max[rows, None]) - log_sum[rows, None]
        for i, id_row, value_row in zip(top_rows, ids.tolist(), values.tolist(), strict=True):
            n = params[i].num_top_logprobs
            top_ids[i], top_values[i] = id_row[:n], value_row[:n]
    if not top_rows:  # rows built in C: none asked for alternatives
        return list(map(new_row, repeat(SampledToken), zip(seq_ids, chosen_ids, chosen_values, repeat(()), repeat(()),
                                                           strict=False)))
    return [
        SampledToken(seq_ids[i], chosen_ids[i], chosen_values[i], top_ids.get(i, ()), top_values.get(i, ()))
        for i in range(len(params))
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
