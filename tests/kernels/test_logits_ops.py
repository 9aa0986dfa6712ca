"""The logits' greedy choice and logprob normalizer in C against torch's argmax and fp64 log_softmax."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_unavailable_reason
from pagedserve.kernels.logits_ops import first_max_and_log_sum_cpu, first_max_and_log_sum_ref

pytestmark = pytest.mark.skipif(cpu_unavailable_reason() is not None, reason=f"{cpu_unavailable_reason()}")


def logprobs(normalizer: tuple[torch.Tensor, torch.Tensor, torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    _, row_max, log_sum = normalizer
    return (logits - row_max[:, None]) - log_sum[:, None]


@pytest.mark.parametrize(("rows", "vocab"), [(1, 6), (64, 49152), (5, 1000), (3, 257), (130, 300)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_argmax_and_fp64_log_softmax(rows: int, vocab: int, threads: int) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 6
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = first_max_and_log_sum_cpu(logits)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got[0], logits.argmax(dim=-1))
    assert torch.equal(got[1], logits.amax(dim=-1))
    # no further from fp64 than torch's own fp32 log_softmax (the fp32 rounding of x - max is most of both),
    # and the same of the torch reference, which reads that log_softmax
    expected = torch.log_softmax(logits.double(), dim=-1)
    torchs = (torch.log_softmax(logits, dim=-1).double() - expected).abs().max().item()
    reference = first_max_and_log_sum_ref(logits)
    for op in (got, reference):
        error = (logprobs(op, logits).double() - expected).abs().max().item()
        assert error <= max(1.5 * torchs, 1e-6), (error, torchs)
    assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])


def test_ties_infinities_and_nan_as_torch() -> None:
    logits = torch.randn(7, 1000, generator=torch.Generator().manual_seed(3))
    logits[0, [900, 300]] = 9.0  # a tie across chunks: the first
    logits[1, [513, 514]] = 9.0  # within one chunk
    logits[2] = 0.0  # all equal: uniform
    logits[3, :500] = float("-inf")  # half the vocabulary masked out
    logits[4] = float("-inf")  # all masked: argmax 0, logprobs NaN as log_softmax's
    logits[5, [10, 700]] = float("nan")  # the first NaN is the maximum, and the row is NaN
    logits[6, 999] = 50.0  # the last token
    first, row_max, log_sum = first_max_and_log_sum_cpu(logits)
    assert first.tolist() == logits.argmax(dim=-1).tolist() == [300, 513, 0, first[3].item(), 0, 10, 999]
    expected = torch.log_softmax(logits.double(), dim=-1).float()
    got = logprobs((first, row_max, log_sum), logits)
    assert torch.allclose(got[[0, 1, 2, 3, 6]], expected[[0, 1, 2, 3, 6]], rtol=1e-6, atol=1e-5, equal_nan=True)
    assert got[2, 0].item() == pytest.approx(-6.907755, abs=1e-6)  # log(1 / 1000)
    assert torch.isneginf(got[3, :500]).all()
    assert expected[4].isnan().all() and got[4].isnan().all() and got[5].isnan().all() and expected[5].isnan().all()


def test_rows_any_distance_apart() -> None:
    wide = torch.randn(4, 3000, generator=torch.Generator().manual_seed(4))
    logits = wide[:, 100:2100]  # rows 3000 floats apart
    got = first_max_and_log_sum_cpu(logits)
    want = first_max_and_log_sum_cpu(logits.contiguous())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="fp32 CPU"):
        first_max_and_log_sum_cpu(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_rows, vocab"):
        first_max_and_log_sum_cpu(torch.zeros(8))
    with pytest.raises(ValueError, match="num_rows, vocab"):
        first_max_and_log_sum_cpu(torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match="num_rows, vocab"):
        first_max_and_log_sum_cpu(torch.zeros(2, 0))
