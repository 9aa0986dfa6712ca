"""Scenario tests of the block-manager core with exact block ids."""

import pytest

from pagedserve.services.block_manager.contract import BlockCopy, BlockTableDelta
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.block_manager.prefix_hash import block_hash, cache_namespace

NS_A = cache_namespace(model="m", tokenizer="t", chat_template="c", adapter="", kv_dtype="fp32",
                       block_size=4, tenant_salt=b"tenant-a")
NS_B = cache_namespace(model="m", tokenizer="t", chat_template="c", adapter="", kv_dtype="fp32",
                       block_size=4, tenant_salt=b"tenant-b")


def fill(manager: BlockManager, seq_id: int, tokens: list[int], namespace: bytes = NS_A) -> list[int]:
    """Creates a sequence, reserves and commits all its prompt tokens; returns its slot mapping."""
    created = manager.create(seq_id, tokens, namespace)
    reservation = manager.reserve(seq_id, len(tokens) - created.num_cached_tokens)
    assert reservation.granted
    manager.commit(seq_id, len(tokens))
    manager.check_integrity()
    return reservation.slot_mapping


def test_namespace_digest_depends_on_every_part() -> None:
    base = dict(model="m", tokenizer="t", chat_template="c", adapter="", kv_dtype="fp32", block_size=4)
    digests = {cache_namespace(**base, tenant_salt=b"")}  # type: ignore[arg-type]
    for key, other in [("model", "m2"), ("tokenizer", "t2"), ("chat_template", "c2"), ("adapter", "a"),
                       ("kv_dtype", "bf16"), ("block_size", 8)]:
        digests.add(cache_namespace(**{**base, key: other}, tenant_salt=b""))  # type: ignore[arg-type]
    digests.add(cache_namespace(**base, tenant_salt=b"x"))  # type: ignore[arg-type]
    assert len(digests) == 8
    # length-prefixed fields: moving a character between fields changes the digest
    assert cache_namespace(**{**base, "model": "ab", "tokenizer": "c"}, tenant_salt=b"") != cache_namespace(  # type: ignore[arg-type]
        **{**base, "model": "a", "tokenizer": "bc"}, tenant_salt=b""  # type: ignore[arg-type]
    )


def test_slot_mapping_and_new_block_only_when_tail_is_full() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    assert fill(m, 1, [1, 2, 3, 4, 5, 6]) == [0, 1, 2, 3, 4, 5]
    assert m.block_table(1) == [0, 1]
    r = m.reserve(1, 1, append_token_ids=[7])  # slot 6 fits in block 1
    assert r.slot_mapping == [6] and r.delta is None and r.copies == []
    r = m.reserve(1, 2, append_token_ids=[8, 9])  # slot 7, then a new block
    assert r.slot_mapping == [7, 8] and r.delta == BlockTableDelta(1, 2, (2,))
    m.check_integrity()


def test_prefix_hit_reuses_blocks_and_leaves_last_token() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    fill(m, 1, list(range(10)))  # blocks 0, 1 full and hashed; block 2 partial
    created = m.create(2, list(range(8)) + [50, 51], NS_A)
    assert created.num_cached_tokens == 8 and m.block_table(2) == [0, 1]
    assert m.pool.blocks[0].ref_count == 2
    # a prompt that is exactly the cached blocks still computes its last token: one block is not reused
    created = m.create(3, list(range(8)), NS_A)
    assert created.num_cached_tokens == 4 and m.block_table(3) == [0]
    stats = m.stats()
    assert stats.prefix_cache_queries == 28 and stats.prefix_cache_hits == 12
    m.check_integrity()


def test_namespace_isolation() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    fill(m, 1, list(range(9)), NS_A)
    assert m.create(2, list(range(9)), NS_B).num_cached_tokens == 0
    assert m.create(3, list(range(9)), NS_A).num_cached_tokens == 8


