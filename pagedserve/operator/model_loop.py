"""One PagedModel's loop, one pass at a time: scrape its ready pods, ask the pure policy for a size, apply it,
write the status. Free of kopf's runtime: the API calls, the apply, the Events, the scrape and the clock come
in as arguments (handlers.py wires kopf's; tests/operator/test_model_loop.py passes stand-ins).

What must survive a restart lives in the PagedModel's status and is read back from the body at construction:
the desired size, the last scale time (cooldown), the number of passes, a conflict already reported. The
window of observations and each pod's last answer are memory only: a restarted loop starts with an empty
window, so it cannot scale down before a full stabilization window of fresh data.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from .hpa import conflict_message, conflicting_hpas
from .policy import Decision, Observation, ScalingPolicy, decide
from .scrape import PodMetrics, observe, scrape
from .specs import METRICS_PORT, selector_string

Obj = dict[str, Any]
Logger = logging.Logger | logging.LoggerAdapter[Any]
ApplyModel = Callable[[int], Awaitable[Obj]]  # applies the model's objects at this size; returns the Deployment
PostEvent = Callable[[str, str, str], None]  # (type, reason, message): an Event on the PagedModel
Scrape = Callable[[Mapping[str, str], float], Awaitable[dict[str, PodMetrics | None]]]  # (pod -> URL, timeout)


class ClusterApi(Protocol):
    """The API calls the loop makes; `kube.Kube` implements them against the API server."""

    async def pods(self, namespace: str, label_selector: str) -> list[Obj]: ...

    async def policy(self, namespace: str, name: str) -> Obj | None:
        """The AutoscalingPolicy, None when there is none of that name."""

    async def hpas(self, namespace: str) -> list[Obj]:
        """The namespace's HorizontalPodAutoscalers."""

    async def patch_model_status(self, namespace: str, name: str, status: Obj) -> Obj:
        """A JSON merge patch of the PagedModel's status."""


