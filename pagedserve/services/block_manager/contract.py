"""The block manager's contract: what a step asks (ops), what it answers (outcomes, deltas, copies, stats), and the
constants both sides compute with. The frontend and the block manager import it; it imports neither (plain data).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ..common.errors import InvalidRequest

NO_TOKEN = -1  # decode: the new slot is for the token the step in flight samples (overlapped steps)
# Slots a sequence may hold whose tokens it has not been told: those that the two steps in flight sample (the
# frontend plans step N+2 and makes this call while N runs and N+1 waits behind it).
MAX_UNTOLD_SLOTS = 2
MIN_NAMESPACE_BYTES, MAX_NAMESPACE_BYTES = 8, 64
MAX_TOKEN_ID = 2**31 - 1


class InvalidStep(InvalidRequest):
    """A malformed or inconsistent op: nothing in the step was applied."""


class BlockTableDelta(NamedTuple):
    """table_after = table_before[:keep] + append (device block ids)."""

    seq_id: int
    keep: int
    append: tuple[int, ...]


class BlockCopy(NamedTuple):
    src: int
    dst: int
    num_slots: int  # leading token slots that hold data


# ---- ops ---------------------------------------------------------------------------------------------------


class CreateOp(NamedTuple):
    seq_id: int
    token_ids: Sequence[int]
    cache_namespace: bytes


class AdmitOp(NamedTuple):
    seq_id: int
    token_ids: Sequence[int]
    cache_namespace: bytes
    max_tokens: int  # the first chunk: slots reserved after the cached prefix, at most this many


class ForkOp(NamedTuple):
    parent_seq_id: int
    child_seq_id: int


class ReserveOp(NamedTuple):
    seq_id: int
    num_tokens: int
    append_token_ids: Sequence[int] = ()
    admission: bool = False


class CommitOp(NamedTuple):
    seq_id: int
    num_computed_tokens: int


class FreeOp(NamedTuple):
    seq_id: int


class SwapOutOp(NamedTuple):
    seq_ids: Sequence[int]


class SwapInOp(NamedTuple):
    seq_ids: Sequence[int]


class DecodeOp(NamedTuple):
    seq_ids: Sequence[int]
    token_ids: Sequence[int]


class AdvanceOp(NamedTuple):
    """Per sequence: the slots the frontend used in its own tail block without a Decode, and the tokens told
    since (token_ids holds each sequence's num_tokens in turn)."""

    seq_ids: Sequence[int]
    num_slots: Sequence[int]
    num_tokens: Sequence[int]
    token_ids: Sequence[int]


class SpareOp(NamedTuple):
    """One empty block past each sequence's tail, while blocks above the watermark last: per sequence, refused
    (refused_seq_ids) or granted (a delta). No op but an Advance may name its sequences before it in a step."""

    seq_ids: Sequence[int]


Op = CreateOp | AdmitOp | ForkOp | ReserveOp | CommitOp | FreeOp | SwapOutOp | SwapInOp | DecodeOp | AdvanceOp | SpareOp


# ---- answers -----------------------------------------------------------------------------------------------


@dataclass
class OpOutcome:
    granted: bool = True
    reason: str = ""  # why refused
    deltas: list[BlockTableDelta] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write, device -> device
    swap_out: list[BlockCopy] = field(default_factory=list)  # device -> cpu
    swap_in: list[BlockCopy] = field(default_factory=list)  # cpu -> device
    num_cached_tokens: int = 0
    refused_seq_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class BlockStats:
    """A snapshot of the block manager's state and counters, as exported to the scheduler and the operator."""

    block_size: int
    num_total_blocks: int
    num_free_blocks: int  # includes cached ones: they are handed out when needed
    num_used_blocks: int  # referenced by at least one sequence
    num_cached_blocks: int  # free but still holding a reusable prefix
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_sequences: int
    num_swapped_sequences: int
    block_pressure: float  # used / total
    block_pressure_with_cached: float  # (used + cached) / total
    kv_utilization: float  # token slots holding a token / slots in used blocks (as told: lags by < a block per seq)
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens served from the cache
    prefix_hit_rate: float
    num_cow_copies: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_evictions: int
    watermark: float
    # random per block-manager process (a restarted one has another); not part of the state it describes
    instance_id: str = field(default="", compare=False)


class StepAnswer(NamedTuple):
    outcomes: list[OpOutcome]  # one per op, in order
    stats: BlockStats  # after the step
