"""What the executor is given and gives back: a step's inputs, the sampled tokens, its Info.

Plain data without torch: the frontend builds steps and reads the results in a container that must
never load torch (only the executor's does). executor.proto carries the same fields between processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

MAX_TOP_LOGPROBS = 20
LAST_SAMPLED = -1  # a decode's input token: the one the executor sampled for this sequence in the previous step


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    num_top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


GREEDY = SamplingParams()


class SampledToken(NamedTuple):
    seq_id: int
    token_id: int
    logprob: float  # of the chosen token under the model's distribution (before temperature and filters)
    top_token_ids: list[int]
    top_logprobs: list[float]


class SequenceInput(NamedTuple):  # a tuple: hundreds are built every step
    seq_id: int
    token_ids: Sequence[int]  # tokens whose KV is computed this step ([LAST_SAMPLED]: not known to the sender)
    start_position: int  # position of token_ids[0]
    block_table: Sequence[int]  # covers positions [0, start_position + len(token_ids))
    slot_mapping: Sequence[int]  # one cache slot per token
    sampling: SamplingParams | None = None  # None: no next token wanted (a non-final prefill chunk)


@dataclass(frozen=True)
class StepInput:
    sequences: Sequence[SequenceInput]
    swap_out: Sequence[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: Sequence[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copies: Sequence[tuple[int, int]] = field(default_factory=list)  # (device src, device dst)
    step_id: int = 0  # overlapped steps: 1, 2, ...; LAST_SAMPLED refers to step_id - 1 (0: unnumbered)


@dataclass(frozen=True)
class ExecutorInfo:
    model: str
    model_digest: str
    dtype: str
    device: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    num_cpu_blocks: int
    eos_token_ids: tuple[int, ...]
    kernel_backend: str