class Clock:
    """Monotonic time for the window (a wall-clock step must not age the data), wall time for the status."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


def rfc3339(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def find_condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


class ModelLoop:
    """The state one model's loop keeps between passes. `body` is the PagedModel as the API server has it,
    read again at every pass (kopf's body is a live view: a spec or policy edit reaches the next pass)."""

    def __init__(self, body: Mapping[str, Any], kube: ClusterApi, apply: ApplyModel, post_event: PostEvent,
                 logger: Logger, *, interval_s: float, scrape_timeout_s: float, scrape_pods: Scrape = scrape,
                 clock: Clock | None = None) -> None:
        if interval_s <= 0 or scrape_timeout_s <= 0:
            raise ValueError(f"interval_s and scrape_timeout_s must be > 0, got {interval_s} and {scrape_timeout_s}")
        self.body, self.kube, self.apply, self.post_event, self.logger = body, kube, apply, post_event, logger
        self.interval_s, self.scrape_timeout_s, self.scrape_pods = interval_s, scrape_timeout_s, scrape_pods
        self.clock = clock or Clock()
        self.name, self.namespace = str(body["metadata"]["name"]), str(body["metadata"]["namespace"])
        status = body.get("status") or {}
        self.window: deque[Observation] = deque()
        self.keep_s = ScalingPolicy().history_s + 2 * interval_s  # the window's span, from the last policy read
        self.last_seen: dict[str, tuple[float, PodMetrics]] = {}
        self.desired = desired_replicas(body["spec"], status)
        self.last_scale_time = parse_time(status.get("lastScaleTime"))
        self.passes = int(status.get("observedPasses", 0))
        self.metrics_available: bool | None = None
        conflict = find_condition(status, "ScalingConflict")
        self.reported_conflict: str | None = conflict.get("message") if conflict.get("status") == "True" else None

    async def run_once(self) -> None:
        """One pass: observe, decide (unless an HPA scales the model too), apply, and patch the status."""
        spec = self.body["spec"]
        observation = await self.observe()
        auto = autoscaling(spec)
        status: Obj = {}
        conflict: list[str] = []
        if auto is None:
            self.desired = int(spec.get("replicas", 1))
            decision = Decision(self.desired, "autoscaling is off: spec.replicas", observation.complete, False)
        else:
            conflict = conflicting_hpas(await self.kube.hpas(self.namespace), self.name)
            if conflict:  # never write a size the HPA would write another one over
                decision = Decision(self.desired, f"{conflict_message(conflict)}: holding {self.desired}",
                                    observation.complete, True)
            else:
                decision = await self.decide(auto, observation)
                if decision.replicas != self.desired:
                    self.scaled(decision, status)
        self.report_conflict(conflict)
        deployment = await self.apply(self.desired)
        await self.report(deployment, observation, decision, auto is not None, conflict, status)

    async def observe(self) -> Observation:
        """Scrapes the ready pods and appends the round to the window."""
        # the ready pods are the fleet the policy reasons about: a starting pod carries no load yet (and is
        # still counted by the Deployment's replicas); a ready pod that does not answer makes the round
        # incomplete, and the policy holds
        pods = [p for p in await self.kube.pods(self.namespace, selector_string(self.name)) if _is_ready(p)]
        urls = {p["metadata"]["name"]: f"http://{p['status']['podIP']}:{METRICS_PORT}/metrics" for p in pods}
        answers = await self.scrape_pods(urls, self.scrape_timeout_s)
        now = self.clock.monotonic()
        observation = observe(now, answers, self.last_seen)
        self.last_seen = {pod: (now, metrics) for pod, metrics in answers.items() if metrics is not None}
        if observation.num_pods:  # no ready pod yet is no data, not an idle fleet
            self.window.append(observation)
        self.prune(now)
        return observation

    def prune(self, now: float) -> None:
        """Drops the rounds older than the window's span (at every pass: with autoscaling off or no policy too)."""
        while self.window and self.window[0].time < now - self.keep_s:
            self.window.popleft()

    async def decide(self, auto: Mapping[str, Any], observation: Observation) -> Decision:
        low, high = int(auto.get("minReplicas", 1)), int(auto.get("maxReplicas", 4))
        found = await self.kube.policy(self.namespace, auto["policyRef"])
        if found is None:
            held = min(max(self.desired, low), high)
            return Decision(held, f"AutoscalingPolicy {auto['policyRef']!r} not found: holding {held}",
                            observation.complete, True)
        policy = ScalingPolicy.from_spec(found.get("spec", {}))
        self.keep_s = policy.history_s + 2 * self.interval_s
        self.prune(observation.time)  # a policy edited to a shorter history: its older rounds go now
        last_scale = None
        if self.last_scale_time is not None:  # the status holds wall time; the window monotonic time
            last_scale = observation.time - (self.clock.wall() - self.last_scale_time)
        return decide(list(self.window), self.desired, low, high, policy, observation.time, last_scale,
                      stale_after_s=3 * self.interval_s)

    def scaled(self, decision: Decision, status: Obj) -> None:
        verb = "ScaledUp" if decision.replicas > self.desired else "ScaledDown"
        self.logger.info("%s %d -> %d: %s", verb, self.desired, decision.replicas, decision.reason)
        self.post_event("Normal", verb, decision.reason)
        self.desired = decision.replicas
        status["lastScaleTime"] = rfc3339(self.clock.wall())
        status["lastScaleReason"] = decision.reason
        self.last_scale_time = parse_time(status["lastScaleTime"])

    def report_conflict(self, hpa_names: list[str]) -> None:
        """One Warning Event per conflict (per set of HPAs), not one a pass; remembered across restarts through
        the ScalingConflict condition's message."""
        message = conflict_message(hpa_names) if hpa_names else None
        if message is not None and message != self.reported_conflict:
            self.logger.warning("%s", message)
            self.post_event("Warning", "ScalingConflict", message)
        self.reported_conflict = message

    async def report(self, deployment: Obj, observation: Observation, decision: Decision, auto: bool,
                     conflict: list[str], status: Obj) -> None:
        """Patches the status: the fleet, the last round's load, the conditions and the pass heartbeat."""
        live = deployment.get("status", {})
        ready = int(live.get("readyReplicas", 0))
        now = rfc3339(self.clock.wall())
        status.update(replicas=int(live.get("replicas", 0)), readyReplicas=ready, selector=selector_string(self.name),
                      desiredReplicas=self.desired, observedGeneration=self.body["metadata"].get("generation"),
                      lastEvaluationTime=now, observedPasses=self.passes + 1)
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
            self.post_event("Warning", "MetricsUnavailable", read)
        self.metrics_available = available
        conditions = [
            ("Ready", ready >= self.desired, "AllReplicasReady" if ready >= self.desired else "ReplicasNotReady",
             f"{ready}/{self.desired} pods ready"),
            ("MetricsAvailable", available,
             "Scraped" if available else "MetricsMissing" if observation.num_pods else "NoReadyPods", read),
            ("ScalingLimited", auto and decision.limited, "Limited" if auto and decision.limited else
             "Autoscaling" if auto else "ManualScaling", decision.reason),
            ("ScalingConflict", bool(conflict), "HorizontalPodAutoscaler" if conflict else
             "NoConflict" if auto else "ManualScaling",
             conflict_message(conflict) if conflict else "no HorizontalPodAutoscaler targets this PagedModel"
             if auto else "autoscaling is off: spec.replicas (kubectl scale, an HPA) sets the size"),
        ]
        previous = (self.body.get("status") or {}).get("conditions") or []
        status["conditions"] = merge_conditions(previous, conditions, now)
        await self.kube.patch_model_status(self.namespace, self.name, status)
        self.passes += 1


def _is_ready(pod: Obj) -> bool:
    status = pod.get("status", {})
    return (not pod["metadata"].get("deletionTimestamp") and bool(status.get("podIP"))
            and any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])))


def merge_conditions(previous: list[Obj], current: list[tuple[str, bool, str, str]], now: str) -> list[Obj]:
    """Kubernetes-style conditions; lastTransitionTime moves (to `now`) only when the status flips."""
    before = {c.get("type"): c for c in previous}
    out = []
    for kind, value, reason, message in current:
        state = "True" if value else "False"
        old = before.get(kind, {})
        since = old.get("lastTransitionTime") if old.get("status") == state else None
        out.append({"type": kind, "status": state, "reason": reason, "message": message,
                    "lastTransitionTime": since or now})
    return out