def test_lru_eviction_order() -> None:
    m = BlockManager(num_blocks=6, block_size=2)
    fill(m, 1, [1, 2, 3, 4, 9])  # blocks 0, 1 hashed, 2 partial
    fill(m, 2, [5, 6, 7, 8, 9])  # blocks 3, 4 hashed, 5 partial
    m.free(1)  # tail first: 2 (unhashed) to the head; 1 then 0 to the tail
    m.free(2)  # 5 to the head; 4 then 3 to the tail
    assert [b.block_id for b in m.pool.free_queue] == [5, 2, 1, 0, 4, 3]
    assert m.stats().num_cached_blocks == 4
    # a hit revives block 0 and 1 from the middle of the queue
    assert m.create(3, [1, 2, 3, 4, 7], NS_A).num_cached_tokens == 4
    assert [b.block_id for b in m.pool.free_queue] == [5, 2, 4, 3]
    r = m.reserve(3, 1)
    assert r.delta == BlockTableDelta(3, 2, (5,))  # unhashed blocks go first
    m.create(4, [0, 0, 0], NS_A)
    # then the least recently freed cached block: the tail of seq 2's prefix, whose head block survives
    assert m.reserve(4, 3).delta == BlockTableDelta(4, 0, (2, 4))
    assert m.stats().num_evictions == 1 and m.pool.lookup(block_hash(NS_A, [5, 6])) is m.pool.blocks[3]
    assert m.pool.lookup(block_hash(block_hash(NS_A, [5, 6]), [7, 8])) is None
    m.check_integrity()


def test_copy_on_write_on_shared_tail_and_fork_then_diverge() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    fill(m, 1, [1, 2, 3, 4, 5, 6])
    assert m.fork(1, 2) == BlockTableDelta(2, 0, (0, 1))
    assert m.pool.blocks[1].ref_count == 2
    r = m.reserve(2, 1, append_token_ids=[100])  # child writes into the shared partial tail
    assert r.copies == [BlockCopy(1, 2, 2)] and r.delta == BlockTableDelta(2, 1, (2,)) and r.slot_mapping == [10]
    assert m.block_table(1) == [0, 1] and m.block_table(2) == [0, 2]
    r = m.reserve(1, 1, append_token_ids=[200])  # the parent now owns its tail alone: writes in place
    assert r.copies == [] and r.slot_mapping == [6]
    assert m.pool.blocks[0].ref_count == 2 and m.pool.blocks[1].ref_count == 1
    assert m.seqs[1].token_ids[-1] == 200 and m.seqs[2].token_ids[-1] == 100
    assert m.stats().num_cow_copies == 1
    m.check_integrity()


def test_swap_out_and_back_in_with_shared_blocks() -> None:
    m = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    fill(m, 1, [1, 2, 3, 4, 5, 6])
    m.fork(1, 2)
    out = m.swap_out([1, 2])
    assert out.granted and sorted(out.copies) == [BlockCopy(0, 0, 4), BlockCopy(1, 1, 2)]
    assert m.stats().num_free_blocks == 8 and m.stats().num_free_cpu_blocks == 2
    assert m.cpu_pool.ref_counts[:2] == [2, 2]
    m.check_integrity()
    back = m.swap_in([1, 2])
    # the full block is still in the device prefix cache (block 0): only the partial tail is copied back
    assert back.granted and back.copies == [BlockCopy(1, 1, 2)]
    assert m.block_table(1) == m.block_table(2) == [0, 1]  # still shared after the round trip
    assert m.stats().num_free_cpu_blocks == 4 and m.stats().num_swapped_in_blocks == 1
    m.check_integrity()


def test_swap_in_copies_back_what_was_evicted_meanwhile() -> None:
    m = BlockManager(num_blocks=3, block_size=2, num_cpu_blocks=3)
    fill(m, 1, [1, 2, 3, 4, 5])
    assert m.swap_out([1]).granted
    fill(m, 2, [7, 8, 9, 9, 9])  # takes every block, evicting seq 1's cached prefix
    m.free(2)
    back = m.swap_in([1])
    assert sorted(c.num_slots for c in back.copies) == [1, 2, 2] and m.stats().num_evictions == 4
    m.check_integrity()


