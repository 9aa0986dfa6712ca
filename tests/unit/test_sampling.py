"""Sampling: greedy, temperature, top-k, top-p and seeded draws, checked against exact distributions."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagedserve.kernels import get_backend
from pagedserve.services.executor.sampling import sample
from pagedserve.services.executor.step_types import SamplingParams

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
PROBS = torch.softmax(LOGITS[0], dim=0)


def draw(params: SamplingParams, n: int) -> Counter[int]:
    """n draws, one per position (the seed's stream), as a sequence would make them."""
    return Counter(sample(LOGITS, [params], [pos], [0])[0].token_id for pos in range(n))


def test_greedy_and_logprobs() -> None:
    (token,) = sample(LOGITS, [SamplingParams(num_top_logprobs=3)], [0], [7])
    assert token.seq_id == 7 and token.token_id == 0
    assert token.logprob == pytest.approx(math.log(PROBS[0]))
    assert token.top_token_ids == [0, 1, 2]
    assert token.top_logprobs == pytest.approx(torch.log(PROBS[:3]).tolist())


def test_same_seed_and_position_same_token_other_seed_other_stream() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    first = [sample(LOGITS, [params], [p], [0])[0].token_id for p in range(50)]
    again = [sample(LOGITS, [params], [p], [0])[0].token_id for p in range(50)]
    other = [sample(LOGITS, [SamplingParams(temperature=1.0, seed=43)], [p], [0])[0].token_id for p in range(50)]
    assert first == again and first != other


def test_temperature_one_matches_the_softmax() -> None:
    n = 4000
    counts = draw(SamplingParams(temperature=1.0, seed=1), n)
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_temperature_sharpens_and_flattens() -> None:
    cold = draw(SamplingParams(temperature=0.25, seed=2), 1000)
    hot = draw(SamplingParams(temperature=4.0, seed=2), 1000)
    assert cold[0] > 900 and hot[0] < 400 and len(hot) == 6


def test_top_k_keeps_only_the_k_most_likely() -> None:
    counts = draw(SamplingParams(temperature=1.0, top_k=2, seed=3), 2000)
    assert set(counts) == {0, 1}
    expected = (PROBS[0] / (PROBS[0] + PROBS[1])).item()
    assert abs(counts[0] / 2000 - expected) < 0.04


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probabilities ~ [.56, .21, .12, .08, .03, .004]: top_p 0.7 needs the first two (0.56 < 0.7 <= 0.77)
    counts = draw(SamplingParams(temperature=1.0, top_p=0.7, seed=4), 2000)
    assert set(counts) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.5, seed=4), 300)) == {0}


def test_batch_rows_are_independent() -> None:
    logits = torch.cat([LOGITS, LOGITS.flip(1)])
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=9)]
    batched = sample(logits, params, [5, 5], [1, 2])
    alone = sample(LOGITS.flip(1), [params[1]], [5], [2])
    assert batched[0].token_id == 0 and batched[1].token_id == alone[0].token_id


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_first_maximum_of_large_rows_with_ties(backend: str) -> None:
    """The chunked argmax of large vocabularies picks argmax()'s token: the first maximum, ties across and
    within chunks included."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 4096, generator=gen)
    logits[1, [100, 3000]] = 10.0  # a tie in two chunks
    logits[2, [513, 514]] = 10.0  # a tie within one chunk
    logits[3] = 0.0  # all equal
    logits[4, 4095] = 10.0  # the very last token
    logits[5, 7] = float("nan")  # argmax() treats NaN as the maximum
    tokens = sample(logits, [SamplingParams()] * 6, [0] * 6, list(range(6)),
                    first_max_and_log_sum=get_backend(backend).first_max_and_log_sum)
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist() == [tokens[0].token_id, 100, 513, 0, 4095, 7]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_logprobs_as_log_softmax_gives_them_and_top_logprobs_only_where_asked(backend: str) -> None:
    normalizer = get_backend(backend).first_max_and_log_sum
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 2048, generator=gen) * 4
    params = [SamplingParams(), SamplingParams(num_top_logprobs=5), SamplingParams(temperature=0.7, seed=1)]
    expected = torch.log_softmax(logits.double(), dim=-1)
    before = logits.clone()
    tokens = sample(logits, params, [3, 3, 3], [0, 1, 2], first_max_and_log_sum=normalizer)
    assert torch.equal(logits, before)  # read, never written
    assert tokens[0].token_id == logits[0].argmax().item()
    for row, token in enumerate(tokens):
        assert token.logprob == pytest.approx(expected[row, token.token_id].item(), rel=1e-6, abs=1e-5)  # fp32
    assert tokens[0].top_token_ids == () and tokens[2].top_logprobs == ()  # none asked for: the empty tuple
    values, ids = expected[1].topk(5)
    assert tokens[1].top_token_ids == ids.tolist()
    assert tokens[1].top_logprobs == pytest.approx(values.tolist(), rel=1e-6, abs=1e-5)
