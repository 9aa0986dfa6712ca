"""The router's per-pod view of the prefix caches, against the publishers' ground truth under lost, repeated
and restarted event streams."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.common.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventBatch,
    KvEventRecorder,
    KvSnapshot,
)
from pagedserve.services.router.pod_index import PodIndex

KEYS = [bytes([i]) * 16 for i in range(6)]
PODS = ["a", "b", "c"]


def test_recorder_numbers_batches_and_merges_runs() -> None:
    recorder = KvEventRecorder("e1")
    assert recorder.take_batch() == KvEventBatch("e1", 0)  # a heartbeat: nothing happened
    recorder.stored(KEYS[0])
    recorder.stored(KEYS[1])
    recorder.removed(KEYS[0])
    recorder.stored(KEYS[2])
    assert recorder.take_batch() == KvEventBatch(
        "e1", 1, (BlocksStored((KEYS[0], KEYS[1])), BlocksRemoved((KEYS[0],)), BlocksStored((KEYS[2],)))
    )
    recorder.stored(KEYS[3])
    recorder.cleared()
    recorder.stored(KEYS[4])
    assert recorder.take_batch() == KvEventBatch("e1", 2, (AllCleared(), BlocksStored((KEYS[4],))))
    assert recorder.snapshot(frozenset({KEYS[4]})) == KvSnapshot("e1", 2, frozenset({KEYS[4]}))
    recorder.stored(KEYS[5])
    with pytest.raises(AssertionError, match="mid-interval"):
        recorder.snapshot(frozenset())
    with pytest.raises(ValueError, match="sequence"):
        KvEventBatch("e1", -1)


def test_a_gap_drops_the_view_until_a_snapshot() -> None:
    index = PodIndex()
    index.add_pod("a")
    assert not index.in_sync("a") and index.heard_at("a") is None
    assert index.apply_batch("a", KvEventBatch("e", 1, (BlocksStored((KEYS[0],)),)), now=1.0) is False
    index.apply_snapshot("a", KvSnapshot("e", 3, frozenset(KEYS[:2])), now=2.0)
    assert index.longest_prefixes(KEYS[:3]) == {"a": 2} and index.heard_at("a") == 2.0
    assert index.apply_batch("a", KvEventBatch("e", 3), now=3.0)  # a heartbeat
    assert index.heard_at("a") == 3.0
    assert index.apply_batch("a", KvEventBatch("e", 5, (BlocksStored((KEYS[2],)),)), now=4.0) is False  # 4 lost
    index.apply_snapshot("a", KvSnapshot("e", 5, frozenset(KEYS[:2])), now=4.5)
    assert index.apply_batch("a", KvEventBatch("e", 6), now=4.6) is False  # a heartbeat after batch 6: it was lost
    assert not index.in_sync("a") and index.heard_at("a") is None
    assert index.longest_prefix("a", KEYS[:3]) == 0 and index.num_cached_blocks("a") == 0
    index.apply_snapshot("a", KvSnapshot("e2", 0), now=5.0)  # the pod restarted meanwhile
    assert index.apply_batch("a", KvEventBatch("e", 6), now=6.0) is False  # the old epoch's stream: a gap
    index.remove_pod("a")
    assert index.pods == [] and index.longest_prefixes(KEYS) == {}
    with pytest.raises(ValueError, match="unknown pod"):
        index.in_sync("a")


TRUTH = dict[tuple[str, int], frozenset[bytes]]  # (epoch, sequence) -> the publisher's keys after that batch


@dataclass
class Publisher:
    """One pod's ground truth: its index's keys, and the recorder that describes them batch by batch."""

    recorder: KvEventRecorder
    truth: TRUTH
    keys: set[bytes] = field(default_factory=set)
    sent: list[KvEventBatch] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.truth[(self.recorder.epoch, 0)] = frozenset()

    def flush(self) -> KvEventBatch:
        batch = self.recorder.take_batch()
        self.truth[(batch.epoch, batch.sequence)] = frozenset(self.keys)
        self.sent.append(batch)
        return batch


@dataclass
class Subscription:
    """What the subscriber should believe, by the ordering rules alone."""

    in_sync: bool = False
    epoch: str = ""
    sequence: int = 0


pods = st.sampled_from(PODS)
keys = st.sampled_from(KEYS)
actions = st.one_of(
    st.tuples(st.just("store"), pods, keys),
    st.tuples(st.just("remove"), pods, keys),
    st.tuples(st.just("clear"), pods, st.just(b"")),
    st.tuples(st.sampled_from(["deliver", "deliver", "deliver", "drop", "replay"]), pods, st.just(b"")),
    st.tuples(st.just("restart"), pods, st.just(b"")),
    st.tuples(st.just("resubscribe"), pods, st.just(b"")),
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(actions, max_size=60), queries=st.lists(st.lists(keys, max_size=5), min_size=1, max_size=4))
def test_index_matches_the_publishers(steps: list[tuple[str, str, bytes]], queries: list[list[bytes]]) -> None:
    index, truth = PodIndex(), TRUTH()
    publishers = {pod: Publisher(KvEventRecorder(f"{pod}-0"), truth) for pod in PODS}
    subscriptions = {pod: Subscription() for pod in PODS}
    for pod in PODS:
        index.add_pod(pod)
    for now, (action, pod, key) in enumerate(steps):
        publisher, subscription = publishers[pod], subscriptions[pod]
        if action == "store" and key not in publisher.keys:
            publisher.keys.add(key)
            publisher.recorder.stored(key)
        elif action == "remove" and key in publisher.keys:
            publisher.keys.discard(key)
            publisher.recorder.removed(key)
        elif action == "clear":
            publisher.keys.clear()
            publisher.recorder.cleared()
        elif action in ("deliver", "drop", "replay"):
            batch = publisher.flush()
            if action == "replay" and len(publisher.sent) > 1:
                batch = publisher.sent[-2]  # an old batch again; the new one is lost
            if action != "drop":
                next_sequence = subscription.sequence + (1 if batch.events else 0)  # a heartbeat repeats the last
                applied = subscription.in_sync and batch.epoch == subscription.epoch and (
                    batch.sequence <= next_sequence)
                assert index.apply_batch(pod, batch, float(now)) == applied
                subscription.in_sync = applied
                subscription.sequence = max(subscription.sequence, batch.sequence) if applied else 0
        elif action == "restart":  # a new block manager: empty, a new epoch; what was not taken is lost
            generation = int(publisher.recorder.epoch.rsplit("-", 1)[1]) + 1
            publishers[pod] = Publisher(KvEventRecorder(f"{pod}-{generation}"), truth)
        elif action == "resubscribe":
            publisher.flush()  # sent on the old subscription: the snapshot covers it
            snapshot = publisher.recorder.snapshot(frozenset(publisher.keys))
            index.apply_snapshot(pod, snapshot, float(now))
            subscriptions[pod] = Subscription(True, snapshot.epoch, snapshot.sequence)
        check_views(index, truth, subscriptions, queries)


def check_views(index: PodIndex, truth: TRUTH, subscriptions: dict[str, Subscription],
                queries: list[list[bytes]]) -> None:
    """Each pod's view is the truth after the last batch applied (a restarted pod's old view included, until
    its stream says so), or nothing while out of sync."""
    views = {pod: truth[(sub.epoch, sub.sequence)] if sub.in_sync else frozenset()
             for pod, sub in subscriptions.items()}
    for pod, view in views.items():
        assert index.in_sync(pod) == subscriptions[pod].in_sync == (index.heard_at(pod) is not None)
        assert index.num_cached_blocks(pod) == len(view)
        assert all(index.longest_prefix(pod, [key]) == (key in view) for key in KEYS)
    for query in queries:
        expected = {pod: next((i for i, key in enumerate(query) if key not in view), len(query))
                    for pod, view in views.items()}
        assert index.longest_prefixes(query) == expected
        assert all(index.longest_prefix(pod, query) == expected[pod] for pod in PODS)