def test_swap_out_of_one_sharer_keeps_the_other_intact() -> None:
    m = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    fill(m, 1, [1, 2, 3, 4, 5, 6])
    m.fork(1, 2)
    out = m.swap_out([2])
    assert len(out.copies) == 2 and m.block_table(1) == [0, 1] and m.pool.blocks[0].ref_count == 1
    m.check_integrity()


def test_refusals_change_nothing() -> None:
    m = BlockManager(num_blocks=4, block_size=4, num_cpu_blocks=1, watermark=0.25)
    fill(m, 1, list(range(12)))  # 3 blocks, 1 free
    before = (m.stats(), m.block_table(1))
    assert not m.reserve(1, 1, append_token_ids=[1], admission=True).granted  # watermark holds 1 back
    assert m.stats() == before[0] and len(m.seqs[1].token_ids) == 12
    assert m.reserve(1, 1, append_token_ids=[1]).granted  # a running sequence may use it
    assert not m.reserve(1, 4, append_token_ids=[1, 2, 3, 4]).granted
    assert not m.swap_out([1]).granted  # 4 blocks, cpu pool holds 1
    assert (m.stats().num_free_blocks, m.block_table(1)) == (0, [0, 1, 2, 3])
    m.check_integrity()


def test_misuse_raises_with_values() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    fill(m, 1, [1, 2, 3])
    with pytest.raises(ValueError, match="unknown sequence 9"):
        m.reserve(9, 1)
    with pytest.raises(ValueError, match="already exists"):
        m.create(1, [1], NS_A)
    with pytest.raises(ValueError, match="3 known tokens"):
        m.reserve(1, 1)
    with pytest.raises(ValueError, match="got -1"):
        m.reserve(1, -1)
    m.free(1)
    with pytest.raises(ValueError, match="unknown sequence 1"):
        m.free(1)
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockManager(num_blocks=0, block_size=4)


def test_kv_utilization_counts_filled_slots() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    fill(m, 1, [1, 2, 3, 4, 5])  # 5 of 8 slots
    assert m.stats().kv_utilization == pytest.approx(5 / 8)
    m.fork(1, 2)  # shared blocks counted once
    assert m.stats().kv_utilization == pytest.approx(5 / 8)
    m.reserve(2, 1, append_token_ids=[9])  # CoW: private block with 2 slots
    assert m.stats().kv_utilization == pytest.approx(7 / 12)
    m.check_integrity()


def test_reset_forgets_everything() -> None:
    m = BlockManager(num_blocks=4, block_size=2, num_cpu_blocks=2)
    fill(m, 1, [1, 2, 3])
    m.reset()
    assert m.stats().num_free_blocks == 4 and not m.seqs and not m.pool.cached
    assert m.create(2, [1, 2, 3], NS_A).num_cached_tokens == 0
    m.check_integrity()


def test_decode_fast_path_equals_commit_plus_reserve() -> None:
    fast, slow = BlockManager(num_blocks=16, block_size=4), BlockManager(num_blocks=16, block_size=4)
    for m in (fast, slow):
        fill(m, 1, [1, 2, 3, 4, 5, 6, 7])
        fill(m, 2, [1, 2, 3])
        m.fork(2, 3)  # 2 and 3 share a partial tail: the first decode copies it
    for step in range(6):
        tokens = [10 + step, 20 + step, 30 + step]
        result = fast.decode([1, 2, 3], tokens)
        slots, copies, deltas = [], [], []
        for seq_id, token in zip([1, 2, 3], tokens, strict=True):
            slow.commit(seq_id, slow.seqs[seq_id].num_slots)
            r = slow.reserve(seq_id, 1, [token])
            slots += r.slot_mapping
            copies += r.copies
            deltas += [r.delta] if r.delta else []
        assert (result.slot_mapping, result.copies, result.deltas) == (slots, copies, deltas)
        assert result.refused_seq_ids == []
        fast.check_integrity()
    assert fast.stats() == slow.stats()
    assert all(fast.seqs[i].token_ids == slow.seqs[i].token_ids for i in (1, 2, 3))


