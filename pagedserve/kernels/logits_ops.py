"""Per row of a step's logits: the greedy choice (the first maximum, as `argmax`) and the normalizer of the
row's logprobs, so that logprob(x) = (x - row_max) - log_sum without a `log_softmax` over the vocabulary.

`first_max_and_log_sum_ref` is torch's (every device); `first_max_and_log_sum_cpu` the CPU backend's, one C
pass per row (`cpu_logits.c`): at 64 rows x 49152 it replaces the chunked argmax and a `log_softmax` over
12 MiB of logits (docs/performance.md).
"""

from __future__ import annotations

import torch

from .cpu_native import check_fp32_cpu, native_library


def first_max_and_log_sum_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [num_rows, vocab] -> first index of each row's maximum [num_rows] int64, the maximum, and
    log(sum(exp(x - maximum))) (both [num_rows], the logits' dtype); a NaN in a row is its maximum."""
    first = first_argmax(logits)[:, None]
    # torch's fused log_softmax, read at the maximum: (max - max) - log_sum is -log_sum exactly
    log_sum = torch.log_softmax(logits, dim=-1).gather(1, first).neg_()
    return first.squeeze(1), logits.gather(1, first).squeeze(1), log_sum.squeeze(1)


def first_max_and_log_sum_cpu(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """first_max_and_log_sum_ref in C: fp32 CPU logits, rows any distance apart."""
    check_fp32_cpu(logits=logits)
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [num_rows, vocab > 0] with contiguous rows, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    num_rows = logits.shape[0]
    first = torch.empty(num_rows, dtype=torch.int64)
    row_max, log_sum = torch.empty(num_rows), torch.empty(num_rows)
    native_library().first_max_and_log_sum_f32(logits.data_ptr(), logits.stride(0), num_rows, logits.shape[1],
                                               first.data_ptr(), row_max.data_ptr(), log_sum.data_ptr(),
                                               torch.get_num_threads())
    return first, row_max, log_sum


def first_argmax(logits: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] -> [num_rows] int64
    """argmax() of each row (the first maximum), in two vectorized steps on the CPU: its argmax kernel walks
    a row element by element (2.6 ms for 64 x 49152), amax over chunks does not (0.3 ms with the second)."""
    num_rows, vocab = logits.shape
    chunk = next((c for c in (256, 128, 64) if vocab % c == 0 and vocab >= 8 * c), 0)
    if not chunk or logits.device.type != "cpu" or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    chunks = logits.view(num_rows, vocab // chunk, chunk)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [num_rows]: the first chunk holding the row's maximum
    within = chunks[torch.arange(num_rows, device=logits.device), best_chunk].argmax(dim=-1)
    return best_chunk * chunk + within
