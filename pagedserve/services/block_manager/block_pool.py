"""Physical KV blocks, their O(1) LRU free queue, and the prefix-cache index.

A block with refcount 0 sits in the free queue. Blocks that hold a registered prefix are appended at
the tail (reused last, so cached prefixes survive as long as possible); blocks with nothing worth
keeping go to the head. A cached block is evicted (dropped from the index) only when `allocate` hands
it out again, so a prefix hit can revive any block still in the queue.

Every change of the index goes through `register`, `allocate` and `reset`, so those three tell the KV-event
recorder (common/kv_events.py), when one is attached: what a router learns of this pod's cache is exactly what
the index did, whichever path of the manager (admission, commit, decode, swap-in) caused it.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..common.kv_events import KvEventRecorder


class KVBlock:
    """One physical block of `block_size` token slots. Links are the free queue's, valid only while free."""

    __slots__ = ("block_hash", "block_id", "next_free", "num_filled", "prev_free", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.num_filled = 0  # leading slots holding a token (for the fullest holder)
        self.block_hash: bytes | None = None  # set while registered in the prefix index
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = " cached" if self.block_hash is not None else ""
        return f"KVBlock({self.block_id}, ref={self.ref_count}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop, push at either end, and removal from the middle.

    A hand-made list because `collections.deque` cannot remove an arbitrary element in O(1), and a
    prefix hit must pull a cached block out of the middle of the queue.
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: never handed out
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free blocks: callers must check num_free_blocks first")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVBlock | None, block: KVBlock) -> None:
        assert prev is not None and prev.next_free is not None
        assert block.prev_free is None and block.next_free is None, f"{block} is already in the free queue"
        block.prev_free, block.next_free = prev, prev.next_free
        prev.next_free.prev_free = block
        prev.next_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head (next to be handed out) to tail."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All device blocks: allocation, reference counts, and the content-addressed prefix index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}  # block hash -> block holding that content
        self.num_cached_free = 0  # free blocks still holding a registered prefix (evictable)
        self.num_filled_used = 0  # sum of num_filled over referenced blocks: KV utilization in O(1)
        self.num_evictions = 0
        # During a step, blocks released to refcount 0 wait here and are handed out only after it: the
        # executor applies a step's block moves before its writes, so a block must not be read (as a
        # copy or swap source) and rewritten (as a destination) within the same step.
        self._held_back: dict[int, KVBlock] | None = None
        self.events: KvEventRecorder | None = None  # the index's changes, while a publisher wants them

    def begin_step(self) -> None:
        self._held_back = {}

    def end_step(self) -> None:
        held_back, self._held_back = self._held_back or {}, None
        for block in held_back.values():
            self._to_free_queue(block)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def in_free_queue(self, block: KVBlock) -> bool:
        """Whether reviving this block takes one of the num_free_blocks (a held-back one does not)."""
        return block.ref_count == 0 and (self._held_back is None or block.block_id not in self._held_back)

    def allocate(self) -> KVBlock:
        """Hands out the least recently useful free block, evicting the prefix it held."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None
            self.num_cached_free -= 1
            self.num_evictions += 1
        block.ref_count = 1
        block.num_filled = 0
        return block

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def acquire(self, block: KVBlock) -> None:
        """Takes one more reference; revives the block if it was free (a prefix-cache hit)."""
        if block.ref_count == 0:
            if self._held_back is not None and block.block_id in self._held_back:
                del self._held_back[block.block_id]  # released earlier in this step, never queued
            else:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            self.num_filled_used += block.num_filled
        block.ref_count += 1

    def fill(self, block: KVBlock, num_filled: int) -> None:
        """Records that the block's first num_filled slots now hold tokens."""
        if num_filled > block.num_filled:
            self.num_filled_used += num_filled - block.num_filled
            block.num_filled = num_filled

    def release(self, block: KVBlock) -> None:
        assert block.ref_count > 0, f"{block} released more often than acquired"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.num_filled_used -= block.num_filled
            if self._held_back is not None:
                self._held_back[block.block_id] = block
            else:
                self._to_free_queue(block)

    def _to_free_queue(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self.free_queue.append(block)
            self.num_cached_free += 1
        else:
            self.free_queue.appendleft(block)

    def register(self, block: KVBlock, block_hash: bytes) -> bool:
        """Publishes a full, computed block under its content hash. False if that content is cached already."""
        assert block.ref_count > 0, f"{block} registered while free"
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash)
        return True

    def reset(self) -> None:
        """Every block free and unhashed, in id order; counters survive."""
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached.clear()
        self.num_cached_free = 0
        self.num_filled_used = 0
        if self.events is not None:
            self.events.cleared()