def test_decode_refuses_only_the_sequences_without_a_block() -> None:
    m = BlockManager(num_blocks=3, block_size=2)
    fill(m, 1, [1, 2])  # full tail: needs a new block to decode
    fill(m, 2, [3])  # room in its tail
    result = m.decode([1, 2], [7, 8])
    assert result.refused_seq_ids == [] and m.stats().num_free_blocks == 0
    result = m.decode([1, 2], [5, 6])  # seq 1 writes into its new tail; seq 2's tail is full and no block is free
    assert result.refused_seq_ids == [2] and result.slot_mapping == [5]
    seq = m.seqs[2]
    assert seq.num_computed == seq.num_slots == 2 and seq.token_ids == [3, 8]  # the commit applied, nothing else
    m.check_integrity()


def test_admit_reserves_first_chunk_after_prefix_hits_or_changes_nothing() -> None:
    m = BlockManager(num_blocks=6, block_size=4, watermark=0.34)  # 2 blocks held back for running sequences
    fill(m, 1, list(range(9)))  # blocks 0, 1 hashed, 2 partial
    m.free(1)  # 0 and 1 stay cached at the tail
    admission = m.admit(2, list(range(8)) + [40, 41, 42, 43, 44], NS_A, max_tokens=4)
    assert admission.granted and admission.num_cached_tokens == 8 and admission.num_tokens == 4
    assert admission.delta == BlockTableDelta(2, 0, (0, 1, 2)) and admission.slot_mapping == [8, 9, 10, 11]
    before = (m.stats(), [b.block_id for b in m.pool.free_queue])
    # 3 free blocks, 2 of them held back: a cold 8-token prompt needs 2, so it is refused, leaving no trace
    assert not m.admit(3, [9] * 8, NS_A, max_tokens=8).granted
    assert 3 not in m.seqs and (m.stats(), [b.block_id for b in m.pool.free_queue]) == before
    m.check_integrity()


def test_blocks_freed_in_a_step_are_handed_out_only_after_it() -> None:
    """The executor applies a step's copies and swaps before its writes: a block freed in a step after a
    copy or swap could be read, and handed out in the same step, could be overwritten before it is read."""
    from pagedserve.services.block_manager.contract import AdmitOp, FreeOp, ReserveOp
    from pagedserve.services.block_manager.step import apply_step

    m = BlockManager(num_blocks=4, block_size=2)
    fill(m, 1, [1, 2, 3])  # blocks 0, 1
    fill(m, 3, [5])  # block 2
    outcomes = apply_step(m, [ReserveOp(3, 0), FreeOp(1), AdmitOp(2, [7, 8, 9, 9, 9, 9], NS_A, 6)])
    assert not outcomes[2].granted  # 3 blocks needed: 0 and 1 are freed after a reserve, so held back
    assert m.stats().num_free_blocks == 3
    # frees before any op that may copy or swap release at once: the same admission fits
    fill(m, 1, [1, 2, 3])
    outcomes = apply_step(m, [FreeOp(1), AdmitOp(2, [7, 8, 9, 9, 9, 9], NS_A, 6)])
    assert outcomes[1].granted
    m.check_integrity()


def test_reviving_a_held_back_cached_block_takes_no_free_block() -> None:
    from pagedserve.services.block_manager.contract import AdmitOp, FreeOp, ReserveOp
    from pagedserve.services.block_manager.step import apply_step

    m = BlockManager(num_blocks=4, block_size=2, watermark=0.0)
    apply_step(m, [AdmitOp(1, [1, 2, 3], NS_A, 3), AdmitOp(2, [9], NS_A, 1)])
    m.commit(1, 3)  # block 0 holds [1, 2] and is cached
    outcomes = apply_step(m, [ReserveOp(2, 0), FreeOp(1), AdmitOp(3, [1, 2, 5], NS_A, 1)])
    # one free block: the hit revives held-back block 0 (not a free one) and the new token needs one
    assert outcomes[2].granted and outcomes[2].num_cached_tokens == 2
    m.check_integrity()


