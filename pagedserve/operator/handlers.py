"""kopf wiring: the PagedModel's objects are applied from the pure builders, and one loop per model scrapes
its pods, asks the pure policy for a size, applies it and writes the status. Nothing here decides anything.

Level-based: every pass re-applies the whole desired state (server-side apply, a no-op when nothing
drifted), so a hand edit of the Deployment is put back within one interval and an operator that restarts
mid-way picks up where the status says it was. The replica count comes from `spec.replicas` when
autoscaling is off (so `kubectl scale pm/NAME`, an HPA or KEDA drive it through the scale subresource) and
from the autoscaler's `status.desiredReplicas` when it is on.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from .kube import Kube, Obj
from .policy import Decision, Observation, ScalingPolicy, decide
from .scrape import PodMetrics, observe, scrape
from .specs import (
    API_GROUP,
    METRICS_PORT,
    build_deployment,
    build_pods_service,
    build_router,
    build_service,
    router_enabled,
    router_name,
    selector_string,
)

MODELS = (API_GROUP, "pagedmodels")
Logger = logging.Logger | logging.LoggerAdapter[Any]


@dataclass(frozen=True)
class OperatorConfig:
    interval_s: float = 15.0  # between scrapes and decisions
    scrape_timeout_s: float = 3.0
    all_namespaces: bool = False


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def autoscaling(spec: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The autoscaling block when it is on; None means manual (`spec.replicas`)."""
    block = spec.get("autoscaling")
    return block if block and block.get("enabled", True) else None


def desired_replicas(spec: Mapping[str, Any], status: Mapping[str, Any]) -> int:
    auto = autoscaling(spec)
    replicas = int(spec.get("replicas", 1))
    if auto is None:
        return replicas
    low, high = int(auto.get("minReplicas", 1)), int(auto.get("maxReplicas", 4))
    return min(max(int(status.get("desiredReplicas", replicas)), low), high)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's own bookkeeping goes to annotations: our status schema is structural and would prune it
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # Events: our scaling decisions and real problems only
    # watching named namespaces needs no cluster-wide look at namespaces and CRDs (nor the rights for it)
    settings.scanning.disabled = not memo.config.all_namespaces
    memo.kube = Kube()
    memo.grpc_probes = await memo.kube.has_grpc_probes()


async def apply_model(body: kopf.Body, memo: kopf.Memo, replicas: int) -> Obj:
    name, namespace, uid = body.metadata.name, body.metadata.namespace, body.metadata.uid
    assert name and namespace and uid, "a PagedModel without name, namespace or uid: not from the API server"
    kube: Kube = memo.kube
    await kube.apply(build_pods_service(name, namespace, uid))
    if router_enabled(body.spec):
        for manifest in build_router(name, namespace, uid, body.spec):
            await kube.apply(manifest)
    else:  # turned off: its objects go (the public Service below points at the pods again)
        for kind in ("Deployment", "RoleBinding", "Role", "ServiceAccount"):
            await kube.delete(kind, router_name(name), namespace)
    await kube.apply(build_service(name, namespace, uid, body.spec))
    return await memo.kube.apply(build_deployment(name, namespace, uid, body.spec, replicas, memo.grpc_probes))


