"""What the executor is given and gives back: a step's inputs, the sampled tokens, its Info.

Plain data without torch: the frontend builds steps and reads the results in a container that must
never load torch (only the executor's does). executor.proto carries the same fields between processes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import NamedTuple

from ..common.errors import InvalidRequest

MAX_TOP_LOGPROBS = 20
LAST_SAMPLED = -1  # a decode's input token: the one the executor sampled for this sequence in the previous step
# tuple.__new__(SomeNamedTuple, values) is that NamedTuple, built without the class's own __new__ (a Python
# function): 2-3x faster for the rows built per sequence every step (256 tokens: 75 -> 30 µs).
new_row = tuple.__new__


class SamplingParams(NamedTuple):  # a tuple: the executor builds one per sampled sequence every step
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
    top_token_ids: Sequence[int]  # () when none were asked for: no list per token
    top_logprobs: Sequence[float]


class SequenceInput(NamedTuple):  # a tuple: hundreds are built every step
    seq_id: int
    token_ids: Sequence[int]  # tokens whose KV is computed this step ([LAST_SAMPLED]: not known to the sender)
    start_position: int  # position of token_ids[0]
    block_table: Sequence[int]  # covers positions [0, start_position + len(token_ids)); see held_inputs.py
    slot_mapping: Sequence[int]  # one cache slot per token
    sampling: SamplingParams | None = None  # None: no next token wanted (a non-final prefill chunk)


@dataclass(frozen=True)
class StepInput:
    sequences: Sequence[SequenceInput]
    swap_out: Sequence[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: Sequence[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copies: Sequence[tuple[int, int]] = field(default_factory=list)  # (device src, device dst)
    step_id: int = 0  # overlapped steps: 1, 2, ...; LAST_SAMPLED refers to step_id - 1 (0: unnumbered)
    # sequences the block manager freed since the last step: a layout that keeps KV per sequence (virtual)
    # releases their memory before this step runs; the paged layout ignores them (its blocks say it all)
    released_seq_ids: Sequence[int] = ()
    # the sequences are the held batch again (`HeldInputs.repeated_batch`), so the runner checks only what a step
    # adds to one it already ran (StepChecks.validate). From the scheduler (SchedulerConfig.repeat_batches): the
    # last step's sequences again, not named (`sequences` empty); the executor's side fills them in
    same_batch: bool = False


class LastSampled:
    """The tokens the last step sampled, per sequence: the next numbered step's inputs where it says
    LAST_SAMPLED (overlapped steps). Kept by whatever runs steps: the model runner, the benchmark's stand-in."""

    def __init__(self) -> None:
        self.step_id = 0  # of the last step run
        self.tokens: dict[int, int] = {}

    def clear(self) -> None:
        """Forgets every step (the frontend starts over: no step may ask for what an earlier one sampled)."""
        self.step_id, self.tokens = 0, {}

    def check(self, step_id: int, seq_id: int, token_ids: Sequence[int], where: str) -> None:
        """Raises InvalidRequest unless step `step_id` may ask for sequence `seq_id`'s last sampled token."""
        if len(token_ids) != 1:
            raise InvalidRequest(f"{where}: LAST_SAMPLED ({LAST_SAMPLED}) stands alone, as a decode's one token")
        if step_id == 0 or step_id != self.step_id + 1:
            raise InvalidRequest(f"{where}: step {step_id} asks for the tokens step {step_id - 1} sampled, but the"
                                 f" last step run was {self.step_id}")
        if seq_id not in self.tokens:
            raise InvalidRequest(f"{where}: step {self.step_id} sampled no token for sequence {seq_id}")

    def allows(self, step_id: int, seq_ids: Sequence[int], token_lists: Sequence[Sequence[int]]) -> bool:
        """What `check` tests of every sequence whose tokens hold LAST_SAMPLED, over the step's columns (C loops):
        True only when none of them would raise."""
        asks = list(map(operator.contains, token_lists, repeat(LAST_SAMPLED)))
        if not any(asks):
            return True
        return (step_id != 0 and step_id == self.step_id + 1
                and all(map(operator.eq, compress(token_lists, asks), repeat([LAST_SAMPLED])))
                and all(map(self.tokens.__contains__, compress(seq_ids, asks))))

    def start(self, step_id: int) -> dict[int, int]:
        """Step `step_id` begins: returns the tokens it may use; it has sampled none until `record`."""
        tokens, self.tokens, self.step_id = self.tokens, {}, step_id
        return tokens

    def record(self, sampled: Iterable[SampledToken]) -> None:
        self.tokens = {t.seq_id: t.token_id for t in sampled}


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
    epoch: int = 0  # of the frontend's last Reset (a remote executor's)
    kv_layout: str = "paged"  # "paged", "virtual" or "static" (options.KV_LAYOUTS); only paged shares KV
    kv_cache_dtype: str = ""  # the KV cache's dtype where it is not `dtype` (bfloat16 under fp32 weights)

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype: what its blocks hold, so part of the prefix cache's namespace."""
        return self.kv_cache_dtype or self.dtype
