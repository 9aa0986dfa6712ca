"""What the scheduler tracks: requests, the sequences (samples) they fan out into, and their outputs."""

from __future__ import annotations

import collections.abc
import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ..common.errors import InvalidRequest
from ..executor.step_types import MAX_TOP_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class GenerationParams:
    """What a caller asks for. Validated once, at the edge (`validate`)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: the engine picks one (and reports it)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int = 0  # top logprobs per generated token (the chosen token's logprob is always returned)

    def validate(self, max_n: int = 16) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0: off)"),
            (1 <= self.n <= max_n, "n", f"must be in [1, {max_n}]"),
            (0 <= self.logprobs <= MAX_TOP_LOGPROBS, "logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise InvalidRequest(f"{name}: {message}, got {getattr(self, name)!r}")

    def sampling_for(self, seed: int) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, seed, self.logprobs)


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled, deadline passed, or failed


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not in the block manager (new, or preempted by recompute)
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestMetrics:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


# Slots, not a __dict__, for the objects every step touches once per sequence: fewer cache lines to pull back
# in after the sidecars' threads and processes ran.
@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: GenerationParams
    cache_namespace: bytes
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    seqs: list[Sequence] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    num_unforked: int = -1  # samples not forked yet from the first sequence
    num_finished: int = 0  # samples (of `seqs`) finished: the scheduler counts them as it finishes them
    # its caller reads the outputs from the request once it has finished (a unary call, offline generation):
    # the engine builds no StepOutput for it before then
    final_only: bool = False
    stop_ids: frozenset[int] = field(init=False)  # tokens that end a sample (stop tokens, EOS unless ignored)
    max_len: int = field(init=False)  # prompt + max_tokens: where a sample ends at the latest

    def __post_init__(self) -> None:
        if self.num_unforked < 0:
            self.num_unforked = self.params.n - 1
        # looked up for every sampled token: computed once
        self.stop_ids = frozenset(self.params.stop_token_ids) | (frozenset() if self.params.ignore_eos
                                                                  else self.eos_token_ids)
        self.max_len = len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:  # asked of every request with a token, every step: a count, not a pass over seqs
        return self.num_unforked == 0 and self.num_finished == len(self.seqs)


@dataclass(eq=False, slots=True)
class Sequence:
    """One sample of a request. Its tokens are prompt + generated; the KV of the first num_computed is stored.

    Five fields mirror the block manager's record of the sequence (the block manager's `SequenceState`),
    written by the KV client (kv_client.py, ledger.py), and `num_local_slots` also by the loops that place a
    decode here (step_rows.py, fast_paths.py). The frontend keeps each because a step must not wait on a
    round trip to learn it: `block_table` goes into the executor's rows and gives the slot of a decode the
    frontend places itself; `tail_private` says whether that decode may write without a copy (its tail is not
    shared since a fork); `num_known_to_manager`, `num_committed` and `num_local_slots` are what the block
    manager has been told (tokens, computed tokens, slots placed here), from which the Advance that brings it
    level is built without asking (ledger.py). They are plain fields, not a nested object: the per-step loops
    read them for every sequence."""

    seq_id: int
    request: Request
    index: int  # which of the request's n samples
    token_ids: list[int]
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV the executor stored, or will store in a step already sent
    num_known_to_manager: int = 0  # tokens the block manager has been told about
    num_committed: int = 0  # tokens the block manager has been told are computed
    block_table: list[int] = field(default_factory=list)
    num_local_slots: int = 0  # decodes placed in its own blocks, not yet told to the block manager (an Advance)
    tail_private: bool = False  # its tail block is its own (not shared since a fork): a decode may write it
    num_pending: int = 0  # tokens being sampled by steps already sent (overlapped steps), not known yet
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[collections.abc.Sequence[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # each sample draws with its own seed, so the n samples differ and each is reproducible
    sampling: SamplingParams = field(init=False)

    def __post_init__(self) -> None:
        self.sampling = self.request.params.sampling_for(self.request.seed + self.index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(slots=True)  # not frozen: a frozen dataclass is three times slower to build, and one is built per token
class SequenceOutput:
    seq_id: int
    index: int
    new_token_ids: collections.abc.Sequence[int]
    finish_reason: FinishReason | None
    new_logprobs: collections.abc.Sequence[float] = ()  # of each new token
    # (token id, logprob) alternatives per new token
    new_top_logprobs: collections.abc.Sequence[collections.abc.Sequence[tuple[int, float]]] = ()


class StepOutput(NamedTuple):  # one per request with a token, every step
    """What one engine step produced for one request."""

    request: Request
    outputs: list[SequenceOutput]
