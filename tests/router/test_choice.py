"""Picking a pod: the policies' properties, on single decisions and on traces through a simulated fleet."""

from __future__ import annotations

import pytest
from fleet_sim import hit_rate, max_over_mean, run_fleet
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.common.errors import NotReady
from pagedserve.services.router import choice
from pagedserve.services.router.choice import NO_PODS, POLICIES, Chooser
from pagedserve.services.router.load import InFlight, LoadReport, PodState
from pagedserve.services.router.prompt_blocks import PromptBlocks

NOW = 100.0
PROMPT = PromptBlocks(tuple(bytes([i]) * 16 for i in range(8)), 8 * 16 + 3, 16)  # 9 blocks, 8 reusable
SKEWED_TENANTS = [1 / (rank + 1) ** 1.2 for rank in range(8)]  # Zipf: the first tenant sends ~1/3 of the requests


def pod(name: str, cached: int = 0, running: int = 0, waiting: int = 0, used: int = 0, age: float | None = 0.0,
        inflight: InFlight | None = None) -> PodState:
    report = None if age is None else LoadReport(running, waiting, used, 1000, NOW - age)
    return PodState(name, cached, report, None if age is None else NOW - age, inflight or InFlight())


def test_kv_aware_sends_to_the_prefix_holder_at_equal_load() -> None:
    pods = [pod("a", running=3, used=30), pod("b", cached=8, running=3, used=30), pod("c", running=3, used=30)]
    picked = Chooser().choose(PROMPT, pods, NOW)
    assert picked.pod == "b" and picked.predicted_cached_tokens == 128
    assert picked.cost == 4 * 1 + 30 + 1 and picked.reason == "kv-aware: cost 35.0 blocks, 8 of 9 prompt blocks cached"


def test_a_cached_prefix_is_not_trusted_from_a_silent_event_stream() -> None:
    silent = PodState("b", 8, LoadReport(0, 0, 0, 1000, NOW), NOW - 60.0)
    picked = Chooser().choose(PROMPT, [pod("a"), silent], NOW)
    assert picked.predicted_cached_tokens == 0 and picked.cost == 4 * 9 + 9


def test_the_guard_names_the_pod_it_skips() -> None:
    pods = [pod("a", cached=8, running=9, used=17), pod("b", running=1, used=9), pod("c", running=2, used=18)]
    picked = Chooser().choose(PROMPT, pods, NOW)
    assert picked.pod == "b"
    assert picked.reason.endswith("(guard: a runs 9 sequences, over 1.25 x the mean + 2)")


def test_the_guard_spreads_a_pod_that_took_more_than_its_share_of_recent_requests() -> None:
    """At light load nothing runs long enough for the sequence guard: the holder of a busy tenant's prefix is left
    out once this router sent it more than 1.4 x the mean of recent requests + 2, and takes it again below."""
    def fleet(recent_a: float) -> list[PodState]:
        return [pod("a", cached=8, inflight=InFlight(recent_requests=recent_a)),
                pod("b", inflight=InFlight(recent_requests=10.0)), pod("c", inflight=InFlight(recent_requests=10.0))]

    assert Chooser().choose(PROMPT, fleet(21.0), NOW).pod == "a"  # limit 1.4 x 41 / 3 + 2 = 21.13: not over
    skipped = Chooser().choose(PROMPT, fleet(30.0), NOW)  # limit 1.4 x 50 / 3 + 2 = 25.3
    assert skipped.pod == "b" and skipped.reason.endswith(
        "(guard: a took 30.0 recent requests, over 1.4 x the mean + 2)")


def test_requests_sent_since_the_report_count() -> None:
    """Two requests between reports do not both land on the pod that looked idlest."""
    chooser = Chooser("least-load")
    assert chooser.choose(PROMPT, [pod("a", running=1), pod("b", running=2)], NOW).pod == "a"
    sent = InFlight(requests=2, new_tokens=262, unreported_requests=2, unreported_new_tokens=262)
    assert chooser.choose(PROMPT, [pod("a", running=1, inflight=sent), pod("b", running=2)], NOW).pod == "b"


