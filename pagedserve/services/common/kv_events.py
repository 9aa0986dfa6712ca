"""KV events: what a pod publishes about its prefix cache, so that a router knows which blocks each pod holds.

The contract between a pod's block manager (the publisher) and every router (the subscribers). Pure data: the
proto messages mirror these types one to one, and both sides convert at their edge.

What the keys are: a block's chained hash (`block_manager/prefix_hash.block_hash`), the very key the block
manager's prefix index matches on. It already covers the model identity and the tenant's salt through the
chain's root (the cache namespace), so an event names no tenant and no tokens.

When the publisher emits what, mirroring the block pool's index:
- `BlocksStored`: a full, computed block was registered under a key the index did not hold (`register`
  returned True; a second block with the same content is not cached and emits nothing).
- `BlocksRemoved`: a cached block was handed out again (`allocate` evicted its key).
- `AllCleared`: the index was emptied (`reset`: the executor's KV tensors are gone).
A key held by the index is cached whether its block is in use or free: both are hits for a new prompt.

Ordering rules (the subscriber's `pod_index.PodIndex` relies on each):
1. Events are applied in the order given, batch after batch; within a batch, in tuple order. A key may be
   stored, removed and stored again within one batch.
2. Each batch carries `sequence`, one more than the previous batch of the same `epoch`; the first batch of
   an epoch has sequence 1. A subscriber that last applied sequence s applies a batch with sequence s + 1,
   ignores one with sequence <= s (a duplicate), and on any other (a gap: batches were lost) stops
   trusting its view of the pod until the next snapshot.
3. A batch with no events and the current sequence is a heartbeat: it says the stream is alive and nothing
   changed. Its sequence is that of the last batch sent (a batch with events is never empty), so a subscriber
   that last applied s and hears a heartbeat with s + 1 lost that batch: a gap, as in rule 2. The publisher
   sends one at least every `HEARTBEAT_S`, so a subscriber that heard nothing for `STALE_AFTER_S` treats the
   pod's view as stale.
4. `epoch` names one life of the publisher's index (the block manager's `instance_id`). A restart starts a
   new epoch at sequence 0 with an empty index: a batch of an epoch other than the subscriber's is a gap.
5. A subscription starts with a `KvSnapshot`: the whole set of cached keys after every batch up to and
   including its `sequence` (0: none yet) in its `epoch`. The batches that follow it start at sequence + 1.
   A subscriber that found a gap subscribes again and replaces its view by the new snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEARTBEAT_S = 1.0  # an idle publisher's longest silence
STALE_AFTER_S = 5.0  # a subscriber's view of a silent pod is stale after this (several missed heartbeats)


@dataclass(frozen=True)
class BlocksStored:
    """Keys that joined the pod's prefix index, in the order they were registered."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class BlocksRemoved:
    """Keys that left the pod's prefix index (their blocks were evicted for new content)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllCleared:
    """The pod's prefix index was emptied: every key it held is gone."""


KvEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass(frozen=True)
class KvEventBatch:
    """The events of one publishing interval (typically one scheduler step), numbered for gap detection."""

    epoch: str
    sequence: int
    events: tuple[KvEvent, ...] = ()

    def __post_init__(self) -> None:
        if self.sequence < 0:
            raise ValueError(f"KvEventBatch.sequence must be >= 0, got {self.sequence}")


@dataclass(frozen=True)
class KvSnapshot:
    """Every key of the pod's prefix index after batch `sequence` of `epoch` (0: before any batch)."""

    epoch: str
    sequence: int
    block_hashes: frozenset[bytes] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.sequence < 0:
            raise ValueError(f"KvSnapshot.sequence must be >= 0, got {self.sequence}")


class KvEventRecorder:
    """The publisher's side of the rules above: collects the events of an interval and numbers the batches.

    The block manager calls `stored` / `removed` / `cleared` as its index changes, and `take_batch` once per
    interval; `snapshot` gives a new subscriber the state the last batch left (the caller passes the keys
    its index holds now, which the events taken so far describe)."""

    def __init__(self, epoch: str) -> None:
        self.epoch = epoch
        self.sequence = 0  # of the last batch taken
        # the interval's runs, each one event's kind (None: the clear) and keys: a list grows in O(1) a key, and
        # becomes the event's tuple at take_batch
        self._runs: list[tuple[type[BlocksStored] | type[BlocksRemoved] | None, list[bytes]]] = []

    def stored(self, block_hash: bytes) -> None:
        self._append(BlocksStored, block_hash)

    def removed(self, block_hash: bytes) -> None:
        self._append(BlocksRemoved, block_hash)

    def cleared(self) -> None:
        """Everything recorded before in this interval is moot: the batch starts over with the clear."""
        self._runs = [(None, [])]

    def _append(self, kind: type[BlocksStored] | type[BlocksRemoved], block_hash: bytes) -> None:
        if self._runs and self._runs[-1][0] is kind:  # runs of one kind share an event: one message per run
            self._runs[-1][1].append(block_hash)
        else:
            self._runs.append((kind, [block_hash]))

    def take_batch(self) -> KvEventBatch:
        """The interval's batch (numbered) and a fresh interval; with nothing recorded, a heartbeat."""
        if not self._runs:
            return KvEventBatch(self.epoch, self.sequence)
        self.sequence += 1
        events = tuple(AllCleared() if kind is None else kind(tuple(keys)) for kind, keys in self._runs)
        self._runs = []
        return KvEventBatch(self.epoch, self.sequence, events)

    def snapshot(self, cached_hashes: frozenset[bytes]) -> KvSnapshot:
        """The snapshot for a new subscriber; call it between intervals (nothing recorded and untaken)."""
        assert not self._runs, "snapshot taken mid-interval: take_batch first, or the events would be lost"
        return KvSnapshot(self.epoch, self.sequence, cached_hashes)
