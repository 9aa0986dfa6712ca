"""A brute-force reference model of the KV block allocator, for the stateful test.

Written from the specification (docs/block_manager.md "Block life cycle and cache identity", block_manager.proto
and executor.proto, the docstrings of BlockManager and apply_step), not from the implementation. The model never
hashes: a full block's identity is (namespace, every token up to the block's end), which is exactly what the
chained key H(parent, tokens) stands for. Reference counts are recounted from the block tables each time. The
manager chooses block ids; the model only checks that each choice is legal (the least recently useful free blocks,
in LRU order) and then follows the returned deltas. A block table covers the slots plus at most one spare: an empty,
private, never-hashed block past them, taken (above the watermark) by a Spare, used by the sequence's next slots
(a decode, a reservation or an Advance) and given back by a swap-out. Within one apply_step, from its first op that
may copy or swap, blocks (device and CPU) freed are held back until the step ends (`hold_back`, `end_step`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event
from kv_cache_sim import KV, NO_EFFECTS, Effects

from pagedserve.services.block_manager.contract import BlockCopy, BlockTableDelta

Key = tuple[bytes, tuple[int, ...]]  # (namespace, every token up to the end of the block)


@dataclass
class ModelSeq:
    namespace: bytes
    token_ids: list[int]
    num_slots: int = 0
    num_computed: int = 0
    table: list[int] = field(default_factory=list)  # device block ids, as the deltas told them
    cpu_table: list[int] | None = None  # cpu block ids, as the swap-out copies told them
    keys: list[Key] = field(default_factory=list)  # identities of the committed full blocks

    def kv(self, position: int) -> KV:
        return (self.namespace, tuple(self.token_ids[: position + 1]))

    def filled(self, index: int, block_size: int) -> int:
        return max(0, min(block_size, self.num_slots - index * block_size))  # 0: its spare

    def num_used_blocks(self, block_size: int) -> int:
        """The blocks its slots lie in: the table holds these, and then at most one spare."""
        return -(-self.num_slots // block_size)


class AllocatorModel:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int, watermark: float) -> None:
        self.num_blocks, self.block_size, self.num_cpu_blocks = num_blocks, block_size, num_cpu_blocks
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_blocks)  # admission must leave this many blocks free
        self.free_order = list(range(num_blocks))  # head: handed out next
        # In a step, from its first op that may copy or swap, freed blocks are held back (in order) and handed
        # out only after the step: the executor runs a step's copies and swaps before its writes.
        self.held: list[int] | None = None
        self.cpu_held: set[int] = set()
        self.block_key: dict[int, Key] = {}  # registered blocks (in use or free-but-cached)
        self.cached: dict[Key, int] = {}
        self.seqs: dict[int, ModelSeq] = {}
        self.prefix_queries = self.prefix_hits = self.cow_copies = 0
        self.swapped_out_blocks = self.swapped_in_blocks = self.evictions = 0

    # ---- brute-force queries -------------------------------------------------------------------------

    def ref_count(self, block_id: int) -> int:
        return sum(block_id in seq.table for seq in self.seqs.values())

    def cpu_ref_count(self, cpu_id: int) -> int:
        return sum(cpu_id in (seq.cpu_table or ()) for seq in self.seqs.values())

    def num_free_cpu_blocks(self) -> int:
        return sum(self.cpu_ref_count(c) == 0 and c not in self.cpu_held for c in range(self.num_cpu_blocks))

    def resident_ids(self) -> list[int]:
        return sorted(i for i, seq in self.seqs.items() if seq.cpu_table is None)

    def swapped_ids(self) -> list[int]:
        return sorted(i for i, seq in self.seqs.items() if seq.cpu_table is not None)

    def has_spare(self, seq_id: int) -> bool:
        seq = self.seqs[seq_id]
        return seq.cpu_table is None and len(seq.table) > seq.num_used_blocks(self.block_size)

    def local_room(self, seq_id: int) -> int:
        """Slots a frontend may place itself: the free ones of its tail block, if no other holds it, and of its
        spare (so a full tail with a spare has a block of room; a shared partial tail none)."""
        seq, bs = self.seqs[seq_id], self.block_size
        index = seq.num_slots // bs  # the block its next slot lies in
        if seq.cpu_table is not None or index >= len(seq.table) or self.ref_count(seq.table[index]) > 1:
            return 0
        return len(seq.table) * bs - seq.num_slots

    def can_have_spare(self, seq_id: int) -> bool:
        """Whether a Spare of this (resident) sequence is legal: none held yet, and no shared partial tail."""
        seq, bs = self.seqs[seq_id], self.block_size
        return (seq.cpu_table is None and not self.has_spare(seq_id)
                and (seq.num_slots % bs == 0 or self.ref_count(seq.table[-1]) == 1))

    def key(self, seq: ModelSeq, index: int) -> Key:
        return (seq.namespace, tuple(seq.token_ids[: (index + 1) * self.block_size]))

    def blocks_needed(self, seq: ModelSeq, num_tokens: int) -> tuple[int, bool]:
        """(new tail blocks past the table, its spare included, and whether the write goes into a shared partial
        tail: copy-on-write)."""
        bs = self.block_size
        num_new = max(0, -(-(seq.num_slots + num_tokens) // bs) - len(seq.table))
        cow = num_tokens > 0 and seq.num_slots % bs != 0 and self.ref_count(seq.table[seq.num_slots // bs]) > 1
        return num_new, cow

    def budget(self, admission: bool) -> int:
        return len(self.free_order) - (self.watermark_blocks if admission else 0)

    # ---- ops: each checks the manager's answer, then follows it --------------------------------------

    def create(self, seq_id: int, token_ids: list[int], namespace: bytes, num_cached: int,
               deltas: list[BlockTableDelta]) -> None:
        assert seq_id not in self.seqs
        seq = ModelSeq(namespace, list(token_ids))
        for i in range((len(token_ids) - 1) // self.block_size):  # the last token is always computed
            block_id = self.cached.get(self.key(seq, i))
            if block_id is None:
                break
            seq.table.append(block_id)
            seq.keys.append(self.key(seq, i))
        seq.num_slots = seq.num_computed = len(seq.table) * self.block_size
        assert num_cached == seq.num_computed, f"create {seq_id}: {num_cached} cached tokens, model {seq.num_computed}"
        assert deltas == [BlockTableDelta(seq_id, 0, tuple(seq.table))], f"create {seq_id}: {deltas}"
        for block_id in seq.table:  # a hit revives a free cached block
            self._revive(block_id)
        self.seqs[seq_id] = seq
        self.prefix_queries += len(token_ids)
        self.prefix_hits += seq.num_computed

    def admit(self, seq_id: int, token_ids: list[int], namespace: bytes, max_tokens: int, granted: bool,
              num_cached: int, num_tokens: int, slot_mapping: list[int], deltas: list[BlockTableDelta]) -> Effects:
        """Create plus the first chunk (at most max_tokens after the cached prefix) above the watermark, as one
        act: refused, nothing changes and the sequence does not exist."""
        probe = ModelSeq(namespace, list(token_ids))
        hits: list[int] = []
        for i in range((len(token_ids) - 1) // self.block_size):
            if self.key(probe, i) not in self.cached:
                break
            hits.append(self.cached[self.key(probe, i)])
        cached = len(hits) * self.block_size
        chunk = min(max_tokens, len(token_ids) - cached)
        held = self.held or []
        revived = sum(self.ref_count(b) == 0 and b not in held for b in hits)  # a held-back block is no free one
        new_blocks = -(-(cached + chunk) // self.block_size) - len(hits)
        budget = self.budget(admission=True)
        assert granted == (revived + new_blocks <= budget), (
            f"admit {seq_id}: granted={granted}, model: {revived} revived + {new_blocks} new, budget {budget}"
        )
        if not granted:
            assert (num_cached, num_tokens, slot_mapping, deltas) == (0, 0, [], []), "a refused admit returned work"
            return NO_EFFECTS
        assert num_tokens == chunk, f"admit {seq_id}: {num_tokens} tokens reserved, model {chunk}"
        assert len(deltas) == 1 and deltas[0].keep == 0 and tuple(deltas[0].append[: len(hits)]) == tuple(hits), (
            f"admit {seq_id}: delta {deltas}, cached blocks {hits}"
        )
        self.create(seq_id, token_ids, namespace, num_cached, [BlockTableDelta(seq_id, 0, tuple(hits))])
        grown = [BlockTableDelta(seq_id, len(hits), deltas[0].append[len(hits) :])] if new_blocks else []
        return self._grow(seq_id, chunk, slot_mapping, [], grown)

    def fork(self, parent_id: int, child_id: int, deltas: list[BlockTableDelta]) -> None:
        parent = self.seqs[parent_id]
        assert parent.cpu_table is None and child_id not in self.seqs
        assert not self.has_spare(parent_id), f"fork of {parent_id}, which holds a spare (a spare is never shared)"
        assert deltas == [BlockTableDelta(child_id, 0, tuple(parent.table))], f"fork {child_id}: {deltas}"
        self.seqs[child_id] = ModelSeq(parent.namespace, list(parent.token_ids), parent.num_slots,
                                       parent.num_computed, list(parent.table), None, list(parent.keys))

    def reserve(self, seq_id: int, num_tokens: int, append: list[int], admission: bool, granted: bool,
                slot_mapping: list[int], copies: list[BlockCopy], deltas: list[BlockTableDelta]) -> Effects:
        seq = self.seqs[seq_id]
        num_new, cow = self.blocks_needed(seq, num_tokens)
        expected = num_new + cow <= self.budget(admission)
        assert granted == expected, (
            f"reserve {seq_id}: granted={granted}, model: needs {num_new + cow}, budget {self.budget(admission)}"
        )
        if not granted:
            assert (slot_mapping, copies, deltas) == ([], [], []), "a refused reservation returned work"
            return NO_EFFECTS
        seq.token_ids.extend(append)
        return self._grow(seq_id, num_tokens, slot_mapping, copies, deltas)

    def decode(self, seq_ids: list[int], token_ids: list[int], skipped: set[int], slot_mapping: list[int],
               copies: list[BlockCopy], deltas: list[BlockTableDelta], refused_ids: list[int]) -> Effects:
        """Per sequence not in `skipped`: commit(num_slots), then reserve(1, [token]); answers concatenated."""
        refused = [i for i in seq_ids if i in skipped]
        effects: list[Effects] = []
        for seq_id, token in zip(seq_ids, token_ids, strict=True):
            if seq_id in skipped:
                continue
            seq = self.seqs[seq_id]
            self.commit(seq_id, seq.num_slots)
            num_new, cow = self.blocks_needed(seq, 1)
            if num_new + cow > self.budget(admission=False):
                refused.append(seq_id)
                continue
            seq.token_ids.append(token)
            slots, slot_mapping = slot_mapping[:1], slot_mapping[1:]
            cow_copies, copies = copies[: int(cow)], copies[int(cow) :]
            seq_deltas, deltas = deltas[: int(num_new + cow > 0)], deltas[int(num_new + cow > 0) :]
            effects.append(self._grow(seq_id, 1, slots, cow_copies, seq_deltas))
        assert (slot_mapping, copies, deltas) == ([], [], []), f"decode returned extra work {slot_mapping, copies}"
        assert refused_ids == refused, f"decode refused {refused_ids}, model {refused}"
        return Effects([b for e in effects for b in e.allocated], [c for e in effects for c in e.copies],
                       [w for e in effects for w in e.writes])

    def _grow(self, seq_id: int, num_tokens: int, slot_mapping: list[int], copies: list[BlockCopy],
              deltas: list[BlockTableDelta]) -> Effects:
        """A granted reservation of the next num_tokens known tokens: check the answer, follow it."""
        seq, bs = self.seqs[seq_id], self.block_size
        num_new, cow = self.blocks_needed(seq, num_tokens)
        old, start = list(seq.table), seq.num_slots
        if cow:  # a shared partial tail: the table ends with it (a sequence with one holds no spare)
            assert len(old) == seq.num_used_blocks(bs), f"reserve {seq_id}: a spare behind a shared tail {old}"
        keep = len(old) - cow
        allocated: list[int] = []
        if num_new + cow == 0:
            assert deltas == [], f"reserve {seq_id}: table unchanged but deltas {deltas}"
        else:
            assert len(deltas) == 1, f"reserve {seq_id}: deltas {deltas}"
            delta = deltas[0]
            assert (delta.seq_id, delta.keep, len(delta.append)) == (seq_id, keep, num_new + cow), delta
            allocated = list(delta.append)
            self._take(allocated)
            seq.table = old[:keep] + allocated
        if cow:
            assert copies == [BlockCopy(old[-1], seq.table[keep], start % bs)], f"copy-on-write {copies}"
            self.cow_copies += 1
            self._settle([old[-1]])
        else:
            assert copies == [], f"reserve {seq_id}: unexpected copies {copies}"
        assert len(slot_mapping) == num_tokens
        writes = []
        for i, slot in enumerate(slot_mapping):
            position = start + i
            block_id = seq.table[position // bs]
            assert slot == block_id * bs + position % bs, f"slot {slot} for position {position} of {seq.table}"
            assert self.ref_count(block_id) == 1, f"reserve {seq_id} writes into shared block {block_id}"
            assert block_id not in self.block_key, f"reserve {seq_id} writes into cached block {block_id}"
            writes.append((slot, seq.kv(position)))
        if num_tokens and len(old) > -(-start // bs) and start + num_tokens > (len(old) - 1) * bs:
            event(f"allocator: a reservation of {num_tokens} enters a spare{', and past it' if num_new else ''}")
        seq.num_slots = start + num_tokens
        return Effects(allocated, [("cow", c) for c in copies], writes)

    def advance(self, seq_id: int, num_slots: int, append: list[int]) -> Effects:
        """Slots the frontend placed itself in the sequence's own tail block and its spare, told late: they must
        lie in those blocks, which no other sequence holds; the executor wrote them when the frontend sent them
        (the writes returned), and every slot is then committed."""
        seq, bs = self.seqs[seq_id], self.block_size
        start = seq.num_slots
        assert seq.cpu_table is None and start + num_slots <= len(seq.table) * bs, (
            f"advance {seq_id} past its tail and spare")
        room = self.local_room(seq_id)
        assert num_slots <= room, f"advance {seq_id}: {num_slots} slots, room {room}"
        for p in range(start, start + num_slots):
            block_id = seq.table[p // bs]
            assert self.ref_count(block_id) == 1 and block_id not in self.block_key, (
                f"advance {seq_id}: block {block_id} is shared or cached")
        if len(seq.table) > seq.num_used_blocks(bs) and start + num_slots > (len(seq.table) - 1) * bs:
            event("allocator: an advance enters a spare" + (" from a partial tail" if start % bs else ""))
        seq.token_ids.extend(append)
        writes = [(seq.table[p // bs] * bs + p % bs, seq.kv(p)) for p in range(start, start + num_slots)]
        seq.num_slots = start + num_slots
        self.commit(seq_id, seq.num_slots)
        return Effects([], [], writes)

    def spare(self, seq_ids: list[int], deltas: list[BlockTableDelta], refused_ids: list[int]) -> Effects:
        """Per sequence in order: one empty block past its table, the head of the free queue, while free blocks
        above the watermark last; the others are refused, unchanged."""
        refused, allocated, rest = [], [], list(deltas)
        assert len(set(seq_ids)) == len(seq_ids), f"spare {seq_ids}: duplicates granted"
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            assert self.can_have_spare(seq_id), f"spare of {seq_id} granted: it holds one, or a shared partial tail"
            if self.budget(admission=True) <= 0:
                refused.append(seq_id)
                continue
            assert rest, f"spare of {seq_id} refused with {self.budget(admission=True)} blocks above the watermark"
            delta, rest = rest[0], rest[1:]
            assert (delta.seq_id, delta.keep, len(delta.append)) == (seq_id, len(seq.table), 1), (
                f"spare of {seq_id}: delta {delta}, table {seq.table}")
            self._take(list(delta.append))
            seq.table.append(delta.append[0])
            allocated.append(delta.append[0])
        assert rest == [], f"spare {seq_ids}: extra deltas {rest}"
        assert refused_ids == refused, f"spare refused {refused_ids}, model {refused}"
        return Effects(allocated, [], [])

    def commit(self, seq_id: int, num_computed: int) -> None:
        seq = self.seqs[seq_id]
        assert seq.cpu_table is None and seq.num_computed <= num_computed <= seq.num_slots
        seq.num_computed = num_computed
        for i in range(len(seq.keys), num_computed // self.block_size):
            seq.keys.append(self.key(seq, i))
            self._publish(seq.table[i], seq.keys[-1])

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        self._settle(list(reversed(seq.table)))  # tail first: a prefix's head blocks are evicted last
        self._settle_cpu(seq.cpu_table or [])

    def swap_out(self, seq_ids: list[int], granted: bool, copies: list[BlockCopy],
                 deltas: list[BlockTableDelta]) -> Effects:
        seqs = [self.seqs[i] for i in seq_ids]
        filled: dict[int, int] = {}
        for seq in seqs:
            assert seq.cpu_table is None
            for i, block_id in enumerate(seq.table[: seq.num_used_blocks(self.block_size)]):  # not a spare
                filled[block_id] = max(filled.get(block_id, 0), seq.filled(i, self.block_size))
        free_cpu = self.num_free_cpu_blocks()
        assert granted == (len(filled) <= free_cpu), f"swap_out {seq_ids}: {len(filled)} blocks, {free_cpu} free"
        if not granted:
            assert (copies, deltas) == ([], []), "a refused swap returned work"
            return NO_EFFECTS
        assert sorted((c.src, c.num_slots) for c in copies) == sorted(filled.items()), f"swap-out copies {copies}"
        dst = {c.src: c.dst for c in copies}
        assert len(set(dst.values())) == len(dst), f"two device blocks swapped into one cpu block: {copies}"
        assert all(self.cpu_ref_count(c) == 0 and c not in self.cpu_held for c in dst.values()), (
            f"swapped into a cpu block in use or freed earlier in this step: {copies}")
        assert sorted(deltas) == sorted(BlockTableDelta(i, 0, ()) for i in seq_ids), deltas
        for seq in seqs:  # spares go back first, empty (not copied)
            if len(seq.table) > seq.num_used_blocks(self.block_size):
                event("allocator: a swap-out gives a spare back")
                self._settle([seq.table.pop()])
        for seq in seqs:
            old, seq.table, seq.cpu_table = seq.table, [], [dst[b] for b in seq.table]
            self._settle(list(reversed(old)))
        self.swapped_out_blocks += len(filled)
        return Effects([], [("swap_out", c) for c in copies], [])

    def swap_in_plan(self, seq_ids: list[int]) -> tuple[dict[int, int], dict[int, int], set[int]]:
        """(valid slots of each cpu block, the cached device block reused for a cpu block, the reused blocks no
        table holds): a swap-in needs a fresh device block per cpu block not reused, and the revived ones."""
        filled: dict[int, int] = {}
        reuse: dict[int, int] = {}  # cpu id -> cached device block with that content
        for seq in (self.seqs[i] for i in seq_ids):
            assert seq.cpu_table is not None
            for i, cpu_id in enumerate(seq.cpu_table):
                filled[cpu_id] = max(filled.get(cpu_id, 0), seq.filled(i, self.block_size))
                if i < len(seq.keys) and seq.keys[i] in self.cached:
                    reuse[cpu_id] = self.cached[seq.keys[i]]
        return filled, reuse, {b for b in reuse.values() if self.ref_count(b) == 0}

    def swap_in(self, seq_ids: list[int], granted: bool, copies: list[BlockCopy],
                deltas: list[BlockTableDelta]) -> Effects:
        """Full computed blocks still in the device prefix cache are reused from there; the rest is copied."""
        seqs = [self.seqs[i] for i in seq_ids]
        filled, reuse, revived = self.swap_in_plan(seq_ids)
        to_copy = [c for c in filled if c not in reuse]
        held = self.held or []
        needed = len(to_copy) + sum(b not in held for b in revived)  # reviving a held-back block takes no free one
        budget = self.budget(admission=True)
        assert granted == (needed <= budget), f"swap_in {seq_ids}: needs {needed} blocks, budget {budget}"
        if not granted:
            assert (copies, deltas) == ([], []), "a refused swap returned work"
            return NO_EFFECTS
        assert sorted((c.src, c.num_slots) for c in copies) == sorted((c, filled[c]) for c in to_copy), (
            f"swap-in copies {copies}, model copies {[(c, filled[c]) for c in to_copy]} and reuses {reuse}"
        )
        for block_id in revived:
            self._revive(block_id)
        dst = {c.src: c.dst for c in copies}
        self._take(list(dst.values()))
        dst.update(reuse)
        expected = [BlockTableDelta(i, 0, tuple(dst[c] for c in s.cpu_table or ()))
                    for i, s in zip(seq_ids, seqs, strict=True)]
        assert sorted(deltas) == sorted(expected), f"swap-in deltas {deltas}, model {expected}"
        for seq in seqs:
            seq.table, seq.cpu_table = [dst[c] for c in seq.cpu_table or ()], None
        self._settle_cpu(list(filled))
        for seq in seqs:  # the keys are known: the new blocks rejoin the cache where no block holds them
            for block_id, key in zip(seq.table, seq.keys, strict=False):
                self._publish(block_id, key)
        self.swapped_in_blocks += len(to_copy)
        return Effects([c.dst for c in copies], [("swap_in", c) for c in copies], [])

    # ---- free queue and prefix index -----------------------------------------------------------------

    def _take(self, block_ids: list[int]) -> None:
        """The manager handed these out: they must be the least recently useful free blocks."""
        k = len(block_ids)
        assert len(set(block_ids)) == k, f"one block handed out twice: {block_ids}"
        assert set(block_ids) == set(self.free_order[:k]), (
            f"handed out {sorted(block_ids)}, but the first {k} of the free queue are {self.free_order[:k]}"
        )
        for block_id in block_ids:
            self.free_order.remove(block_id)
            key = self.block_key.pop(block_id, None)
            if key is not None:  # evicted only when handed out again
                del self.cached[key]
                self.evictions += 1

    def hold_back(self) -> None:
        self.held = []

    def end_step(self) -> None:
        held, self.held, self.cpu_held = self.held or [], None, set()
        self._settle(held)

    def _revive(self, block_id: int) -> None:
        if block_id in self.free_order:
            self.free_order.remove(block_id)
        elif self.held is not None and block_id in self.held:
            self.held.remove(block_id)

    def _settle(self, released: list[int]) -> None:
        """Blocks no table holds any more join the free queue (cached at the tail, the rest at the head), or,
        while a step holds freed blocks back, wait in the order freed."""
        for block_id in released:
            if self.ref_count(block_id) == 0 and block_id not in self.free_order + (self.held or []):
                if self.held is not None:
                    self.held.append(block_id)
                elif block_id in self.block_key:
                    self.free_order.append(block_id)
                else:
                    self.free_order.insert(0, block_id)

    def _settle_cpu(self, released: list[int]) -> None:
        if self.held is not None:
            self.cpu_held.update(c for c in released if self.cpu_ref_count(c) == 0)

    def _publish(self, block_id: int, key: Key) -> None:
        if block_id in self.block_key:
            assert self.block_key[block_id] == key, f"block {block_id} is {self.block_key[block_id]}, not {key}"
        elif key not in self.cached:  # first registration wins; a duplicate stays private
            self.block_key[block_id] = key
            self.cached[key] = block_id

    # ---- self-consistency and expectations -----------------------------------------------------------

    def check(self) -> None:
        bs = self.block_size
        free = [b for b in range(self.num_blocks) if self.ref_count(b) == 0]
        queued = self.free_order + (self.held or [])
        assert sorted(queued) == free and len(set(queued)) == len(queued)
        assert {b: k for k, b in self.cached.items()} == self.block_key
        for seq_id, seq in self.seqs.items():
            table = seq.table if seq.cpu_table is None else seq.cpu_table
            used = seq.num_used_blocks(bs)
            assert used <= len(table) <= used + (seq.cpu_table is None), (
                f"seq {seq_id}: {len(table)} blocks, {seq.num_slots} slots")
            assert len(set(table)) == len(table), f"seq {seq_id} holds a block twice: {table}"
            assert seq.num_computed <= seq.num_slots <= len(seq.token_ids)
            assert seq.keys == [self.key(seq, i) for i in range(seq.num_computed // bs)]
            if seq.cpu_table is not None:
                assert not seq.table
                continue
            if len(seq.table) > used:  # a spare: private, never cached, behind a private tail if partial
                assert self.ref_count(seq.table[-1]) == 1 and seq.table[-1] not in self.block_key, (
                    f"seq {seq_id}: its spare {seq.table[-1]} is shared or cached")
                assert seq.num_slots % bs == 0 or self.ref_count(seq.table[-2]) == 1, (
                    f"seq {seq_id} holds a spare behind a shared partial tail")
            for i, block_id in enumerate(seq.table):
                if block_id in self.block_key:  # cache identity: a registered block holds every holder's prefix
                    assert (i + 1) * bs <= seq.num_slots, f"seq {seq_id} may still write into cached {block_id}"
                    assert self.block_key[block_id] == self.key(seq, i), (
                        f"seq {seq_id} block {i} ({block_id}) is registered for another prefix or namespace"
                    )

    def expected_stats(self) -> dict[str, object]:
        bs, used = self.block_size, self.num_blocks - len(self.free_order)
        filled: dict[int, int] = {}
        for seq in self.seqs.values():
            for i, block_id in enumerate(seq.table):  # a spare: a used block, no slot filled
                filled[block_id] = max(filled.get(block_id, 0), seq.filled(i, bs))
        return {
            "block_size": bs, "num_total_blocks": self.num_blocks, "num_free_blocks": len(self.free_order),
            "num_used_blocks": used, "num_cached_blocks": sum(b in self.block_key for b in self.free_order),
            "num_cpu_blocks": self.num_cpu_blocks, "num_free_cpu_blocks": self.num_free_cpu_blocks(),
            "num_sequences": len(self.seqs), "num_swapped_sequences": len(self.swapped_ids()),
            "block_pressure": used / self.num_blocks,
            "block_pressure_with_cached": (used + sum(b in self.block_key for b in self.free_order)) / self.num_blocks,
            "kv_utilization": sum(filled.values()) / (used * bs) if used else 0.0,
            "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
            "prefix_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "num_cow_copies": self.cow_copies, "num_swapped_out_blocks": self.swapped_out_blocks,
            "num_swapped_in_blocks": self.swapped_in_blocks, "num_evictions": self.evictions,
            "watermark": self.watermark,
        }
