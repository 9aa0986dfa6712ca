"""The paged KV cache's geometry, written once for every side that computes it.

A sequence's token at `position` lives in logical block `position // block_size` of the sequence, which its
block table maps to a physical block; its *slot* is that block's id times the block size plus the offset in
the block. The block manager hands slots out, the scheduler places decodes without it, and the executor
checks and writes them: all three use these functions, so that they cannot disagree. Pure Python, no imports.
"""

from __future__ import annotations

from collections.abc import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The number of blocks that hold `num_tokens` tokens (a partly filled last block counts)."""
    return -(-num_tokens // block_size)


def slot(block_id: int, offset: int, block_size: int) -> int:
    """The slot of offset `offset` in physical block `block_id`."""
    return block_id * block_size + offset


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The slot of the token at `position` of a sequence whose block table (physical block ids) is `block_table`."""
    return block_table[position // block_size] * block_size + position % block_size
