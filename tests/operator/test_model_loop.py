"""One PagedModel's loop (pagedserve/operator/model_loop.py) pass by pass, without kopf or a cluster: the
restart, the window, stale data, a missing or edited policy, the status heartbeat and an HPA on the same
model. The API server is a stand-in here (FakeCluster); the real one runs the same loop in
tests/k8s/test_operator_e2e.py. Time is a fake clock, so nothing sleeps."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedserve.operator.hpa import conflicting_hpas
from pagedserve.operator.model_loop import Clock, ModelLoop, find_condition, parse_time, rfc3339
from pagedserve.operator.scrape import PodMetrics
from pagedserve.operator.specs import METRICS_PORT, selector_string

Obj = dict[str, Any]
CRDS = Path(__file__).resolve().parents[2] / "charts" / "pagedserve" / "crds"
NAME, NAMESPACE = "tiny", "ns"
START_WALL = 1_800_000_000.0
FAST = {"targetBlockPressure": 0.5, "tolerance": 0.0, "metricsWindowSeconds": 4, "cooldownSeconds": 0,
        "scaleUp": {"maxStep": 8, "stabilizationWindowSeconds": 0},
        "scaleDown": {"maxPercent": 50, "stabilizationWindowSeconds": 4}}


class FakeClock(Clock):
    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return START_WALL + self.t


class FakeCluster:
    """A stand-in for the API server (the real one is covered by tests/k8s): the PagedModel's body, kept live
    as kopf keeps it (a status patch merges into it, a test edits its spec), the model's ready pods and
    what each one's /metrics says (None: it does not answer), the AutoscalingPolicies, the HPAs of the
    namespace, and what the loop applied and posted."""

    def __init__(self, spec: Obj, status: Obj | None = None,
                 pods: Mapping[str, PodMetrics | None] | None = None) -> None:
        self.body: Obj = {"metadata": {"name": NAME, "namespace": NAMESPACE, "generation": 1},
                          "spec": spec, "status": dict(status or {})}
        self.metrics: dict[str, PodMetrics | None] = dict(pods or {})
        self.policies: dict[str, Obj] = {"fast": {"spec": copy.deepcopy(FAST)}}
        self.hpa_list: list[Obj] = []
        self.applied: list[int] = []
        self.events: list[tuple[str, str, str]] = []

    async def pods(self, namespace: str, label_selector: str) -> list[Obj]:
        assert (namespace, label_selector) == (NAMESPACE, selector_string(NAME))
        return [{"metadata": {"name": name}, "status": {"podIP": f"10.0.0.{i}", "conditions": [
            {"type": "Ready", "status": "True"}]}} for i, name in enumerate(sorted(self.metrics), 1)]

    async def policy(self, namespace: str, name: str) -> Obj | None:
        return self.policies.get(name)

    async def hpas(self, namespace: str) -> list[Obj]:
        return list(self.hpa_list)

    async def patch_model_status(self, namespace: str, name: str, status: Obj) -> Obj:
        merged = {**self.body["status"], **status}  # a JSON merge patch: null removes a field
        self.body["status"] = {key: value for key, value in merged.items() if value is not None}
        return self.body

    async def apply(self, replicas: int) -> Obj:
        self.applied.append(replicas)
        return {"status": {"replicas": replicas, "readyReplicas": len(self.metrics)}}

    def post_event(self, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))

    async def scrape(self, urls: Mapping[str, str], timeout_s: float) -> dict[str, PodMetrics | None]:
        assert all(url.endswith(f":{METRICS_PORT}/metrics") for url in urls.values())
        return {name: self.metrics[name] for name in urls}

    def condition(self, kind: str) -> Mapping[str, Any]:
        return find_condition(self.body["status"], kind)

    def reasons(self, reason: str) -> list[str]:
        return [message for _, r, message in self.events if r == reason]


def load(pressure: float, waiting: int = 0) -> PodMetrics:
    return PodMetrics(used_blocks=round(pressure * 100), total_blocks=100, goodput_rps=1.0, finished_rps=1.0,
                      waiting_requests=waiting, preemptions_total=0.0)


def auto_spec(policy: str = "fast", low: int = 1, high: int = 4) -> Obj:
    return {"replicas": 1, "autoscaling": {"policyRef": policy, "minReplicas": low, "maxReplicas": high}}


def new_loop(cluster: FakeCluster, clock: FakeClock, interval_s: float = 1.0) -> ModelLoop:
    return ModelLoop(cluster.body, cluster, cluster.apply, cluster.post_event, logging.getLogger("test"),
                     interval_s=interval_s, scrape_timeout_s=0.5, scrape_pods=cluster.scrape, clock=clock)


def run(loop: ModelLoop, clock: FakeClock, passes: int = 1, step_s: float = 1.0) -> None:
    """`passes` passes, `step_s` apart; the clock ends one step after the last."""
    for _ in range(passes):
        asyncio.run(loop.run_once())
        clock.t += step_s


def hpa(name: str, kind: str = "PagedModel", target: str = NAME, api_version: str = "pagedserve.io/v1alpha1") -> Obj:
    return {"metadata": {"name": name},
            "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": target}}}


def test_cooldown_is_taken_from_the_status_after_a_restart() -> None:
    clock = FakeClock()
    policy = {**FAST, "cooldownSeconds": 30}
    # the previous operator scaled 10 s ago, then went: this loop is the new operator's
    cluster = FakeCluster(auto_spec(), {"desiredReplicas": 1, "lastScaleTime": rfc3339(START_WALL - 10)},
                          {"a": load(0.9)})
    cluster.policies["fast"] = {"spec": policy}
    loop = new_loop(cluster, clock)
    run(loop, clock, passes=20)  # t = 0..19: within 30 s of the last change
    assert set(cluster.applied) == {1} and not cluster.reasons("ScaledUp")
    assert "in cooldown" in cluster.condition("ScalingLimited")["message"]
    run(loop, clock)  # t = 20: 30 s after the last change
    assert cluster.applied[-1] == 2 and len(cluster.reasons("ScaledUp")) == 1
    assert parse_time(cluster.body["status"]["lastScaleTime"]) == START_WALL + 20

    fresh = FakeCluster(auto_spec(), {"desiredReplicas": 1}, {"a": load(0.9)})  # no last change: no cooldown
    fresh.policies["fast"] = {"spec": policy}
    run(new_loop(fresh, clock), clock)
    assert fresh.applied == [2]


def test_the_window_keeps_the_policys_history_and_no_more() -> None:
    clock = FakeClock()
    cluster = FakeCluster(auto_spec(), pods={"a": load(0.3)})
    loop = new_loop(cluster, clock)
    run(loop, clock, passes=20)  # t = 0..19; history 4 s + two intervals
    assert [o.time for o in loop.window] == [float(t) for t in range(13, 20)]
    cluster.policies["fast"]["spec"]["scaleDown"] = {"stabilizationWindowSeconds": 10}  # more history from now on
    run(loop, clock, passes=20)  # t = 20..39
    assert [o.time for o in loop.window] == [float(t) for t in range(27, 40)]


@pytest.mark.parametrize("spec", [{"replicas": 1}, auto_spec(policy="gone")], ids=["manual", "missing policy"])
def test_the_window_is_pruned_when_no_policy_is_read(spec: Obj) -> None:
    clock = FakeClock()
    cluster = FakeCluster(spec, pods={"a": load(0.3)})
    loop = new_loop(cluster, clock)
    run(loop, clock, passes=100, step_s=10.0)  # t = 0..990 s
    kept = [o.time for o in loop.window]  # the default policy's history: 300 s, and two intervals
    assert kept[0] >= 990 - 302 and kept[-1] == 990 and len(kept) == 31


def test_a_pod_that_stops_answering_is_not_read_as_idle() -> None:
    clock = FakeClock()
    cluster = FakeCluster(auto_spec(), {"desiredReplicas": 2}, {"a": load(0.0), "b": load(0.6)})
    loop = new_loop(cluster, clock)
    run(loop, clock, passes=3)  # t = 0..2: b's load keeps both pods (0.3 on 2 would be 0.6 on 1)
    cluster.metrics["b"] = None  # its /metrics hangs: a alone is idle
    run(loop, clock, passes=15)  # t = 3..17: far longer than the 4 s scale-down window
    assert set(cluster.applied) == {2} and not cluster.reasons("ScaledDown")
    assert cluster.body["status"]["blockPressure"] == 0.0  # what the status shows is a's alone...
    assert cluster.condition("MetricsAvailable")["status"] == "False"  # ...and says it is partial
    assert "incomplete metrics (1 of 2 pods scraped)" in cluster.condition("ScalingLimited")["message"]
    assert cluster.reasons("MetricsUnavailable") == ["read /metrics of 1 of 2 ready pods"]  # one Warning
    cluster.metrics["b"] = load(0.0)  # it answers again, idle now
    run(loop, clock, passes=4)  # t = 18..21: the incomplete round of t = 17 is within the last 4 s
    assert set(cluster.applied) == {2}
    run(loop, clock)  # t = 22: the last 4 s are all complete rounds
    assert cluster.applied[-1] == 1 and cluster.condition("MetricsAvailable")["status"] == "True"


def test_rounds_without_a_ready_pod_are_no_data_and_the_old_ones_go_stale() -> None:
    clock = FakeClock()
    cluster = FakeCluster(auto_spec(), {"desiredReplicas": 2}, {"a": load(0.9)})  # asks for 2: covered
    loop = new_loop(cluster, clock)
    run(loop, clock)
    cluster.metrics = {}  # no pod ready (every pod restarting)
    run(loop, clock, passes=5)  # t = 1..5: the busy round of t = 0 grows old
    assert set(cluster.applied) == {2} and len(loop.window) == 1
    assert "stale metrics (latest 5s old > 3s)" in cluster.condition("ScalingLimited")["message"]
    assert cluster.condition("MetricsAvailable")["reason"] == "NoReadyPods"
    assert not cluster.reasons("MetricsUnavailable")  # no pod to read is not a pod unread
    cluster.metrics = {"a": load(0.9), "b": load(0.9)}
    run(loop, clock)
    assert cluster.applied[-1] == 4  # fresh data again: 2 pods at 0.9 ask for 4


def test_a_missing_policy_holds_and_says_why() -> None:
    clock = FakeClock()
    cluster = FakeCluster(auto_spec(policy="gone", low=1, high=3), {"desiredReplicas": 5}, {"a": load(0.9)})
    loop = new_loop(cluster, clock)
    run(loop, clock, passes=3)
    assert cluster.applied == [3, 3, 3]  # held, within the bounds edited since
    limited = cluster.condition("ScalingLimited")
    assert limited["status"] == "True" and limited["message"] == "AutoscalingPolicy 'gone' not found: holding 3"
    cluster.policies["gone"] = {"spec": FAST}  # created: the next pass uses it
    run(loop, clock)
    limited = cluster.condition("ScalingLimited")
    assert cluster.applied[-1] == 3 and (limited["status"], limited["reason"]) == ("False", "Autoscaling")
    assert "asks for 2 pods; 3 replicas (ready or starting) cover it" in limited["message"]


def test_a_policy_edited_between_two_passes_is_used_by_the_second() -> None:
    clock = FakeClock()
    cluster = FakeCluster(auto_spec(), {"desiredReplicas": 1}, {"a": load(0.6)})
    cluster.policies["fast"]["spec"]["targetBlockPressure"] = 0.9
    loop = new_loop(cluster, clock)
    run(loop, clock)
    assert cluster.applied == [1] and "within target 0.90" in cluster.condition("ScalingLimited")["message"]
    cluster.policies["fast"]["spec"]["targetBlockPressure"] = 0.25  # `kubectl patch asp`
    run(loop, clock)
    (reason,) = cluster.reasons("ScaledUp")
    assert cluster.applied == [1, 3] and "target 0.25" in reason and "1 -> 3" in reason


def test_every_pass_leaves_a_heartbeat_that_counts_on_across_restarts() -> None:
    clock = FakeClock()
    cluster = FakeCluster({"replicas": 1}, {"observedPasses": 41}, {"a": load(0.1)})
    run(new_loop(cluster, clock), clock, passes=2)
    assert cluster.body["status"]["observedPasses"] == 43
    assert cluster.body["status"]["lastEvaluationTime"] == rfc3339(START_WALL + 1)
    restarted = new_loop(cluster, clock)  # reads the count back from the status

    async def refuse(replicas: int) -> Obj:
        raise RuntimeError("the API server refused the apply")

    restarted.apply = refuse
    with pytest.raises(RuntimeError):
        asyncio.run(restarted.run_once())  # a failed pass is not counted
    restarted.apply = cluster.apply
    run(restarted, clock)
    assert cluster.body["status"]["observedPasses"] == 44


def test_an_hpa_on_the_model_stops_the_scaling_until_it_goes() -> None:
    clock = FakeClock()
    cluster = FakeCluster(auto_spec(), {"desiredReplicas": 1}, {"a": load(0.9)})
    cluster.hpa_list = [hpa("rival"), hpa("other-model", target="big"), hpa("deployment", kind="Deployment"),
                        hpa("other-group", api_version="example.com/v1")]
    loop = new_loop(cluster, clock)
    run(loop, clock, passes=3)  # the load asks for 2
    assert cluster.applied == [1, 1, 1] and not cluster.reasons("ScaledUp")
    conflict = cluster.condition("ScalingConflict")
    assert conflict["status"] == "True" and conflict["reason"] == "HorizontalPodAutoscaler"
    assert "HorizontalPodAutoscaler rival also targets" in conflict["message"]
    assert cluster.reasons("ScalingConflict") == [conflict["message"]]  # one Warning for three passes
    assert ("Warning", "ScalingConflict", conflict["message"]) in cluster.events
    run(new_loop(cluster, clock), clock)  # a restarted operator knows it reported this one
    assert len(cluster.reasons("ScalingConflict")) == 1
    cluster.hpa_list.append(hpa("second"))  # another HPA is another conflict
    run(loop, clock)
    assert len(cluster.reasons("ScalingConflict")) == 2 and "rival, second" in cluster.reasons("ScalingConflict")[1]
    cluster.hpa_list = cluster.hpa_list[1:4]  # both gone
    run(loop, clock)
    assert cluster.condition("ScalingConflict")["status"] == "False" and cluster.applied[-1] == 2


def test_with_autoscaling_off_an_hpa_drives_spec_replicas_without_conflict() -> None:
    clock = FakeClock()
    cluster = FakeCluster({"replicas": 3, "autoscaling": {"policyRef": "fast", "enabled": False}}, pods={})
    cluster.hpa_list = [hpa("rival")]
    run(new_loop(cluster, clock), clock)
    assert cluster.applied == [3] and cluster.condition("ScalingConflict")["reason"] == "ManualScaling"
    assert cluster.condition("ScalingConflict")["status"] == "False" and not cluster.events


def test_hpas_match_by_group_kind_and_name() -> None:
    hpas = [hpa("b"), hpa("a"), hpa("v1", api_version="pagedserve.io/v1"), hpa("core", api_version="v1"),
            hpa("no-version", api_version=""), {"metadata": {"name": "no-spec"}}]
    assert conflicting_hpas(hpas, NAME) == ["a", "b", "v1"]  # every version of our group: the same object
    assert conflicting_hpas(hpas, "other") == []


def test_a_loop_refuses_a_non_positive_interval() -> None:
    cluster = FakeCluster({"replicas": 1})
    with pytest.raises(ValueError, match="interval_s and scrape_timeout_s must be > 0"):
        new_loop(cluster, FakeClock(), interval_s=0)


def test_every_status_field_the_loop_writes_is_in_the_crd_schema() -> None:
    """The status schema is structural: a field missing from it would be pruned by the API server, silently."""
    crd = yaml.safe_load((CRDS / "pagedmodels.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    clock = FakeClock()
    cluster = FakeCluster(auto_spec(), {"desiredReplicas": 1}, {"a": load(0.9, waiting=2)})
    run(new_loop(cluster, clock), clock)  # a pass that scrapes and scales: every field
    written = set(cluster.body["status"])
    assert cluster.reasons("ScaledUp") and {"sloAttainment", "lastEvaluationTime", "observedPasses"} <= written
    assert written <= set(schema), written - set(schema)
    assert (schema["observedPasses"]["type"], schema["observedPasses"]["minimum"]) == ("integer", 0)
    assert schema["lastEvaluationTime"]["format"] == "date-time"
    condition = set(schema["conditions"]["items"]["properties"])
    assert all(set(c) <= condition for c in cluster.body["status"]["conditions"])
