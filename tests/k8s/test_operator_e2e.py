"""The operator end to end on a real control plane: CRDs from the chart, the operator running with exactly
its RBAC rights (a ServiceAccount token), and pods that the test kubelet runs as real pagedserve processes
from the operator's own pod template. The model is tiny (random weights, SmolLM2's tokenizer) so that two
cores carry two pods; its KV cache is small so that a few long requests fill it.

The tests are the stages of one story and run in order: apply, serve, scale up under load, hold on
missing metrics, scale down, follow a policy edit, hand over to a standby operator, put hand edits back, manual
scaling, deletion. Traffic goes to the pods' loopback addresses only.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import polling
import pytest
from namespaced import Namespaced, stop

from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "charts" / "pagedserve" / "crds"
CLUSTER_ROLE = ROOT / "charts" / "pagedserve" / "files" / "rbac" / "operator-clusterrole.yaml"
INTERVAL_S = 1.0

POLICY = {"targetBlockPressure": 0.5, "metricsWindowSeconds": 4, "tolerance": 0.0, "cooldownSeconds": 2,
          "scaleUp": {"maxStep": 1, "stabilizationWindowSeconds": 0},
          "scaleDown": {"maxPercent": 50, "stabilizationWindowSeconds": 4}}


# every poll runs kubectl: a few times a second is enough
wait_for = functools.partial(polling.wait_for, timeout=60.0, poll_s=0.2)


class Scenario(Namespaced):
    """The namespace, the operator processes and the model under test."""

    def __init__(self, cluster: Any, kubelet: Any, namespace: str, model_dir: Path) -> None:
        super().__init__(cluster, kubelet, namespace)
        self.model_dir = model_dir
        self.operators: dict[int, subprocess.Popen[str]] = {}  # by peering priority
        self.logs = Path(kubelet.logs_dir) / f"operators-{namespace}"
        self.logs.mkdir()
        self.health_port = 0

    def start_operator(self, priority: int) -> subprocess.Popen[str]:
        """An operator in kopf peering: of several, the one with the highest priority works and the others stand
        by."""
        operator, self.health_port = self.launch_operator(self.logs / f"operator-{priority}.log", INTERVAL_S,
                                                          "--peering", "pagedserve", "--priority", str(priority))
        self.operators[priority] = operator
        return operator

    def operator_log(self, priority: int) -> str:
        path = self.logs / f"operator-{priority}.log"
        return path.read_text() if path.exists() else ""

    def stop_operator(self, priority: int) -> None:
        stop(self.operators.pop(priority))

    def model(self) -> dict[str, Any]:
        return dict(self.get("pagedmodel", "tiny"))

    def status(self) -> dict[str, Any]:
        return dict(self.model().get("status", {}))

    def condition(self, kind: str) -> dict[str, Any]:
        return next((c for c in self.status().get("conditions", []) if c["type"] == kind), {})

    def events(self, reason: str) -> list[dict[str, Any]]:
        items = self.get("events", "")["items"]
        return [e for e in items if e.get("reason") == reason and e["involvedObject"]["kind"] == "PagedModel"]

    def passes(self) -> int:
        return int(self.status().get("observedPasses", 0))

    def wait_passes(self, count: int) -> None:
        """Until the operator has made `count` more passes over the model (status.observedPasses): each pass
        decides, so a size that holds through them held through `count` decisions."""
        start = self.passes()
        wait_for(lambda: self.passes() >= start + count, f"{count} passes of the operator ({self.diagnostics()})",
                 timeout=30 + 10 * count * INTERVAL_S)

    def diagnostics(self) -> str:
        logs = "".join(self.operator_log(p)[-3000:] for p in self.operators)
        return f"operator logs (tails):\n{logs}\nstatus: {self.status()}"


class Load:
    """Long greedy requests kept in flight against every ready pod until stopped: they fill the KV cache."""

    def __init__(self, scenario: Scenario, streams_per_pod: int = 3) -> None:
        self.scenario, self.streams_per_pod = scenario, streams_per_pod
        self.stop_event = threading.Event()
        self.completed = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams_per_pod)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def _run(self, index: int) -> None:
        ip = self.scenario.ready_pods()[0]["status"]["podIP"]  # the first pod: the one that gets hot
        with grpc.insecure_channel(f"{ip}:50051") as channel:
            stub = pb_grpc.InferenceStub(channel)
            while not self.stop_event.is_set():
                # ~53 of the 64 blocks each: one fits, three at once do not (preemptions, a queue)
                request = pb.GenerateRequest(text=f"Request {index}: count to a thousand.",
                                             params=pb.GenerationParameters(max_tokens=200, ignore_eos=True))
                try:
                    for _ in stub.Generate(request, timeout=120):
                        if self.stop_event.is_set():
                            break
                    self.completed += 1
                except grpc.RpcError as exc:
                    self.errors.append(f"{exc.code().name}: {exc.details()}")
                    time.sleep(0.5)


@pytest.fixture(scope="module")
def scenario(cluster: Any, kubelet: Any, tiny_chat_model_dir: Path) -> Iterator[Scenario]:
    namespace = f"e2e-{os.getpid()}"
    cluster.kubectl("apply", "-f", str(CRDS))
    cluster.kubectl("apply", "-f", str(CLUSTER_ROLE))
    cluster.kubectl("create", "namespace", namespace)
    s = Scenario(cluster, kubelet, namespace, tiny_chat_model_dir)
    s.kubectl("create", "serviceaccount", "pagedserve-operator")
    s.kubectl("create", "rolebinding", "pagedserve-operator", "--clusterrole=pagedserve-operator",
              f"--serviceaccount={namespace}:pagedserve-operator")
    s.apply({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "pagedserve"}})
    s.start_operator(priority=100)
    try:
        yield s
    finally:
        s.kubectl("delete", "pagedmodel", "--all", "--wait=false", check=False)
        try:  # the operator removes its finalizer before it goes
            wait_for(lambda: not s.get("pagedmodels", "")["items"], "the operator releasing the models")
        finally:
            for priority in list(s.operators):
                s.stop_operator(priority)
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_invalid_resources_are_refused_by_the_api_server(scenario: Scenario) -> None:
    bad = [
        ({"kind": "PagedModel", "spec": {"gpusPerPod": 1}}, "spec.model: Required value"),
        ({"kind": "PagedModel", "spec": {"model": "m", "gpusPerPod": -1}}, "spec.gpusPerPod"),
        ({"kind": "PagedModel", "spec": {"model": "m", "cache": {"blockSize": 0}}}, "spec.cache.blockSize"),
        ({"kind": "PagedModel", "spec": {"model": "m", "scheduler": {"preemptionMode": "drop"}}},
         "spec.scheduler.preemptionMode"),
        ({"kind": "PagedModel", "spec": {"model": "m", "autoscaling": {"maxReplicas": 3}}},
         "spec.autoscaling.policyRef: Required value"),
        ({"kind": "PagedModel", "spec": {"model": "m", "modelVolume": {
            "hostPath": {"path": "/w"}, "persistentVolumeClaim": {"claimName": "c"}}}}, "spec.modelVolume"),
        ({"kind": "PagedModel", "spec": {"model": "m", "router": {"policy": "fastest"}}}, "spec.router.policy"),
        ({"kind": "PagedModel", "spec": {"model": "m", "router": {"replicas": 17}}}, "spec.router.replicas"),
        ({"kind": "AutoscalingPolicy", "spec": {"targetBlockPressure": 1.5}}, "spec.targetBlockPressure"),
        ({"kind": "AutoscalingPolicy", "spec": {"scaleDown": {"maxPercent": 0}}}, "spec.scaleDown.maxPercent"),
        ({"kind": "AutoscalingPolicy", "spec": {"cooldownSeconds": -1}}, "spec.cooldownSeconds"),
    ]
    for manifest, message in bad:
        manifest = {"apiVersion": "pagedserve.io/v1alpha1", "metadata": {"name": "bad"}, **manifest}
        with pytest.raises(Exception) as refused:
            scenario.apply(manifest)
        assert message in str(refused.value), (manifest, str(refused.value))
    assert scenario.get("pagedmodels", "")["items"] == [] and scenario.get("autoscalingpolicies", "")["items"] == []


def test_a_paged_model_creates_its_deployment_and_service_and_serves(scenario: Scenario) -> None:
    scenario.apply({"apiVersion": "pagedserve.io/v1alpha1", "kind": "AutoscalingPolicy",
                    "metadata": {"name": "fast"}, "spec": POLICY})
    scenario.apply({
        "apiVersion": "pagedserve.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "tiny"},
        "spec": {"model": "/models/tiny", "modelVolume": {"mountPath": "/models/tiny",
                                                          "hostPath": {"path": str(scenario.model_dir)}},
                 "cache": {"blockSize": 4, "numBlocks": 64}, "scheduler": {"maxNumSeqs": 4},
                 "autoscaling": {"policyRef": "fast", "minReplicas": 1, "maxReplicas": 2},
                 "router": {"enabled": False}}})  # the Service at the pods, as before the router: test_router_e2e.py
    model = scenario.model()
    deployment = wait_for(lambda: scenario.get("deployment", "tiny"), "the Deployment")
    service = wait_for(lambda: scenario.get("service", "tiny"), "the Service")
    for owned in (deployment, service):
        (owner,) = owned["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "PagedModel", "tiny", model["metadata"]["uid"], True)
    wait_for(lambda: scenario.status().get("readyReplicas") == 1, "one ready pod", timeout=180)
    (pod,) = scenario.ready_pods()
    limits = {c["name"]: c["resources"].get("limits", {}) for c in pod["spec"]["containers"]}
    assert limits["executor"]["nvidia.com/gpu"] == "1" and "nvidia.com/gpu" not in limits["frontend"]
    with grpc.insecure_channel(f"{pod['status']['podIP']}:50051") as channel:
        reply = pb_grpc.InferenceStub(channel).Complete(pb.GenerateRequest(
            text="The capital of France is", params=pb.GenerationParameters(max_tokens=8, ignore_eos=True)),
            timeout=60)
    assert reply.usage.completion_tokens == 8 and reply.choices[0].text
    openai_api = f"http://{pod['status']['podIP']}:8000/v1"  # the OpenAI-compatible port, as exposed
    with urllib.request.urlopen(f"{openai_api}/models", timeout=60) as response:
        (served,) = json.load(response)["data"]
    body = json.dumps({"model": served["id"], "prompt": "The capital of France is", "max_tokens": 8,
                       "temperature": 0, "ignore_eos": True}).encode()
    http = urllib.request.Request(f"{openai_api}/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(http, timeout=60) as response:
        completion = json.load(response)
    assert completion["choices"][0]["text"] == reply.choices[0].text  # the same greedy text as over gRPC
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "http": 8000, "metrics": 9400}
    wait_for(lambda: scenario.condition("MetricsAvailable").get("status") == "True", "metrics read")
    status = scenario.status()
    assert status["selector"] == ("app.kubernetes.io/name=pagedserve,app.kubernetes.io/instance=tiny,"
                                  "app.kubernetes.io/component=model")
    assert status["desiredReplicas"] == 1 and status["blockPressure"] < 0.5 and status["observedGeneration"] >= 1
    table = scenario.kubectl("get", "pm", "tiny")
    assert table.split("\n")[0].split() == ["NAME", "REPLICAS", "READY", "PRESSURE", "GOODPUT", "ATTAINMENT", "AGE"]


def patch_policy(scenario: Scenario, **scale_down: int) -> None:
    scenario.kubectl("patch", "asp", "fast", "--type=merge", "-p", json.dumps({"spec": {"scaleDown": scale_down}}))


def test_load_scales_up_a_policy_edit_missing_metrics_and_idleness_scale_down(scenario: Scenario) -> None:
    with Load(scenario) as load:
        wait_for(lambda: scenario.status().get("desiredReplicas") == 2, f"a scale-up ({scenario.diagnostics()})",
                 timeout=90)
        (up,) = scenario.events("ScaledUp")
        assert "1 -> 2" in up["message"] and "pressure" in up["message"], up["message"]
        assert scenario.get("deployment", "tiny")["spec"]["replicas"] == 2
        assert scenario.status()["lastScaleReason"] == up["message"]
        wait_for(lambda: len(scenario.ready_pods()) == 2, "the second pod ready", timeout=180)
        # `kubectl patch asp`: a long scale-down window keeps the second pod after the load goes
        patch_policy(scenario, stabilizationWindowSeconds=3600)
    assert load.completed > 0 and not load.errors, load.errors
    wait_for(lambda: scenario.status().get("blockPressure") == 0, "the load gone from the metrics")
    scenario.wait_passes(8)  # eight decisions: over twice the policy's original window and its cooldown
    assert scenario.status()["desiredReplicas"] == 2 and not scenario.events("ScaledDown"), scenario.diagnostics()

    # a pod whose /metrics cannot be read holds the size, although the short window would now scale down
    frozen = scenario.kubelet.pid(scenario.namespace, scenario.ready_pods()[1]["metadata"]["name"], "frontend")
    os.kill(frozen, signal.SIGSTOP)
    try:
        patch_policy(scenario, stabilizationWindowSeconds=2)
        wait_for(lambda: scenario.condition("MetricsAvailable").get("status") == "False", "MetricsAvailable=False")
        assert scenario.events("MetricsUnavailable")
        scenario.wait_passes(6)  # three times the short window: each of these decisions held
        assert scenario.status()["desiredReplicas"] == 2 and not scenario.events("ScaledDown"), scenario.diagnostics()
    finally:
        os.kill(frozen, signal.SIGCONT)
    wait_for(lambda: scenario.status().get("desiredReplicas") == 1, f"a scale-down ({scenario.diagnostics()})",
             timeout=90)
    (down,) = scenario.events("ScaledDown")
    assert "2 -> 1" in down["message"], down["message"]
    assert scenario.condition("MetricsAvailable")["status"] == "True"
    wait_for(lambda: scenario.get("deployment", "tiny")["spec"]["replicas"] == 1, "the Deployment at 1")
    wait_for(lambda: len(scenario.get("pods", "")["items"]) == 1, "one pod left", timeout=60)


def test_a_standby_operator_takes_over_and_changes_nothing(scenario: Scenario) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{scenario.health_port}/healthz", timeout=10) as reply:
        assert reply.status == 200  # the liveness endpoint of the working operator
    before = scenario.get("deployment", "tiny")
    pods = {p["metadata"]["name"] for p in scenario.get("pods", "")["items"]}
    desired = scenario.status()["desiredReplicas"]
    scenario.start_operator(priority=50)
    # a kopf operator starts paused and resumes only when no peer of a higher priority is alive
    wait_for(lambda: sorted(p["priority"] for p in scenario.get("kopfpeering", "pagedserve")["status"].values())
             == [50, 100], "both operators in the peering")
    scenario.wait_passes(3)  # the working operator's passes: the standby had that long to interfere
    assert "Resuming operations" not in scenario.operator_log(50) and "processed" not in scenario.operator_log(50)
    scenario.stop_operator(100)
    wait_for(lambda: "Resuming operations after the pause" in scenario.operator_log(50), "the standby taking over")
    wait_for(lambda: "Resuming is processed" in scenario.operator_log(50), "the standby resumed the model")
    scenario.wait_passes(5)  # the standby's own loop: five passes that change nothing
    after = scenario.get("deployment", "tiny")
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"] == before["spec"]
    assert {p["metadata"]["name"] for p in scenario.get("pods", "")["items"]} == pods
    assert scenario.status()["desiredReplicas"] == desired


def test_hand_edits_of_the_deployment_are_put_back(scenario: Scenario) -> None:
    template = scenario.get("deployment", "tiny")["spec"]["template"]
    scenario.kubectl("scale", "deployment", "tiny", "--replicas=2")
    scenario.kubectl("set", "image", "deployment/tiny", "frontend=someone/else:1")
    wait_for(lambda: scenario.get("deployment", "tiny")["spec"]["replicas"] == 1, "replicas put back")
    wait_for(lambda: scenario.get("deployment", "tiny")["spec"]["template"] == template, "the template put back")
    wait_for(lambda: len(scenario.ready_pods()) == 1 and len(scenario.get("pods", "")["items"]) == 1,
             "one pod again", timeout=90)


def test_a_spec_change_rolls_the_pods(scenario: Scenario) -> None:
    (old,) = scenario.ready_pods()
    scenario.kubectl("patch", "pm", "tiny", "--type=merge", "-p", '{"spec": {"scheduler": {"maxNumSeqs": 3}}}')

    def frontend_args() -> list[str]:
        containers = scenario.get("deployment", "tiny")["spec"]["template"]["spec"]["containers"]
        return list(next(c for c in containers if c["name"] == "frontend")["args"])

    wait_for(lambda: frontend_args()[frontend_args().index("--max-num-seqs") + 1] == "3", "the new template")
    def replaced() -> bool:
        pods = scenario.get("pods", "")["items"]
        return (len(pods) == 1 and pods[0]["metadata"]["name"] != old["metadata"]["name"]
                and len(scenario.ready_pods()) == 1)

    wait_for(replaced, "the pod replaced by one of the new template", timeout=120)
    wait_for(lambda: scenario.status().get("observedGeneration") == scenario.model()["metadata"]["generation"],
                    "the status observing the new generation")


def test_a_missing_policy_holds_the_size_and_says_so(scenario: Scenario) -> None:
    scenario.kubectl("patch", "pm", "tiny", "--type=merge", "-p", '{"spec": {"autoscaling": {"policyRef": "gone"}}}')
    wait_for(lambda: "'gone' not found" in scenario.condition("ScalingLimited").get("message", ""),
             "ScalingLimited naming the missing policy")
    assert scenario.condition("ScalingLimited")["status"] == "True" and scenario.status()["desiredReplicas"] == 1
    scenario.kubectl("patch", "pm", "tiny", "--type=merge", "-p", '{"spec": {"autoscaling": {"policyRef": "fast"}}}')
    wait_for(lambda: scenario.condition("ScalingLimited").get("status") == "False", "the policy found again")


def test_an_hpa_on_the_model_stops_the_scaling_until_it_goes(scenario: Scenario) -> None:
    """Two autoscalers on one scale subresource would fight over the size (kserve issue 4996): the operator
    detects the HPA, holds, says so once, and resumes when it goes. The test control plane (1.20) serves no
    autoscaling/v2: the operator reads HPAs through v1 here."""
    account = f"--as=system:serviceaccount:{scenario.namespace}:pagedserve-operator"
    assert scenario.kubectl("auth", "can-i", "list", "horizontalpodautoscalers.autoscaling", account).strip() == "yes"
    assert scenario.kubectl("auth", "can-i", "patch", "horizontalpodautoscalers.autoscaling", account,
                            check=False).strip() == "no"
    desired, replicas = scenario.status()["desiredReplicas"], scenario.get("deployment", "tiny")["spec"]["replicas"]
    scenario.apply({"apiVersion": "autoscaling/v1", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "rival"},
                    "spec": {"scaleTargetRef": {"apiVersion": "pagedserve.io/v1alpha1", "kind": "PagedModel",
                                                "name": "tiny"},
                             "minReplicas": 1, "maxReplicas": 2, "targetCPUUtilizationPercentage": 80}})
    wait_for(lambda: scenario.condition("ScalingConflict").get("status") == "True", "ScalingConflict=True")
    conflict = scenario.condition("ScalingConflict")
    assert conflict["reason"] == "HorizontalPodAutoscaler" and "HorizontalPodAutoscaler rival " in conflict["message"]
    (event,) = wait_for(lambda: scenario.events("ScalingConflict"), "the ScalingConflict Event")
    assert event["type"] == "Warning" and event["message"] == conflict["message"]
    scenario.wait_passes(3)
    (event,) = scenario.events("ScalingConflict")  # once per conflict, not once a pass
    assert event.get("count", 1) == 1, event
    assert scenario.status()["desiredReplicas"] == desired
    assert scenario.condition("ScalingLimited")["message"] == f"{conflict['message']}: holding {desired}"
    assert scenario.get("deployment", "tiny")["spec"]["replicas"] == replicas
    scenario.kubectl("delete", "hpa", "rival")
    wait_for(lambda: scenario.condition("ScalingConflict").get("status") == "False", "ScalingConflict=False")
    assert scenario.condition("ScalingConflict")["reason"] == "NoConflict"
    assert "HorizontalPodAutoscaler" not in scenario.condition("ScalingLimited")["message"]


def test_kubectl_scale_drives_a_model_without_autoscaling(scenario: Scenario) -> None:
    scenario.kubectl("patch", "pm", "tiny", "--type=merge", "-p", '{"spec": {"autoscaling": {"enabled": false}}}')
    scenario.kubectl("scale", "pm", "tiny", "--replicas=2")
    wait_for(lambda: scenario.get("deployment", "tiny")["spec"]["replicas"] == 2, "the Deployment at 2")
    wait_for(lambda: scenario.status().get("replicas") == 2, "status.replicas 2")
    scale = json.loads(scenario.cluster.kubectl(
        "get", "--raw", f"/apis/pagedserve.io/v1alpha1/namespaces/{scenario.namespace}/pagedmodels/tiny/scale"))
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == scenario.status()["selector"]
    assert scenario.condition("ScalingLimited")["reason"] == "ManualScaling"
    scenario.kubectl("scale", "pm", "tiny", "--replicas=1")
    wait_for(lambda: scenario.get("deployment", "tiny")["spec"]["replicas"] == 1, "the Deployment at 1")


def test_deleting_the_model_removes_everything(scenario: Scenario) -> None:
    scenario.kubectl("delete", "pagedmodel", "tiny", "--timeout=60s")
    wait_for(lambda: scenario.get("deployment", "tiny") is None, "the Deployment gone")
    wait_for(lambda: scenario.get("service", "tiny") is None, "the Service gone")
    wait_for(lambda: scenario.get("pods", "")["items"] == [], "the pods gone", timeout=90)
    assert all(operator.poll() is None for operator in scenario.operators.values()), "an operator died"