# ---- spares: one empty block past a sequence's tail, so that its next decodes need no call ----------------------


def test_an_advance_crosses_from_the_tail_into_the_spare() -> None:
    from pagedserve.services.block_manager.contract import AdvanceOp, ForkOp, InvalidStep
    from pagedserve.services.block_manager.step import apply_step

    m = BlockManager(num_blocks=8, block_size=4)
    fill(m, 1, [1, 2, 3])  # block 0, 3 slots
    fill(m, 2, [9])  # block 1
    assert m.spare([1]) == [BlockTableDelta(1, 1, (2,))]  # the head of the free queue, past the table
    assert m.block_table(1) == [0, 2] and m.has_spare(m.seqs[1]) and m.pool.blocks[2].num_filled == 0
    m.check_integrity()
    with pytest.raises(InvalidStep, match=r"ops\[0\]\.fork\.parent_seq_id: sequence 1 holds a spare"):
        apply_step(m, [ForkOp(1, 3)])
    with pytest.raises(ValueError, match="do not fit in its tail block and spare"):
        m.advance(1, 6, [4, 5, 6, 7])  # 3 + 6 slots > 2 blocks
    # the frontend placed positions 3, 4 and 5 itself: slot 3 in its tail, 8 and 9 in the spare (block 2)
    assert [m.seqs[1].block_table[p // 4].block_id * 4 + p % 4 for p in (3, 4, 5)] == [3, 8, 9]
    apply_step(m, [AdvanceOp([1], [3], [2], [4, 5])])
    seq = m.seqs[1]
    assert (seq.num_slots, seq.num_computed, seq.token_ids) == (6, 6, [1, 2, 3, 4, 5])
    assert m.block_table(1) == [0, 2] and not m.has_spare(seq)
    assert (m.pool.blocks[0].num_filled, m.pool.blocks[2].num_filled) == (4, 2)
    assert m.pool.blocks[0].block_hash is not None and m.pool.blocks[2].block_hash is None  # block 0 is full
    assert m.fork(1, 3) == BlockTableDelta(3, 0, (0, 2))  # the spare became its tail: it may be shared now
    m.check_integrity()


def test_a_decode_into_the_spare_makes_no_delta_and_a_reserve_uses_it_first() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    fill(m, 1, [1, 2, 3, 4])  # block 0, full
    fill(m, 2, [1, 2, 3, 4])  # the same prompt, computed twice: block 1
    assert m.spare([1, 2]) == [BlockTableDelta(1, 1, (2,)), BlockTableDelta(2, 1, (3,))]
    free = m.stats().num_free_blocks
    d = m.decode([1], [5])
    assert (d.slot_mapping, d.deltas, d.copies, d.refused_seq_ids) == ([8], [], [], [])
    assert m.stats().num_free_blocks == free and m.block_table(1) == [0, 2]
    r = m.reserve(2, 1, [5])  # only its spare: the table does not change
    assert r.granted and r.slot_mapping == [12] and r.delta is None
    r = m.reserve(2, 4, [6, 7, 8, 9])  # the rest of the spare, then a new block past it
    assert r.slot_mapping == [13, 14, 15, 16] and r.delta == BlockTableDelta(2, 2, (4,))
    assert m.block_table(2) == [1, 3, 4] and not m.has_spare(m.seqs[2])
    m.check_integrity()


def test_a_swap_out_gives_the_spare_back_and_copies_only_used_blocks() -> None:
    m = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=2)
    fill(m, 1, [1, 2, 3, 4, 5, 6])  # blocks 0 (full, cached) and 1 (2 slots)
    assert m.spare([1]) == [BlockTableDelta(1, 2, (2,))]
    out = m.swap_out([1])
    assert out.granted and sorted(out.copies) == [BlockCopy(0, 0, 4), BlockCopy(1, 1, 2)]
    assert m.seqs[1].cpu_table == [0, 1] and m.stats().num_free_blocks == 8 and m.stats().num_free_cpu_blocks == 0
    # the spare first, then the table tail first: unhashed blocks at the head, the cached one at the tail
    assert [b.block_id for b in m.pool.free_queue] == [1, 2, 3, 4, 5, 6, 7, 0]
    m.check_integrity()
    back = m.swap_in([1])
    assert back.granted and back.copies == [BlockCopy(1, 1, 2)] and m.block_table(1) == [0, 1]  # no spare
    m.check_integrity()


def test_a_refused_swap_out_keeps_the_spare() -> None:
    m = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=1)
    fill(m, 1, [1, 2, 3, 4, 5])  # 2 blocks: the cpu pool holds 1
    m.spare([1])
    before = (m.stats(), m.block_table(1))
    assert not m.swap_out([1]).granted
    assert (m.stats(), m.block_table(1)) == before and m.has_spare(m.seqs[1])
    m.check_integrity()


