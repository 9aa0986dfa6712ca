"""A snapshot of the block manager's state and counters, as exported to the scheduler and the operator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manager import BlockManager


@dataclass(frozen=True)
class BlockStats:
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


def filled_slots(manager: BlockManager) -> int:
    """Token slots in use, each shared block counted once (with its fullest holder's count)."""
    filled: dict[int, int] = {}
    bs = manager.block_size
    for seq in manager.seqs.values():
        for i, block in enumerate(seq.block_table):
            count = min(bs, seq.num_slots - i * bs)
            if count > filled.get(block.block_id, 0):
                filled[block.block_id] = count
    return sum(filled.values())


def collect_stats(manager: BlockManager) -> BlockStats:
    pool = manager.pool
    total = pool.num_blocks
    used = total - pool.num_free_blocks
    queries = manager.prefix_queries
    return BlockStats(
        block_size=manager.block_size,
        num_total_blocks=total,
        num_free_blocks=pool.num_free_blocks,
        num_used_blocks=used,
        num_cached_blocks=pool.num_cached_free,
        num_cpu_blocks=manager.cpu_pool.num_blocks,
        num_free_cpu_blocks=manager.cpu_pool.num_free_blocks,
        num_sequences=len(manager.seqs),
        num_swapped_sequences=manager.num_swapped_sequences,
        block_pressure=used / total,
        block_pressure_with_cached=(used + pool.num_cached_free) / total,
        kv_utilization=pool.num_filled_used / (used * manager.block_size) if used else 0.0,
        prefix_cache_queries=queries,
        prefix_cache_hits=manager.prefix_hits,
        prefix_hit_rate=manager.prefix_hits / queries if queries else 0.0,
        num_cow_copies=manager.num_cow_copies,
        num_swapped_out_blocks=manager.num_swapped_out_blocks,
        num_swapped_in_blocks=manager.num_swapped_in_blocks,
        num_evictions=pool.num_evictions,
        watermark=manager.watermark,
        instance_id=manager.instance_id,
    )
