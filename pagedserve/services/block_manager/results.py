"""What the block manager's acts return in process (step.py turns them into the contract's `OpOutcome`): a refused
result changed nothing."""

from __future__ import annotations

from typing import NamedTuple

from .contract import BlockCopy, BlockTableDelta


class CreateResult(NamedTuple):
    num_cached_tokens: int
    delta: BlockTableDelta


class Admission(NamedTuple):
    granted: bool
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_tokens: int  # tokens reserved after them
    slot_mapping: list[int]
    delta: BlockTableDelta | None  # the whole new table (keep 0)


class Reservation(NamedTuple):
    granted: bool
    slot_mapping: list[int]  # [num_tokens]: the slot of each reserved position (kv_geometry.slot)
    copies: list[BlockCopy]  # copy-on-write, to apply before the forward pass
    delta: BlockTableDelta | None  # None when the table did not change


class DecodeResult(NamedTuple):
    slot_mapping: list[int]  # one per granted sequence, in order
    copies: list[BlockCopy]
    deltas: list[BlockTableDelta]
    refused_seq_ids: list[int]


class SwapResult(NamedTuple):
    granted: bool
    copies: list[BlockCopy]  # swap out: device -> cpu ids; swap in: cpu -> device ids
    deltas: list[BlockTableDelta]


REFUSED_RESERVATION = Reservation(False, [], [], None)
REFUSED_ADMISSION = Admission(False, 0, 0, [], None)
REFUSED_SWAP = SwapResult(False, [], [])
