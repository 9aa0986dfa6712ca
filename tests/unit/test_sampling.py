"""Sampling: greedy, temperature, top-k, top-p and seeded draws, checked against exact distributions."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

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


def test_first_maximum_of_large_rows_with_ties() -> None:
    """The chunked argmax of large vocabularies picks argmax()'s token: the first maximum, ties across and
    within chunks included."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 4096, generator=gen)
    logits[1, [100, 3000]] = 10.0  # a tie in two chunks
    logits[2, [513, 514]] = 10.0  # a tie within one chunk
    logits[3] = 0.0  # all equal
    logits[4, 4095] = 10.0  # the very last token
    logits[5, 7] = float("nan")  # argmax() treats NaN as the maximum
    tokens = sample(logits, [SamplingParams()] * 6, [0] * 6, list(range(6)))
    assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist() == [tokens[0].token_id, 100, 513, 0, 4095, 7]


def test_logprobs_in_place_equal_and_top_logprobs_only_where_asked() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 2048, generator=gen) * 4
    params = [SamplingParams(), SamplingParams(num_top_logprobs=5), SamplingParams(temperature=0.7, seed=1)]
    expected = torch.log_softmax(logits, dim=-1)
    copy = logits.clone()
    out_of_place = sample(logits, params, [3, 3, 3], [0, 1, 2])
    in_place = sample(copy, params, [3, 3, 3], [0, 1, 2], in_place=True)
    assert in_place == out_of_place
    assert torch.equal(copy, expected)  # the caller's scratch now holds the log-probabilities
    for row, token in enumerate(out_of_place):
        assert token.logprob == expected[row, token.token_id].item()
    assert out_of_place[0].top_token_ids == [] and out_of_place[2].top_logprobs == []
    values, ids = expected[1].topk(5)
    assert out_of_place[1].top_token_ids == ids.tolist() and out_of_place[1].top_logprobs == values.tolist()
