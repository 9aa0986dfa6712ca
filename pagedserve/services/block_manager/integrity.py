"""Every invariant of the block manager, checked from scratch. Slow (O(blocks + table entries)): for tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from ..common.kv_geometry import blocks_for
from .block_pool import BlockPool
from .contract import MAX_UNTOLD_SLOTS
from .cpu_pool import CpuBlockPool
from .sequence import SequenceState


def filled_slots(seqs: Mapping[int, SequenceState], block_size: int) -> int:
    """Token slots in use, each shared block counted once (with its fullest holder's count)."""
    filled: dict[int, int] = {}
    for seq in seqs.values():
        for i, block in enumerate(seq.block_table):
            count = min(block_size, seq.num_slots - i * block_size)
            if count > filled.get(block.block_id, 0):
                filled[block.block_id] = count
    return sum(filled.values())


def check_integrity(seqs: Mapping[int, SequenceState], pool: BlockPool, cpu: CpuBlockPool, bs: int,
                    num_swapped_sequences: int) -> None:
    """A block manager's sequences, pools, block size and count of swapped sequences (BlockManager.check_integrity
    passes its own) agree with each other; an AssertionError names what does not."""
    refs: Counter[int] = Counter()
    cpu_refs: Counter[int] = Counter()
    num_swapped = sum(seq.cpu_table is not None for seq in seqs.values())
    assert num_swapped_sequences == num_swapped, (
        f"{num_swapped_sequences} sequences counted as swapped out, {num_swapped} are")
    for seq_id, seq in seqs.items():
        assert seq.seq_id == seq_id, f"sequence stored under {seq_id} calls itself {seq.seq_id}"
        assert seq.num_computed <= seq.num_slots <= len(seq.token_ids) + MAX_UNTOLD_SLOTS, (
            f"seq {seq_id}: computed {seq.num_computed} <= slots {seq.num_slots} <= tokens"
            f" {len(seq.token_ids)} + {MAX_UNTOLD_SLOTS} violated (reserve/commit bookkeeping)"
        )
        assert len(seq.block_hashes) == min(seq.num_computed, len(seq.token_ids)) // bs, (
            f"seq {seq_id}: {len(seq.block_hashes)} block keys for {seq.num_computed} computed tokens"
        )
        expected_blocks = blocks_for(seq.num_slots, bs)
        if seq.cpu_table is not None:
            assert not seq.block_table, f"seq {seq_id} is swapped out but holds device blocks"
            assert len(seq.cpu_table) == expected_blocks, f"seq {seq_id}: cpu table length is wrong"
            cpu_refs.update(seq.cpu_table)
            continue
        assert expected_blocks <= len(seq.block_table) <= expected_blocks + 1, (
            f"seq {seq_id}: {len(seq.block_table)} blocks for {seq.num_slots} slots (reserve or spare bookkeeping)"
        )
        if len(seq.block_table) > expected_blocks:
            spare = seq.block_table[-1]
            assert spare.ref_count == 1 and spare.num_filled == 0 and spare.block_hash is None, (
                f"seq {seq_id}: its spare {spare} is shared, filled or cached (spare, fork or swap bookkeeping)")
            assert not seq.num_slots % bs or seq.block_table[-2].ref_count == 1, (
                f"seq {seq_id} holds a spare behind a shared partial tail (spare after a fork?)")
        ids = [block.block_id for block in seq.block_table]
        assert len(set(ids)) == len(ids), f"seq {seq_id} holds a block twice: {ids}"
        refs.update(ids)
        for i, block in enumerate(seq.block_table):
            if block.block_hash is not None:  # registered content is immutable: never a write target
                assert (i + 1) * bs <= seq.num_slots, f"seq {seq_id} may write into cached block {block}"

    free_ids = [block.block_id for block in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks, "free queue count or duplicates"
    free_set = set(free_ids)
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id], (
            f"{block}: refcount {block.ref_count} but {refs[block.block_id]} block tables hold it"
        )
        assert (block.ref_count == 0) == (block.block_id in free_set), f"{block}: free iff unreferenced"
    assert pool.num_free_blocks + sum(1 for b in pool.blocks if b.ref_count > 0) == pool.num_blocks
    hashed = {block.block_hash: block for block in pool.blocks if block.block_hash is not None}
    assert hashed.keys() == pool.cached.keys(), "prefix index and block hashes disagree"
    for key, block in pool.cached.items():
        assert hashed[key] is block, f"prefix index maps a key to {block}, which holds another"
    cached_free = sum(1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None)
    assert cached_free == pool.num_cached_free, f"{cached_free} cached free blocks, counter says {pool.num_cached_free}"

    assert pool.num_filled_used == filled_slots(seqs, bs), (
        f"filled-slot counter {pool.num_filled_used} != {filled_slots(seqs, bs)} counted from block tables"
    )

    free_cpu = cpu.free_ids()
    assert len(free_cpu) == len(set(free_cpu)) == cpu.num_free_blocks
    for cpu_id, count in enumerate(cpu.ref_counts):
        assert count == cpu_refs[cpu_id], f"cpu block {cpu_id}: refcount {count}, held {cpu_refs[cpu_id]}"
        assert (count == 0) == (cpu_id in set(free_cpu)), f"cpu block {cpu_id}: free iff unreferenced"