@kopf.on.create(*MODELS)
@kopf.on.update(*MODELS)
@kopf.on.resume(*MODELS)
async def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A spec change (or `kubectl scale`) is applied at once, not at the next pass of the loop."""
    await apply_model(body, memo, desired_replicas(body.spec, body.status))


@kopf.daemon(*MODELS, cancellation_timeout=10.0)
async def autoscale(stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: Logger, **_: Any) -> None:
    """One loop per PagedModel for as long as it exists: scrape, decide, apply, report."""
    loop = ModelLoop(body, memo, logger)
    while not stopped:
        try:
            await loop.run_once()
        except Exception:  # the API server or a pod misbehaving must not end the loop
            logger.exception("reconciliation pass failed; retrying in %.0f s", memo.config.interval_s)
        await stopped.wait(memo.config.interval_s)


class ModelLoop:
    """The state one model's loop keeps between passes: the window of observations and each pod's last
    answer. The decisions that must survive a restart (desired size, last scale time) live in the status."""

    def __init__(self, body: kopf.Body, memo: kopf.Memo, logger: Logger) -> None:
        self.body, self.memo, self.logger = body, memo, logger
        self.kube: Kube = memo.kube
        self.config: OperatorConfig = memo.config
        self.window: deque[Observation] = deque()
        self.last_seen: dict[str, tuple[float, PodMetrics]] = {}
        self.desired = desired_replicas(body.spec, body.status)
        self.last_scale_time = parse_time(body.status.get("lastScaleTime"))
        self.metrics_available: bool | None = None

    async def run_once(self) -> None:
        name, namespace = self.body.metadata.name, self.body.metadata.namespace
        assert name and namespace
        spec = self.body.spec
        observation = await self.observe(namespace, name)
        auto = autoscaling(spec)
        status: Obj = {}
        if auto is None:
            self.desired = int(spec.get("replicas", 1))
            decision = Decision(self.desired, "autoscaling is off: spec.replicas", observation.complete, False)
        else:
            decision = await self.decide(namespace, auto, observation)
            if decision.replicas != self.desired:
                self.scaled(decision, status)
        deployment = await apply_model(self.body, self.memo, self.desired)
        await self.report(namespace, name, deployment, observation, decision, auto is not None, status)

    async def observe(self, namespace: str, name: str) -> Observation:
        # the ready pods are the fleet the policy reasons about: a starting pod carries no load yet (and is
        # still counted by the Deployment's replicas); a ready pod that does not answer makes the round
        # incomplete, and the policy holds
        pods = [p for p in await self.kube.pods(namespace, selector_string(name)) if _is_ready(p)]
        urls = {p["metadata"]["name"]: f"http://{p['status']['podIP']}:{METRICS_PORT}/metrics" for p in pods}
        answers = await scrape(urls, self.config.scrape_timeout_s)
        now = asyncio.get_running_loop().time()
        observation = observe(now, answers, self.last_seen)
        self.last_seen = {pod: (now, metrics) for pod, metrics in answers.items() if metrics is not None}
        if observation.num_pods:  # no ready pod yet is no data, not an idle fleet
            self.window.append(observation)
        return observation

    async def decide(self, namespace: str, auto: Mapping[str, Any], observation: Observation) -> Decision:
        low, high = int(auto.get("minReplicas", 1)), int(auto.get("maxReplicas", 4))
        found = await self.kube.policy(namespace, auto["policyRef"])
        if found is None:
            held = min(max(self.desired, low), high)
            return Decision(held, f"AutoscalingPolicy {auto['policyRef']!r} not found: holding {held}",
                            observation.complete, True)
        policy = ScalingPolicy.from_spec(found.get("spec", {}))
        keep = policy.history_s + 2 * self.config.interval_s
        while self.window and self.window[0].time < observation.time - keep:
            self.window.popleft()
        last_scale = None
        if self.last_scale_time is not None:  # the status holds wall time; the window monotonic time
            last_scale = observation.time - (datetime.datetime.now(datetime.UTC).timestamp() - self.last_scale_time)
        return decide(list(self.window), self.desired, low, high, policy, observation.time, last_scale,
                      stale_after_s=3 * self.config.interval_s)

    def scaled(self, decision: Decision, status: Obj) -> None:
        verb = "ScaledUp" if decision.replicas > self.desired else "ScaledDown"
        self.logger.info("%s %d -> %d: %s", verb, self.desired, decision.replicas, decision.reason)
        kopf.event(self.body, type="Normal", reason=verb, message=decision.reason)
        self.desired = decision.replicas
        status["lastScaleTime"] = now_rfc3339()
        status["lastScaleReason"] = decision.reason
        self.last_scale_time = parse_time(status["lastScaleTime"])

    async def report(self, namespace: str, name: str, deployment: Obj, observation: Observation,
                     decision: Decision, auto: bool, status: Obj) -> None:
        live = deployment.get("status", {})
        ready = int(live.get("readyReplicas", 0))
        status.update(replicas=int(live.get("replicas", 0)), readyReplicas=ready, selector=selector_string(name),
                      desiredReplicas=self.desired, observedGeneration=self.body.metadata.get("generation"))
        if observation.num_scraped:
            attainment = observation.slo_attainment
            status.update(blockPressure=round(observation.block_pressure, 4),
                          hottestPodPressure=round(observation.max_pod_pressure, 4),
                          goodput=round(observation.goodput_rps, 4),
                          finishedRequestsPerSecond=round(observation.finished_rps, 4),
                          sloAttainment=None if attainment is None else round(attainment, 4),
                          waitingRequests=observation.waiting_requests,
                          preemptionsPerSecond=round(observation.preemptions_per_s, 4))
        available = observation.complete
        read = f"read /metrics of {observation.num_scraped} of {observation.num_pods} ready pods"
        if observation.num_pods and not available and self.metrics_available is not False:
            kopf.event(self.body, type="Warning", reason="MetricsUnavailable", message=read)
        self.metrics_available = available
        conditions = [
            ("Ready", ready >= self.desired, "AllReplicasReady" if ready >= self.desired else "ReplicasNotReady",
             f"{ready}/{self.desired} pods ready"),
            ("MetricsAvailable", available,
             "Scraped" if available else "MetricsMissing" if observation.num_pods else "NoReadyPods", read),
            ("ScalingLimited", auto and decision.limited, "Limited" if auto and decision.limited else
             "Autoscaling" if auto else "ManualScaling", decision.reason),
        ]
        status["conditions"] = merge_conditions(self.body.status.get("conditions", []), conditions)
        await self.kube.patch_model_status(namespace, name, status)


def _is_ready(pod: Obj) -> bool:
    status = pod.get("status", {})
    return (not pod["metadata"].get("deletionTimestamp") and bool(status.get("podIP"))
            and any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])))


def merge_conditions(previous: list[Obj], current: list[tuple[str, bool, str, str]]) -> list[Obj]:
    """Kubernetes-style conditions; lastTransitionTime moves only when the status flips."""
    before = {c.get("type"): c for c in previous}
    out = []
    for kind, value, reason, message in current:
        state = "True" if value else "False"
        old = before.get(kind, {})
        since = old.get("lastTransitionTime") if old.get("status") == state else None
        out.append({"type": kind, "status": state, "reason": reason, "message": message,
                    "lastTransitionTime": since or now_rfc3339()})
    return out