def test_a_spare_is_refused_when_only_watermark_blocks_are_left() -> None:
    from pagedserve.services.block_manager.contract import DecodeOp, SpareOp
    from pagedserve.services.block_manager.step import apply_step

    m = BlockManager(num_blocks=4, block_size=4, watermark=0.25)  # 1 block held back
    fill(m, 1, [1, 2, 3])  # block 0
    fill(m, 2, [7, 8, 9, 10])  # block 1, full; blocks 2 and 3 free: 1 above the watermark
    outcome = apply_step(m, [SpareOp([1, 2])])[0]
    assert outcome.granted and outcome.deltas == [BlockTableDelta(1, 1, (2,))] and outcome.refused_seq_ids == [2]
    assert m.block_table(2) == [1] and not m.can_spare() and m.stats().num_free_blocks == 1
    before = (m.stats(), m.block_table(2), [b.block_id for b in m.pool.free_queue])
    assert m.spare([2]) == [None]
    assert (m.stats(), m.block_table(2), [b.block_id for b in m.pool.free_queue]) == before
    # the block the watermark holds back is not a spare's, but a running sequence's decode may take it
    outcome = apply_step(m, [DecodeOp([2], [11])])[0]
    assert outcome.refused_seq_ids == [] and outcome.deltas == [BlockTableDelta(2, 1, (3,))]
    assert outcome.slot_mapping == [12] and m.stats().num_free_blocks == 0
    m.check_integrity()


def test_free_releases_the_spare_with_the_rest() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    fill(m, 1, [1, 2, 3])  # block 0
    m.spare([1])  # block 1
    m.free(1)
    assert m.stats().num_free_blocks == 8 and m.stats().num_used_blocks == 0
    assert [b.block_id for b in m.pool.free_queue][:2] == [0, 1]  # the spare first, then the tail: to the head
    m.check_integrity()


def test_kv_utilization_counts_a_spare_as_a_used_block_with_no_slot_filled() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    fill(m, 1, [1, 2, 3, 4, 5])  # 5 of 8 slots
    assert m.stats().kv_utilization == pytest.approx(5 / 8)
    m.spare([1])
    stats = m.stats()
    assert stats.num_used_blocks == 3 and stats.kv_utilization == pytest.approx(5 / 12)
    m.advance(1, 3, [6, 7])  # fills block 1; the spare is still empty
    assert m.has_spare(m.seqs[1]) and m.stats().kv_utilization == pytest.approx(8 / 12)
    m.advance(1, 1, [8, 9])  # one slot in the spare
    assert not m.has_spare(m.seqs[1]) and m.stats().kv_utilization == pytest.approx(9 / 12)
    m.check_integrity()


