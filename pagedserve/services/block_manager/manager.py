"""The block manager the scheduler calls: sequences, block tables, prefix reuse, copy-on-write and swap.

Three tiers of outcome, as in vLLM's core: running out of blocks is a normal answer (a refused result
that changed nothing); misuse (unknown sequence, impossible counts) raises ValueError naming the
values; a broken invariant is an assert, caught by `check_integrity()`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence

from ..common.kv_events import KvEventRecorder, KvSnapshot
from ..common.kv_geometry import blocks_for, slot
from .block_pool import BlockPool, KVBlock
from .contract import (
    NO_TOKEN,
    BlockCopy,
    BlockStats,
    BlockTableDelta,
)
from .cpu_pool import CpuBlockPool
from .integrity import check_integrity
from .op_checks import advance_problem, fork_problem, holds_spare, next_slot_is_shared, spare_problem
from .prefix_hash import block_hash
from .results import (
    REFUSED_ADMISSION,
    REFUSED_RESERVATION,
    REFUSED_SWAP,
    Admission,
    CreateResult,
    DecodeResult,
    Reservation,
    SwapResult,
)
from .sequence import SequenceState


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, watermark: float = 0.01):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_blocks)
        self.instance_id = secrets.token_hex(8)  # in Stats: which process answers (a Reset keeps it)
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self.seqs: dict[int, SequenceState] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # prompt tokens served from it
        self.num_cow_copies = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_swapped_sequences = 0  # sequences with a CPU table: counted, not recounted for every step's stats

    # ---- queries -------------------------------------------------------------------------------------

    def get(self, seq_id: int) -> SequenceState:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id}")
        return seq

    def block_table(self, seq_id: int) -> list[int]:
        return [block.block_id for block in self.get(seq_id).block_table]

    def num_blocks_to_reserve(self, seq: SequenceState, num_tokens: int) -> int:
        """Free blocks a reservation of num_tokens would take: new tail blocks (past a spare) plus a copy-on-write."""
        bs = self.block_size
        num_new = max(0, blocks_for(seq.num_slots + num_tokens, bs) - len(seq.block_table))
        writes_shared_tail = num_tokens > 0 and next_slot_is_shared(seq.block_table, seq.num_slots, bs)
        return num_new + int(writes_shared_tail)

    def has_spare(self, seq: SequenceState) -> bool:
        """Whether the table holds a block past the sequence's slots (see `spare`)."""
        return holds_spare(len(seq.block_table), seq.num_slots, self.block_size)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a new sequence's first num_tokens fit above the watermark (prefix hits ignored)."""
        return blocks_for(num_tokens, self.block_size) <= self._budget(admission=True)

    def _budget(self, admission: bool) -> int:
        return self.pool.num_free_blocks - (self.watermark_blocks if admission else 0)

    # ---- acts ----------------------------------------------------------------------------------------

    def create(self, seq_id: int, token_ids: Sequence[int], namespace: bytes) -> CreateResult:
        """Registers a prompt and reuses its longest cached prefix, leaving the last token to compute."""
        hits = self._prefix_hits(seq_id, token_ids, namespace)
        seq = SequenceState(seq_id, namespace, list(token_ids))
        for block, key in hits:
            self.pool.acquire(block)
            seq.block_table.append(block)
            seq.block_hashes.append(key)
        seq.num_slots = seq.num_computed = len(hits) * self.block_size
        self.prefix_queries += len(token_ids)
        self.prefix_hits += seq.num_computed
        self.seqs[seq_id] = seq
        append = tuple(block.block_id for block in seq.block_table)
        return CreateResult(seq.num_computed, BlockTableDelta(seq_id, 0, append))

    def admit(self, seq_id: int, token_ids: Sequence[int], namespace: bytes, max_tokens: int) -> Admission:
        """create + reserve of the first chunk (up to max_tokens after the cached prefix), as one act above
        the watermark: refused, it changes nothing, the sequence included."""
        if max_tokens <= 0:
            raise ValueError(f"admit: max_tokens must be positive, got {max_tokens} for sequence {seq_id}")
        hits = self._prefix_hits(seq_id, token_ids, namespace)
        cached = len(hits) * self.block_size
        num_tokens = min(max_tokens, len(token_ids) - cached)
        revived = sum(1 for block, _ in hits if self.pool.in_free_queue(block))
        new_blocks = blocks_for(cached + num_tokens, self.block_size) - len(hits)
        if revived + new_blocks > self._budget(admission=True):
            return REFUSED_ADMISSION
        created = self.create(seq_id, token_ids, namespace)
        reservation = self.reserve(seq_id, num_tokens, admission=True)
        assert reservation.granted, f"admit of {seq_id}: reservation refused after the budget check"
        delta = BlockTableDelta(seq_id, 0, tuple(b.block_id for b in self.seqs[seq_id].block_table))
        return Admission(True, created.num_cached_tokens, num_tokens, reservation.slot_mapping, delta)

    def _prefix_hits(self, seq_id: int, token_ids: Sequence[int], namespace: bytes) -> list[tuple[KVBlock, bytes]]:
        """The longest chain of cached full blocks matching the prompt, leaving at least its last token."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if not token_ids:
            raise ValueError(f"sequence {seq_id}: token_ids must not be empty")
        if not namespace:
            raise ValueError(f"sequence {seq_id}: cache namespace must not be empty")
        bs, parent = self.block_size, namespace
        hits = []
        for i in range((len(token_ids) - 1) // bs):
            key = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append((block, key))
            parent = key
        return hits

    def fork(self, parent_id: int, child_id: int) -> BlockTableDelta:
        """The child shares every block of the parent; the first write into a shared tail copies it."""
        parent = self._resident(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"fork: child sequence {child_id} already exists")
        problem = fork_problem(parent_id, parent.block_table, parent.num_slots, self.block_size)
        if problem:
            raise ValueError(f"fork: parent {problem}")
        for block in parent.block_table:
            self.pool.acquire(block)
        self.seqs[child_id] = SequenceState(
            child_id, parent.namespace, list(parent.token_ids), list(parent.block_table),
            parent.num_slots, parent.num_computed, list(parent.block_hashes),
        )
        return BlockTableDelta(child_id, 0, tuple(b.block_id for b in parent.block_table))

    def reserve(
        self, seq_id: int, num_tokens: int, append_token_ids: Sequence[int] = (), admission: bool = False
    ) -> Reservation:
        """Appends known tokens, then reserves slots for the next num_tokens tokens: all or nothing."""
        seq, bs = self._resident(seq_id), self.block_size
        if num_tokens < 0:
            raise ValueError(f"reserve: num_tokens must be >= 0, got {num_tokens} for sequence {seq_id}")
        known = len(seq.token_ids) + len(append_token_ids)
        if seq.num_slots + num_tokens > known:
            raise ValueError(
                f"reserve: sequence {seq_id} has {known} known tokens and {seq.num_slots} reserved slots;"
                f" cannot reserve {num_tokens} more"
            )
        if self.num_blocks_to_reserve(seq, num_tokens) > self._budget(admission):
            return REFUSED_RESERVATION
        seq.token_ids.extend(append_token_ids)
        if len(seq.block_hashes) < min(seq.num_computed, len(seq.token_ids)) // bs:
            self._register_full_blocks(seq)  # a late token (overlapped steps) completed a computed block
        return self._grow(seq, num_tokens)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> DecodeResult:
        """The fast path of a decode step: per sequence, commit(num_slots), append the token unless it is
        NO_TOKEN, then reserve one slot. With overlapped steps the new slot's token is the one a step in
        flight samples, told by a later decode: a sequence holds at most MAX_UNTOLD_SLOTS slots whose tokens
        are unknown (NO_TOKEN is valid only below that), and only blocks whose tokens are all known are hashed.
        The commit always applies; a sequence whose reservation is refused is listed and unchanged.
        Written out inline (no per-sequence result objects, kv_geometry's slot formula and the shared-tail rule of
        op_checks inline too): it runs for every running sequence every step, where a call per sequence costs."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"decode: {len(seq_ids)} sequences but {len(token_ids)} tokens")
        pool, bs, seqs = self.pool, self.block_size, self.seqs
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"decode: duplicate sequence ids in {list(seq_ids)}")
        for seq_id in seq_ids:  # all checked before any changes
            seq = seqs.get(seq_id)
            if seq is None or seq.cpu_table is not None:
                raise ValueError(f"decode: sequence {seq_id} is unknown or swapped out")
        result = DecodeResult([], [], [], [])
        for seq_id, token in zip(seq_ids, token_ids, strict=True):
            seq = seqs[seq_id]
            num_slots, table = seq.num_slots, seq.block_table
            if seq.num_computed != num_slots:
                seq.num_computed = num_slots
                if min(num_slots, len(seq.token_ids)) // bs > len(seq.block_hashes):
                    self._register_full_blocks(seq)
            offset, index = num_slots % bs, num_slots // bs
            if index < len(table) and (offset == 0 or table[index].ref_count == 1):
                block = table[index]  # its own tail, or its spare
            else:  # a new tail block, or a copy of a shared one (a sequence with a shared tail holds no spare)
                if pool.num_free_blocks == 0:
                    result.refused_seq_ids.append(seq_id)
                    continue
                block = pool.allocate()
                if offset:
                    shared = table.pop()
                    result.copies.append(BlockCopy(shared.block_id, block.block_id, offset))
                    pool.fill(block, offset)
                    pool.release(shared)
                    self.num_cow_copies += 1
                table.append(block)
                result.deltas.append(BlockTableDelta(seq_id, len(table) - 1, (block.block_id,)))
            if token != NO_TOKEN:
                seq.token_ids.append(token)
                if len(seq.block_hashes) < min(num_slots, len(seq.token_ids)) // bs:
                    self._register_full_blocks(seq)  # the late token completed a computed block
            seq.num_slots = num_slots + 1
            if offset + 1 > block.num_filled:
                pool.fill(block, offset + 1)
            result.slot_mapping.append(block.block_id * bs + offset)  # kv_geometry.slot
        return result

    def advance(self, seq_id: int, num_slots: int, append_token_ids: Sequence[int] = ()) -> None:
        """Catches up with decodes that the frontend placed itself in the sequence's private tail block or its
        spare (a slot there needs no new block, so no Decode): the num_slots slots after the reserved ones were
        used, every slot is computed (commit), and append_token_ids are its next tokens. No block changes hands:
        never refused."""
        seq, bs = self._resident(seq_id), self.block_size
        end, table = seq.num_slots + num_slots, seq.block_table
        num_known = len(seq.token_ids) + len(append_token_ids)
        problem = advance_problem(seq_id, table, seq.num_slots, num_slots, num_known, bs)
        if problem:
            raise ValueError(f"advance: {problem[1]}")
        seq.token_ids.extend(append_token_ids)
        if num_slots:
            for i in range(seq.num_slots // bs, blocks_for(end, bs)):
                self.pool.fill(table[i], min(bs, end - i * bs))
            seq.num_slots = end
        seq.num_computed = end
        self._register_full_blocks(seq)

    def can_spare(self) -> bool:
        return self._budget(admission=True) > 0

    def spare(self, seq_ids: Sequence[int]) -> list[BlockTableDelta | None]:
        """Gives each sequence one empty block past its tail while blocks above the watermark last (None: refused).
        A decode that enters it needs no block-manager op: the frontend places the slots of the tail and the spare
        itself and tells them in an Advance, so most steps need no call at all. A spare is never shared (a fork or
        a shared tail rules it out), never copied (a swap-out gives it back), and freed with its sequence."""
        bs = self.block_size
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"spare: duplicate sequence ids in {list(seq_ids)}")
        for seq_id in seq_ids:
            seq = self._resident(seq_id)
            problem = spare_problem(seq_id, seq.block_table, seq.num_slots, bs)
            if problem:
                raise ValueError(f"spare: {problem}")
        deltas: list[BlockTableDelta | None] = []
        for seq_id in seq_ids:
            if not self.can_spare():
                deltas.append(None)
                continue
            table = self.seqs[seq_id].block_table
            table.append(self.pool.allocate())
            deltas.append(BlockTableDelta(seq_id, len(table) - 1, (table[-1].block_id,)))
        return deltas

    def _grow(self, seq: SequenceState, num_tokens: int) -> Reservation:
        """Reserves slots for the next num_tokens known tokens; the caller has checked the budget."""
        bs, table, start = self.block_size, seq.block_table, seq.num_slots
        keep = len(table)
        copies: list[BlockCopy] = []
        if num_tokens > 0 and next_slot_is_shared(table, start, bs):  # the last block: a shared tail has no spare
            tail = start // bs
            shared, private = table[tail], self.pool.allocate()
            copies.append(BlockCopy(shared.block_id, private.block_id, start % bs))
            self.pool.fill(private, start % bs)
            self.pool.release(shared)
            table[tail], keep = private, tail
            self.num_cow_copies += 1
        end = start + num_tokens
        while len(table) * bs < end:
            table.append(self.pool.allocate())
        slot_mapping: list[int] = []
        for i in range(start // bs, blocks_for(end, bs)):  # per block: its slots are consecutive
            first, last = max(start - i * bs, 0), min(end - i * bs, bs)  # offsets of the reserved slots in it
            slot_mapping.extend(range(slot(table[i].block_id, first, bs), slot(table[i].block_id, last, bs)))
            self.pool.fill(table[i], last)
        seq.num_slots = end
        delta = None
        if keep != len(table):
            delta = BlockTableDelta(seq.seq_id, keep, tuple(b.block_id for b in table[keep:]))
        return Reservation(True, slot_mapping, copies, delta)

    def commit(self, seq_id: int, num_computed_tokens: int) -> None:
        """Records stored KV; each block that became full joins the prefix cache under its chained key."""
        seq = self._resident(seq_id)
        if not seq.num_computed <= num_computed_tokens <= seq.num_slots:
            raise ValueError(
                f"commit: sequence {seq_id} needs {seq.num_computed} <= num_computed_tokens <= "
                f"{seq.num_slots}, got {num_computed_tokens}"
            )
        seq.num_computed = num_computed_tokens
        self._register_full_blocks(seq)

    def free(self, seq_id: int) -> None:
        """Releases every block, tail first, so a cached prefix's head blocks are evicted last."""
        seq = self.get(seq_id)
        del self.seqs[seq_id]
        if seq.cpu_table is not None:
            self.num_swapped_sequences -= 1
            for cpu_id in reversed(seq.cpu_table):
                self.cpu_pool.release(cpu_id)
        for block in reversed(seq.block_table):
            self.pool.release(block)

    def swap_out(self, seq_ids: Iterable[int]) -> SwapResult:
        """Moves whole sequences to the CPU pool; a block shared among them is copied once."""
        seqs = self._distinct(seq_ids, swapped=False)
        src_slots: dict[int, int] = {}  # device block id -> valid slots
        for seq in seqs:
            for i, block in enumerate(seq.block_table[: blocks_for(seq.num_slots, self.block_size)]):  # not its spare
                filled = min(self.block_size, seq.num_slots - i * self.block_size)
                src_slots[block.block_id] = max(src_slots.get(block.block_id, 0), filled)
        if len(src_slots) > self.cpu_pool.num_free_blocks:
            return REFUSED_SWAP
        for seq in seqs:
            if self.has_spare(seq):  # empty: given back, not copied
                self.pool.release(seq.block_table.pop())
        dst = {block_id: self.cpu_pool.allocate() for block_id in src_slots}
        self.num_swapped_sequences += len(seqs)
        for seq in seqs:
            seq.cpu_table = [dst[block.block_id] for block in seq.block_table]
            for cpu_id in seq.cpu_table:
                self.cpu_pool.acquire(cpu_id)
            for block in reversed(seq.block_table):
                self.pool.release(block)
            seq.block_table = []
        for cpu_id in dst.values():
            self.cpu_pool.release(cpu_id)  # drop the allocation's own reference: holders keep theirs
        self.num_swapped_out_blocks += len(dst)
        copies = [BlockCopy(src, dst[src], slots) for src, slots in src_slots.items()]
        return SwapResult(True, copies, [BlockTableDelta(seq.seq_id, 0, ()) for seq in seqs])

    def swap_in(self, seq_ids: Iterable[int]) -> SwapResult:
        """Brings swapped sequences back, above the watermark. Full blocks whose content is still in the
        device prefix cache are reused from there; only the rest is copied back into fresh blocks."""
        seqs = self._distinct(seq_ids, swapped=True)
        src_slots: dict[int, int] = {}  # cpu block id -> valid slots
        reuse: dict[int, KVBlock] = {}  # cpu block id -> cached device block with the same content
        for seq in seqs:
            assert seq.cpu_table is not None
            for i, cpu_id in enumerate(seq.cpu_table):
                filled = min(self.block_size, seq.num_slots - i * self.block_size)
                src_slots[cpu_id] = max(src_slots.get(cpu_id, 0), filled)
                cached = self.pool.lookup(seq.block_hashes[i]) if i < len(seq.block_hashes) else None
                if cached is not None:
                    reuse[cpu_id] = cached
        to_copy = [cpu_id for cpu_id in src_slots if cpu_id not in reuse]
        revived = {block.block_id for block in reuse.values() if self.pool.in_free_queue(block)}  # may serve two
        needed = len(to_copy) + len(revived)
        if needed > self._budget(admission=True):
            return REFUSED_SWAP
        dst: dict[int, KVBlock] = {}
        for cpu_id, block in reuse.items():  # revive hits before allocating, so allocation cannot evict them
            self.pool.acquire(block)
            dst[cpu_id] = block
        for cpu_id in to_copy:
            dst[cpu_id] = self.pool.allocate()
            self.pool.fill(dst[cpu_id], src_slots[cpu_id])
        deltas = []
        for seq in seqs:
            assert seq.cpu_table is not None
            seq.block_table = [dst[cpu_id] for cpu_id in seq.cpu_table]
            for block in seq.block_table:
                self.pool.acquire(block)
            for cpu_id in reversed(seq.cpu_table):
                self.cpu_pool.release(cpu_id)
            seq.cpu_table = None
            self.num_swapped_sequences -= 1
            deltas.append(BlockTableDelta(seq.seq_id, 0, tuple(b.block_id for b in seq.block_table)))
        for block in dst.values():
            self.pool.release(block)  # drop the plan's own reference: holders keep theirs
        for seq in seqs:
            self._register_full_blocks(seq, rehash=True)
        self.num_swapped_in_blocks += len(to_copy)
        copies = [BlockCopy(cpu_id, dst[cpu_id].block_id, src_slots[cpu_id]) for cpu_id in to_copy]
        return SwapResult(True, copies, deltas)

    def reset(self) -> None:
        """Forgets every sequence and every cached block (the executor's KV tensors are gone)."""
        self.seqs.clear()
        self.num_swapped_sequences = 0
        self.pool.reset()
        self.cpu_pool.reset()

    def stats(self) -> BlockStats:
        pool, queries = self.pool, self.prefix_queries
        used = pool.num_blocks - pool.num_free_blocks
        return BlockStats(
            block_size=self.block_size,
            num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=used,
            num_cached_blocks=pool.num_cached_free,
            num_cpu_blocks=self.cpu_pool.num_blocks,
            num_free_cpu_blocks=self.cpu_pool.num_free_blocks,
            num_sequences=len(self.seqs),
            num_swapped_sequences=self.num_swapped_sequences,
            block_pressure=used / pool.num_blocks,
            block_pressure_with_cached=(used + pool.num_cached_free) / pool.num_blocks,
            kv_utilization=pool.num_filled_used / (used * self.block_size) if used else 0.0,
            prefix_cache_queries=queries,
            prefix_cache_hits=self.prefix_hits,
            prefix_hit_rate=self.prefix_hits / queries if queries else 0.0,
            num_cow_copies=self.num_cow_copies,
            num_swapped_out_blocks=self.num_swapped_out_blocks,
            num_swapped_in_blocks=self.num_swapped_in_blocks,
            num_evictions=pool.num_evictions,
            watermark=self.watermark,
            instance_id=self.instance_id,
        )

    def record_kv_events(self) -> KvEventRecorder:
        """From now on, every change of the prefix index is recorded (kv_events.py), in the epoch of this
        instance; the caller takes a batch after each step. Off by default: an in-process engine has no one to
        tell, and the list would only grow."""
        if self.pool.events is None:
            self.pool.events = KvEventRecorder(self.instance_id)
        return self.pool.events

    def kv_snapshot(self) -> KvSnapshot:
        """Every key the prefix index holds, after the last batch taken (record_kv_events first)."""
        assert self.pool.events is not None, "kv_snapshot without record_kv_events"
        return self.pool.events.snapshot(frozenset(self.pool.cached))

    def check_integrity(self) -> None:
        """Recomputes every invariant from scratch and asserts it (slow: for tests and soak runs)."""
        check_integrity(self.seqs, self.pool, self.cpu_pool, self.block_size, self.num_swapped_sequences)

    # ---- helpers -------------------------------------------------------------------------------------

    def _resident(self, seq_id: int) -> SequenceState:
        seq = self.get(seq_id)
        if seq.is_swapped:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return seq

    def _distinct(self, seq_ids: Iterable[int], swapped: bool) -> list[SequenceState]:
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"swap: duplicate sequence ids in {ids}")
        seqs = [self.get(seq_id) for seq_id in ids]
        for seq in seqs:
            if seq.is_swapped != swapped:
                state = "swapped out" if seq.is_swapped else "resident"
                raise ValueError(f"swap: sequence {seq.seq_id} is {state}")
        return seqs

    def _register_full_blocks(self, seq: SequenceState, rehash: bool = False) -> None:
        bs = self.block_size
        if rehash:  # after swap-in: the keys are known, the device blocks are new
            for block, key in zip(seq.block_table, seq.block_hashes, strict=False):
                self.pool.register(block, key)
            return
        for i in range(len(seq.block_hashes), min(seq.num_computed, len(seq.token_ids)) // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.namespace
            key = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            self.pool.register(seq.block_table[i], key)
            seq.block_hashes.append(key)

