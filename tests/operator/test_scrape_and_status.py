"""One scrape round folded into an Observation, and the status bookkeeping of the handlers: pure parts of
the operator, checked without a cluster. The text parser itself is checked against a real frontend's
/metrics in tests/integration/test_serve_stack.py."""

from __future__ import annotations

import pytest

from pagedserve.operator.model_loop import autoscaling, desired_replicas, merge_conditions, parse_time
from pagedserve.operator.scrape import PodMetrics, observe, parse_pod_metrics


def pod(used: int, total: int = 100, goodput: float = 1.0, finished: float = 1.0, waiting: int = 0,
        preemptions: float = 0.0) -> PodMetrics:
    return PodMetrics(used, total, goodput, finished, waiting, preemptions)


def test_a_round_sums_the_pods_that_answered_and_counts_those_that_did_not() -> None:
    round_ = observe(10.0, {"a": pod(80, goodput=0.5, waiting=3), "b": pod(20), "c": None}, {})
    assert (round_.num_pods, round_.num_scraped, round_.complete) == (3, 2, False)
    assert (round_.used_blocks, round_.total_blocks, round_.block_pressure) == (100, 200, 0.5)
    assert round_.max_pod_pressure == 0.8 and round_.waiting_requests == 3
    assert round_.goodput_rps == 1.5 and round_.finished_rps == 2.0 and round_.slo_attainment == 0.75
    nobody = observe(10.0, {}, {})
    assert not nobody.complete and nobody.block_pressure == 0 and nobody.slo_attainment is None


def test_the_preemption_rate_comes_from_two_scrapes_of_the_same_pod() -> None:
    previous = {"a": (10.0, pod(0, preemptions=5)), "b": (10.0, pod(0, preemptions=100))}
    round_ = observe(12.0, {"a": pod(0, preemptions=9), "b": pod(0, preemptions=3), "new": pod(0, preemptions=50)},
                     previous)
    # a: 4 in 2 s; b restarted (its counter went back): no rate; new: first seen, no rate
    assert round_.preemptions_per_s == 2.0


@pytest.mark.parametrize("text", [
    "pagedserve_ready 0.0\n",  # still loading: the other families are not served yet
    "# HELP go_goroutines x\n# TYPE go_goroutines gauge\ngo_goroutines 8\n",  # not a pagedserve pod
    "pagedserve_ready 1.0\npagedserve_kv_blocks_capacity 64\n",  # a pod of another version, families missing
])
def test_pods_that_cannot_report_load_count_as_unread(text: str) -> None:
    assert parse_pod_metrics(text) is None


def test_replicas_come_from_the_spec_when_manual_and_from_the_autoscaler_within_bounds() -> None:
    auto = {"policyRef": "p", "minReplicas": 2, "maxReplicas": 5}
    assert desired_replicas({"replicas": 3}, {"desiredReplicas": 9}) == 3  # manual: the autoscaler's number is moot
    assert desired_replicas({"replicas": 3, "autoscaling": auto}, {"desiredReplicas": 4}) == 4
    assert desired_replicas({"replicas": 3, "autoscaling": auto}, {}) == 3  # first pass: start from the spec
    assert desired_replicas({"replicas": 1, "autoscaling": auto}, {"desiredReplicas": 9}) == 5  # bounds edited
    assert desired_replicas({"replicas": 1, "autoscaling": {**auto, "enabled": False}}, {"desiredReplicas": 4}) == 1
    assert autoscaling({"autoscaling": {**auto, "enabled": False}}) is None


def test_conditions_keep_their_transition_time_until_they_flip() -> None:
    now = "2030-01-01T00:00:00Z"
    (ready,) = merge_conditions([], [("Ready", False, "ReplicasNotReady", "0/1 pods ready")], now)
    assert ready["status"] == "False" and ready["lastTransitionTime"] == now and parse_time(now) is not None
    old = [{**ready, "lastTransitionTime": "2020-01-01T00:00:00Z"}]
    (same,) = merge_conditions(old, [("Ready", False, "ReplicasNotReady", "0/2 pods ready")], now)
    assert same["lastTransitionTime"] == "2020-01-01T00:00:00Z" and same["message"] == "0/2 pods ready"
    (flipped,) = merge_conditions(old, [("Ready", True, "AllReplicasReady", "1/1 pods ready")], now)
    assert flipped["status"] == "True" and flipped["lastTransitionTime"] == now