def test_no_pods_and_no_fresh_pods() -> None:
    with pytest.raises(NotReady, match=NO_PODS):
        Chooser().choose(PROMPT, [], NOW)
    with pytest.raises(ValueError, match="policy must be one of kv-aware, least-load, round-robin, random"):
        Chooser("shortest-queue")
    stale = [pod("a", age=None, inflight=InFlight(requests=2)), pod("b", age=60.0, inflight=InFlight(requests=1))]
    picked = Chooser().choose(PROMPT, stale, NOW)
    assert (picked.pod, picked.reason) == ("b", "no fresh load report: fewest requests in flight from here")


def test_random_is_seedable_and_round_robin_takes_turns() -> None:
    pods = [pod(name) for name in "abcd"]
    picks = [[Chooser("random", seed=7).choose(PROMPT, pods, NOW).pod for _ in range(1)] for _ in range(3)]
    assert picks[0] == picks[1] == picks[2]
    seeded = Chooser("random", seed=7)
    assert len({seeded.choose(PROMPT, pods, NOW).pod for _ in range(40)}) == 4
    turns = Chooser("round-robin")
    assert [turns.choose(PROMPT, pods, NOW).pod for _ in range(6)] == ["a", "b", "c", "d", "a", "b"]
    assert turns.choose(PROMPT, [pod("a"), pod("b"), pod("e")], NOW).pod == "e"  # c and d left: the next name


pod_states = st.builds(
    lambda cached, running, waiting, used, age, sent: (cached, running, waiting, used, age, sent),
    st.integers(0, 8), st.integers(0, 20), st.integers(0, 20), st.integers(0, 1000),
    st.one_of(st.none(), st.floats(0.0, 30.0)), st.integers(0, 10),
)


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(POLICIES), states=st.lists(pod_states, min_size=1, max_size=6), fresh=st.integers(0, 5))
def test_never_a_stale_pod_while_a_fresh_one_exists(
    policy: str, states: list[tuple[int, int, int, int, float | None, int]], fresh: int
) -> None:
    pods = [pod(f"p{i}", cached, running, waiting, used, age, InFlight(requests=sent))
            for i, (cached, running, waiting, used, age, sent) in enumerate(states)]
    fresh_pod = pods[fresh % len(pods)]
    pods[fresh % len(pods)] = PodState(fresh_pod.name, 0, LoadReport(20, 20, 1000, 1000, NOW), NOW)  # busy, but fresh
    chooser = Chooser(policy, seed=0)
    picked = chooser.choose(PROMPT, pods, NOW)
    chosen = next(p for p in pods if p.name == picked.pod)
    assert chosen.load is not None and NOW - chosen.load.reported_at <= chooser.max_report_age_s
    assert picked.predicted_cached_tokens == PROMPT.cached_tokens(chosen.cached_blocks)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_spreads_a_skewed_trace(policy: str) -> None:
    pods = run_fleet(Chooser(policy, seed=3), num_pods=4, tenant_weights=SKEWED_TENANTS, rate=1.0, ticks=600)
    assert max_over_mean(pods) <= (1.5 if policy == "kv-aware" else 1.1), [p.served for p in pods]


def test_kv_aware_keeps_tenants_on_their_pods() -> None:
    kv_aware = run_fleet(Chooser("kv-aware"), num_pods=4, tenant_weights=SKEWED_TENANTS, rate=1.0, ticks=600)
    round_robin = run_fleet(Chooser("round-robin"), num_pods=4, tenant_weights=SKEWED_TENANTS, rate=1.0, ticks=600)
    assert hit_rate(kv_aware) >= hit_rate(round_robin) + 0.2


def test_the_guard_stops_a_death_spiral(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request shares one long prefix: its holder stays cheapest by cost alone, so without the guard
    it takes the whole trace; with it, the prefix spreads once the holder runs ahead."""
    def trace() -> list[int]:
        pods = run_fleet(Chooser("kv-aware"), num_pods=4, tenant_weights=[1.0], rate=0.3, ticks=600,
                         prefix_blocks=256)
        return [p.served for p in pods]

    guarded = trace()
    assert max(guarded) / (sum(guarded) / 4) <= 1.5 and sum(1 for n in guarded if n) >= 3, guarded
    monkeypatch.setattr(choice, "GUARD_FACTOR", 1e9)
    unguarded = trace()
    assert max(unguarded) == sum(unguarded), unguarded