def test_spare_misuse_raises_and_changes_nothing() -> None:
    m = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    fill(m, 1, [1, 2, 3])
    fill(m, 2, [4, 5, 6])
    m.fork(2, 3)  # 2 and 3 share a partial tail
    fill(m, 4, [7])
    m.spare([4])
    fill(m, 5, [8])
    assert m.swap_out([5]).granted
    cases = [
        ([1, 1], "duplicate sequence ids"),
        ([1, 4], "sequence 4 holds a spare already"),
        ([1, 2], "sequence 2's tail block is shared"),
        ([1, 9], "unknown sequence 9"),
        ([1, 5], "sequence 5 is swapped out"),
    ]
    before = (m.stats(), [m.block_table(i) for i in (1, 2, 3, 4)])
    for seq_ids, message in cases:  # the valid sequence before the bad one gets no spare either
        with pytest.raises(ValueError, match=message):
            m.spare(seq_ids)
        assert (m.stats(), [m.block_table(i) for i in (1, 2, 3, 4)]) == before, seq_ids
    with pytest.raises(ValueError, match="parent sequence 4 holds a spare"):
        m.fork(4, 6)
    assert 6 not in m.seqs and (m.stats(), [m.block_table(i) for i in (1, 2, 3, 4)]) == before
    m.check_integrity()


def test_a_step_names_a_spare_s_sequence_only_in_its_advance_before_it_and_in_nothing_after() -> None:
    from pagedserve.services.block_manager.contract import (
        AdvanceOp,
        CommitOp,
        DecodeOp,
        ForkOp,
        FreeOp,
        InvalidStep,
        Op,
        ReserveOp,
        SpareOp,
    )
    from pagedserve.services.block_manager.step import apply_step

    m = BlockManager(num_blocks=8, block_size=4)
    fill(m, 1, [1, 2, 3, 4, 5])  # blocks 0, 1: 5 slots, its own partial tail
    advance = AdvanceOp([1], [1], [1], [6])
    invalid: list[tuple[list[Op], str]] = [
        ([DecodeOp([1], [6]), SpareOp([1])], r"ops\[1\]\.spare\.seq_ids: sequence 1 is named earlier"),
        ([ReserveOp(1, 0), SpareOp([1])], r"ops\[1\]\.spare\.seq_ids: sequence 1 is named earlier"),
        # after the Advance, another op (its fork shares the tail: the spare's own check would pass on the
        # table as before the step, and the manager would then refuse it with half the step applied)
        ([advance, ForkOp(1, 2), SpareOp([1])], r"ops\[2\]\.spare\.seq_ids: sequence 1 is named earlier"),
        ([advance, CommitOp(1, 6), SpareOp([1])], r"ops\[2\]\.spare\.seq_ids: sequence 1 is named earlier"),
        ([SpareOp([1]), FreeOp(1)], r"ops\[1\]\.free\.seq_id: sequence 1 was given a spare earlier"),
        ([SpareOp([1]), SpareOp([1])], r"ops\[1\]\.spare\.seq_ids: sequence 1 is named earlier"),
        ([SpareOp([1, 1])], r"ops\[0\]\.spare\.seq_ids: duplicate"),
        ([SpareOp([9])], r"ops\[0\]\.spare\.seq_ids: unknown sequence 9"),
    ]
    before = (m.stats(), m.block_table(1), m.seqs[1].num_slots, list(m.seqs[1].token_ids))
    for ops, message in invalid:
        with pytest.raises(InvalidStep, match=message):
            apply_step(m, ops)
        assert (m.stats(), m.block_table(1), m.seqs[1].num_slots, list(m.seqs[1].token_ids)) == before, ops
    outcomes = apply_step(m, [advance, SpareOp([1])])  # after its own Advance: valid
    assert outcomes[1].deltas == [BlockTableDelta(1, 2, (2,))] and m.seqs[1].num_slots == 6
    # held spare: a second one, or a fork, is refused in a step; an Advance into the spare makes the fork valid
    for ops, message in [([SpareOp([1])], "sequence 1 holds a spare already"),
                         ([ForkOp(1, 2)], r"ops\[0\]\.fork\.parent_seq_id: sequence 1 holds a spare"),
                         ([AdvanceOp([1], [1], [1], [7]), ForkOp(1, 2)], r"ops\[1\]\.fork\.parent_seq_id")]:
        with pytest.raises(InvalidStep, match=message):
            apply_step(m, ops)
    apply_step(m, [AdvanceOp([1], [3], [2], [7, 8]), ForkOp(1, 2)])  # 9 slots: the spare is its tail now
    assert m.block_table(2) == [0, 1, 2] and not m.has_spare(m.seqs[1])
    m.check_integrity()


