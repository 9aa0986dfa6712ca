"""The router's fleet bookkeeping: identities, phases, availability, the requests in flight, and why no pod."""

from __future__ import annotations

import pytest

from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.common.errors import NotReady
from pagedserve.services.common.kv_events import BlocksStored, KvEventBatch, KvSnapshot
from pagedserve.services.router.choice import Chooser
from pagedserve.services.router.fleet import Fleet, PodPhase
from pagedserve.services.router.load import RECENT_HALF_LIFE_S, InFlight, LoadReport
from pagedserve.services.router.prompt_blocks import prompt_blocks

IDENTITY = CacheIdentity("sha256:m", "tok", "{{ chat }}", "bfloat16", 4)
PODS = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
KEYS_OF = prompt_blocks(list(range(1, 18)), IDENTITY.namespace(b""), 4)  # 17 tokens: 4 reusable blocks


def idle(at: float) -> LoadReport:
    return LoadReport(0, 0, 0, 100, at)


def synced(fleet: Fleet, pod: str, keys: frozenset[bytes] = frozenset(), now: float = 0.0) -> None:
    assert fleet.identify(pod, "m", IDENTITY) == ""
    assert fleet.apply(pod, KvSnapshot("e-" + pod, 0, keys), idle(now), now)


def test_a_pod_of_another_identity_is_refused_with_the_fields_named() -> None:
    fleet = Fleet(PODS, Chooser())
    synced(fleet, PODS[0])
    other = CacheIdentity("sha256:other", "tok", "{{ chat }}", "float16", 4)
    refusal = fleet.identify(PODS[1], "other-model", other)
    assert refusal == ("another cache identity than the fleet's: model_digest: 'sha256:m' here, 'sha256:other'"
                       " there; kv_dtype: 'bfloat16' here, 'float16' there")
    assert fleet.pods[PODS[1]].phase == PodPhase.REFUSED and fleet.pods[PODS[1]].reason == refusal
    assert fleet.routable() == [PODS[0]]
    assert fleet.identify(PODS[2], "m", None) == fleet.pods[PODS[2]].reason == (
        "its ListModels gives no cache identity (a pod older than this router?)")
    assert fleet.identity == IDENTITY  # the first accepted pod's, whatever came later


def test_routable_from_the_first_snapshot_until_a_failure() -> None:
    changes: list[bool] = []
    fleet = Fleet(PODS[:2], Chooser(), on_availability=changes.append)
    assert fleet.identify(PODS[0], "m", IDENTITY) == ""
    assert not fleet.available and fleet.pods[PODS[0]].phase == PodPhase.CONNECTING  # identified, no snapshot
    fleet.apply(PODS[0], KvSnapshot("e", 0, frozenset(KEYS_OF.block_hashes)), idle(1.0), 1.0)
    assert fleet.available and changes == [True]
    # a gap: out of sync (no prefix trusted), but the connection is live: still routable
    assert not fleet.apply(PODS[0], KvEventBatch("e", 5, (BlocksStored((b"k" * 16,)),)), idle(2.0), 2.0)
    assert fleet.pods[PODS[0]].phase == PodPhase.RESYNCING and fleet.routable() == [PODS[0]]
    assert fleet.index.longest_prefix(PODS[0], KEYS_OF.block_hashes) == 0
    fleet.down(PODS[0], "UNAVAILABLE: Socket closed")
    assert not fleet.available and changes == [True, False]
    assert fleet.why_none() == ("no pod to route to: 10.0.0.1:50051 down (UNAVAILABLE: Socket closed);"
                                " 10.0.0.2:50051 not in sync yet")
    with pytest.raises(NotReady, match=r"10\.0\.0\.1:50051 down"):
        fleet.choose(KEYS_OF, 3.0)
    # it answers again: identified, connecting, then in sync
    assert fleet.identify(PODS[0], "m", IDENTITY) == "" and fleet.pods[PODS[0]].phase == PodPhase.CONNECTING
    fleet.apply(PODS[0], KvSnapshot("e2", 0), idle(4.0), 4.0)
    assert fleet.routable() == [PODS[0]] and changes == [True, False, True]
    # a batch before any snapshot (against the contract) makes no pod routable
    assert fleet.identify(PODS[1], "m", IDENTITY) == ""
    assert not fleet.apply(PODS[1], KvEventBatch("e", 1, (BlocksStored((b"k" * 16,)),)), idle(5.0), 5.0)
    assert fleet.pods[PODS[1]].phase == PodPhase.CONNECTING and fleet.routable() == [PODS[0]]


def test_no_endpoints_and_excluded_pods_are_named() -> None:
    with pytest.raises(NotReady, match=r"^no pod to route to: the router has no endpoints \(--endpoints is empty\)$"):
        Fleet([], Chooser()).choose(KEYS_OF, 0.0)
    fleet = Fleet(PODS[:1], Chooser())
    synced(fleet, PODS[0])
    assert fleet.choose(KEYS_OF, 0.0).pod == PODS[0]
    with pytest.raises(NotReady, match=r"^no pod to route to: 10\.0\.0\.1:50051 failed this request$"):
        fleet.choose(KEYS_OF, 0.0, exclude=[PODS[0]])


def test_kv_aware_picks_the_holder_and_predicts_its_hit() -> None:
    fleet = Fleet(PODS, Chooser("kv-aware"))
    for pod in PODS:
        synced(fleet, pod, frozenset(KEYS_OF.block_hashes[:3]) if pod == PODS[1] else frozenset())
    choice = fleet.choose(KEYS_OF, 0.5)
    assert choice.pod == PODS[1] and choice.predicted_cached_tokens == 12


def test_requests_in_flight_count_as_unreported_until_the_next_report() -> None:
    fleet = Fleet(PODS[:1], Chooser())
    synced(fleet, PODS[0], now=1.0)
    first = fleet.send(PODS[0], 40, now=2.0)
    second = fleet.send(PODS[0], 8, now=3.0)
    assert fleet.in_flight(PODS[0]) == InFlight(2, 48, 2, 48)
    fleet.apply(PODS[0], KvEventBatch("e-" + PODS[0], 0), LoadReport(1, 1, 10, 100, 2.5), 2.5)  # a heartbeat
    assert fleet.in_flight(PODS[0]) == InFlight(2, 48, 1, 8)  # the first is in the report now
    fleet.finish(first)
    fleet.finish(first)  # twice: harmless
    assert fleet.in_flight(PODS[0]) == InFlight(1, 8, 1, 8)
    fleet.finish(second)
    assert fleet.in_flight(PODS[0]) == InFlight()


def test_recent_requests_fade_with_their_half_life_and_outlive_the_requests() -> None:
    fleet = Fleet(PODS[:1], Chooser())
    synced(fleet, PODS[0])
    assert fleet.in_flight(PODS[0], now=0.0).recent_requests == 0.0
    fleet.finish(fleet.send(PODS[0], 4, now=0.0))
    fleet.send(PODS[0], 4, now=RECENT_HALF_LIFE_S)  # the first counts half by now
    assert fleet.in_flight(PODS[0], now=RECENT_HALF_LIFE_S).recent_requests == pytest.approx(1.5)
    assert fleet.in_flight(PODS[0], now=3 * RECENT_HALF_LIFE_S).recent_requests == pytest.approx(0.375)


def test_endpoints_must_be_distinct() -> None:
    with pytest.raises(ValueError, match="endpoints must be distinct"):
        Fleet([PODS[0], PODS[0]], Chooser())
