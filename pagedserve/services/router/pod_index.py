"""The router's view of every pod's prefix cache, built from the pods' own KV events (common/kv_events.py).

Per pod: the set of keys its block manager holds, the epoch and sequence of the last batch applied, whether
the view is in sync, and when the pod was last heard from. Across pods: key -> pods holding it, so that a
prompt's longest cached prefix on every pod costs one dict lookup per prompt block (plus a set intersection
over the pods still matching), never a scan of a pod's cache.

A pod is out of sync from the moment it is added, and again after a gap in its batches (see the ordering
rules of kv_events): its keys are dropped at once, since any of them may have been evicted in a lost batch,
and it matches nothing until a snapshot replaces its view. A view is never guessed from routing history.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..common.kv_events import AllCleared, BlocksRemoved, BlocksStored, KvEventBatch, KvSnapshot


@dataclass
class _PodView:
    block_hashes: set[bytes] = field(default_factory=set)
    epoch: str | None = None
    sequence: int = 0  # of the last batch applied (or the snapshot's)
    in_sync: bool = False
    heard_at: float | None = None  # when the view was last confirmed; None while out of sync


class PodIndex:
    def __init__(self) -> None:
        self._views: dict[str, _PodView] = {}
        self._holders: dict[bytes, set[str]] = {}  # key -> in-sync pods whose cache holds it

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def pods(self) -> list[str]:
        return list(self._views)

    def in_sync(self, pod: str) -> bool:
        return self._view(pod).in_sync

    def heard_at(self, pod: str) -> float | None:
        """When the pod's view was last confirmed by a snapshot, a batch or a heartbeat; None while out of sync."""
        return self._view(pod).heard_at

    def num_cached_blocks(self, pod: str) -> int:
        return len(self._view(pod).block_hashes)

    def longest_prefix(self, pod: str, block_hashes: Sequence[bytes]) -> int:
        """The number of leading keys of block_hashes that the pod holds (0 while out of sync)."""
        held = self._view(pod).block_hashes
        for depth, key in enumerate(block_hashes):
            if key not in held:
                return depth
        return len(block_hashes)

    def longest_prefixes(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """longest_prefix for every pod at once: one lookup per key, over the pods still matching."""
        depths = dict.fromkeys(self._views, 0)
        matching: set[str] | None = None
        for depth, key in enumerate(block_hashes):
            holders = self._holders.get(key, set())
            still = set(holders) if matching is None else matching & holders
            for pod in (matching or set()) - still:
                depths[pod] = depth
            matching = still
            if not matching:
                return depths
        for pod in matching or ():
            depths[pod] = len(block_hashes)
        return depths

    # ---- acts ----------------------------------------------------------------------------------------

    def add_pod(self, pod: str) -> None:
        """Starts tracking a pod, out of sync until its first snapshot. Adding a known pod changes nothing."""
        self._views.setdefault(pod, _PodView())

    def remove_pod(self, pod: str) -> None:
        """Forgets the pod and its keys (it left the fleet)."""
        self._drop_keys(pod, self._view(pod).block_hashes)
        del self._views[pod]

    def apply_snapshot(self, pod: str, snapshot: KvSnapshot, now: float) -> None:
        """Replaces the pod's view by the snapshot's keys: in sync at its epoch and sequence."""
        view = self._view(pod)
        self._drop_keys(pod, view.block_hashes)
        self._add_keys(pod, snapshot.block_hashes)
        view.epoch, view.sequence, view.in_sync, view.heard_at = snapshot.epoch, snapshot.sequence, True, now

    def apply_batch(self, pod: str, batch: KvEventBatch, now: float) -> bool:
        """Applies the next batch, or ignores a duplicate or heartbeat (both confirm the view). False when the
        view is out of sync, already or through this batch's gap: the caller must resubscribe for a snapshot. A
        heartbeat carries the sequence of the publisher's last batch, so one ahead of the view is a gap too (the
        batch it names was lost), even at sequence + 1."""
        view = self._view(pod)
        if not view.in_sync:
            return False
        heartbeat_ahead = not batch.events and batch.sequence > view.sequence  # it names a batch we never had
        if batch.epoch != view.epoch or batch.sequence > view.sequence + 1 or heartbeat_ahead:
            self.mark_out_of_sync(pod)
            return False
        view.heard_at = now
        if batch.sequence <= view.sequence:
            return True
        for event in batch.events:
            if isinstance(event, BlocksStored):
                self._add_keys(pod, event.block_hashes)
            elif isinstance(event, BlocksRemoved):
                self._drop_keys(pod, event.block_hashes)
            else:
                assert isinstance(event, AllCleared), f"unknown KV event {event!r}"
                self._drop_keys(pod, view.block_hashes)
        view.sequence = batch.sequence
        return True

    def mark_out_of_sync(self, pod: str) -> None:
        """Drops the pod's view (a gap, or its event stream broke): it matches nothing until a snapshot."""
        view = self._view(pod)
        self._drop_keys(pod, view.block_hashes)
        view.in_sync, view.heard_at = False, None

    # ---- helpers -------------------------------------------------------------------------------------

    def _view(self, pod: str) -> _PodView:
        view = self._views.get(pod)
        if view is None:
            raise ValueError(f"unknown pod {pod!r}")
        return view

    def _add_keys(self, pod: str, keys: Iterable[bytes]) -> None:
        held = self._views[pod].block_hashes
        for key in keys:
            if key not in held:  # stored twice: the publisher's rules rule it out; harmless here
                held.add(key)
                self._holders.setdefault(key, set()).add(pod)

    def _drop_keys(self, pod: str, keys: Iterable[bytes]) -> None:
        held = self._views[pod].block_hashes
        for key in list(keys):  # keys may be `held` itself
            if key in held:
                held.discard(key)
                holders = self._holders[key]
                holders.discard(pod)
                if not holders:
                    del self._holders[key]