def test_a_fork_of_a_sequence_swapped_in_by_the_step_is_not_swapped_out_in_it() -> None:
    """The child shares the blocks the step's swap-in writes, and the executor runs a step's swap-outs before its
    swap-ins: swapped out in the same step, the child's CPU copy would be stale."""
    from pagedserve.services.block_manager.contract import ForkOp, InvalidStep, SwapInOp, SwapOutOp
    from pagedserve.services.block_manager.step import apply_step

    m = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    fill(m, 1, [1, 2, 3])
    assert m.swap_out([1]).granted
    before = (m.stats(), m.seqs[1].cpu_table)
    with pytest.raises(InvalidStep, match=r"ops\[2\]\.swap_out\.seq_ids: sequence 2 was swapped in earlier"):
        apply_step(m, [SwapInOp([1]), ForkOp(1, 2), SwapOutOp([2])])
    assert (m.stats(), m.seqs[1].cpu_table) == before and 2 not in m.seqs
    outcomes = apply_step(m, [SwapInOp([1]), ForkOp(1, 2)])  # the next step may swap either out
    assert outcomes[1].deltas == [BlockTableDelta(2, 0, tuple(m.block_table(1)))]
    assert apply_step(m, [SwapOutOp([2])])[0].granted
    m.check_integrity()


def test_kv_events_follow_the_prefix_index() -> None:
    """Stored once per new key (twin content emits nothing), removed when an eviction hands the block out, cleared
    on reset; batches numbered from 1 in the manager's epoch, an empty take a heartbeat with the same number."""
    from pagedserve.services.common.kv_events import AllCleared, BlocksRemoved, BlocksStored

    m = BlockManager(num_blocks=4, block_size=2)
    recorder = m.record_kv_events()
    assert m.record_kv_events() is recorder and recorder.epoch == m.instance_id
    assert m.kv_snapshot().sequence == 0 and not m.kv_snapshot().block_hashes
    fill(m, 1, [1, 2, 3, 4])
    k1 = block_hash(NS_A, [1, 2])
    k2 = block_hash(k1, [3, 4])
    batch = recorder.take_batch()
    assert (batch.sequence, batch.events) == (1, (BlocksStored((k1, k2)),))
    heartbeat = recorder.take_batch()
    assert (heartbeat.sequence, heartbeat.events) == (1, ())
    fill(m, 2, [1, 2, 3, 4], NS_A)  # reuses k1; its own last block holds k2's content again: no new key
    assert recorder.take_batch().events == ()
    m.free(1)
    m.free(2)
    fill(m, 3, [9, 9, 8, 8, 7, 7])  # 3 blocks of 4: the free queue hands out cached ones last, evicting one
    events = recorder.take_batch().events
    assert isinstance(events[-1], BlocksStored) and len(events[-1].block_hashes) == 3
    removed = [h for e in events if isinstance(e, BlocksRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= {k1, k2} and m.kv_snapshot().block_hashes == set(m.pool.cached)
    m.reset()
    batch = recorder.take_batch()
    assert batch.events == (AllCleared(),) and batch.sequence == 3 and not m.kv_snapshot().block_hashes
