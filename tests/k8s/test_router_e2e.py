"""The router on a real control plane: the operator (with exactly its RBAC rights) makes a PagedModel's router
Deployment, its ServiceAccount and Role, and the pods' headless Service; the test kubelet runs the router pod as a
real `pagedserve router --kubernetes-service` process with its ServiceAccount's token, so the router follows the
pods' EndpointSlices through the API server with only the Role's rights.

One story, in order: one client channel to the router spreads requests over both pods; a scale-up's new pod takes
requests within seconds; a deleted pod costs no request; a router pod deleted (the Deployment makes another) has its
view again and routes within seconds; and the router's account can read EndpointSlices in its namespace, nothing
else. The model is tiny (random weights, SmolLM2's tokenizer); requests are short, so that two cores carry three
pods and a router. Traffic goes to the pods' and the router's loopback addresses only.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import polling
import pytest
from namespaced import WithOperator

from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.services.router.servicer import POD_HEADER, PODS_HEADER

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "charts" / "pagedserve" / "crds"
CLUSTER_ROLE = ROOT / "charts" / "pagedserve" / "files" / "rbac" / "operator-clusterrole.yaml"
ROUTER = "tiny-router"

wait_for = functools.partial(polling.wait_for, timeout=60.0, poll_s=0.2)


class Routed(WithOperator):
    """The namespace, the operator, and the PagedModel `tiny` behind its router."""

    def pod_addresses(self) -> dict[str, str]:
        """The ready model pods: address as the router names them -> pod name."""
        return {f"{p['status']['podIP']}:50051": p["metadata"]["name"] for p in self.ready_pods("model")}

    def router_address(self) -> str:
        (router,) = wait_for(lambda: self.ready_pods("router"), "a ready router pod")
        return f"{router['status']['podIP']}:50051"

    def diagnostics(self) -> str:
        router = self.kubelet.logs(self.namespace, ROUTER)[-4000:]
        return f"operator log (tail):\n{self.operator_log_tail()}\nrouter log:\n{router}"


def finished(address: str) -> int:
    """The pod's own count of finished requests (its Status)."""
    with grpc.insecure_channel(address) as channel:
        return int(pb_grpc.InferenceStub(channel).Status(pb.StatusRequest(), timeout=10).num_requests_finished)


def complete(stub: pb_grpc.InferenceStub, text: str) -> str:
    """One short request through the router; the pod it went to (the router's trailing metadata)."""
    reply, call = stub.Complete.with_call(pb.GenerateRequest(
        text=text, params=pb.GenerationParameters(max_tokens=2, ignore_eos=True)), timeout=60)
    assert reply.usage.completion_tokens == 2
    return str(dict(call.trailing_metadata())[POD_HEADER])


def router_view(stub: pb_grpc.InferenceStub) -> dict[str, str]:
    """Each pod the router knows, with its phase (the router's Status)."""
    _, call = stub.Status.with_call(pb.StatusRequest(), timeout=10)
    return {pod["pod"]: pod["phase"] for pod in json.loads(dict(call.trailing_metadata())[PODS_HEADER])}


@pytest.fixture(scope="module")
def routed(cluster: Any, kubelet: Any, tiny_chat_model_dir: Path) -> Iterator[Routed]:
    namespace = f"router-{os.getpid()}"
    cluster.kubectl("apply", "-f", str(CRDS))
    cluster.kubectl("apply", "-f", str(CLUSTER_ROLE))
    cluster.kubectl("create", "namespace", namespace)
    r = Routed(cluster, kubelet, namespace)
    r.kubectl("create", "serviceaccount", "pagedserve-operator")
    r.kubectl("create", "rolebinding", "pagedserve-operator", "--clusterrole=pagedserve-operator",
              f"--serviceaccount={namespace}:pagedserve-operator")
    r.start_operator()
    model = {"apiVersion": "pagedserve.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "tiny"},
             "spec": {"model": "/models/tiny", "replicas": 2, "gpusPerPod": 0,
                      "modelVolume": {"mountPath": "/models/tiny", "hostPath": {"path": str(tiny_chat_model_dir)}},
                      "cache": {"blockSize": 4, "numBlocks": 64}, "scheduler": {"maxNumSeqs": 4},
                      # round-robin: the spread is what the test checks, not the choice (tests/router has that)
                      "router": {"policy": "round-robin"}}}
    r.apply(model)
    try:
        yield r
    finally:
        r.kubectl("delete", "pagedmodel", "--all", "--wait=false", check=False)
        try:  # the operator removes its finalizer before it goes
            wait_for(lambda: not r.get("pagedmodels", "")["items"], "the operator releasing the models", timeout=30)
        finally:
            r.stop_operator()
            cluster.kubectl("delete", "pods", "--all", "-n", namespace, "--wait=false", check=False)
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_one_channel_to_the_router_spreads_requests_over_the_pods(routed: Routed) -> None:
    wait_for(lambda: len(routed.ready_pods("model")) == 2, "two ready model pods", timeout=240)
    public, pods_service = routed.get("service", "tiny"), routed.get("service", "tiny-pods")
    assert public["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    assert pods_service["spec"]["clusterIP"] == "None"
    assert pods_service["spec"]["selector"]["app.kubernetes.io/component"] == "model"
    router = routed.router_address()  # ready: it follows the slices and has a pod in sync
    pods = routed.pod_addresses()
    with grpc.insecure_channel(router) as channel:
        stub = pb_grpc.InferenceStub(channel)
        wait_for(lambda: sorted(p for p, phase in router_view(stub).items() if phase == "in sync") == sorted(pods),
                 f"both pods in sync at the router ({routed.diagnostics()})", timeout=30)
        before = {address: finished(address) for address in pods}
        chosen = Counter(complete(stub, f"Question {i}: what is a block?") for i in range(8))
    assert set(chosen) == set(pods) and min(chosen.values()) >= 3, chosen  # one connection, both pods
    for address, count in chosen.items():  # and each pod says so itself
        assert finished(address) - before[address] == count, (address, chosen)


def test_a_scaled_up_pod_takes_requests_within_seconds(routed: Routed) -> None:
    old = set(routed.pod_addresses())
    routed.kubectl("scale", "pm", "tiny", "--replicas=3")
    wait_for(lambda: len(routed.ready_pods("model")) == 3, "a third ready pod", timeout=240)
    (new,) = set(routed.pod_addresses()) - old
    ready_at = time.monotonic()
    with grpc.insecure_channel(routed.router_address()) as channel:  # a channel opened before: same router
        stub = pb_grpc.InferenceStub(channel)
        reached = wait_for(lambda: new in {complete(stub, "Scale-up: hello") for _ in range(3)},
                           f"a request at the new pod ({routed.diagnostics()})", timeout=20, poll_s=0.2)
    assert reached and time.monotonic() - ready_at < 20
    assert finished(new) >= 1


def test_a_deleted_pod_costs_no_request(routed: Routed) -> None:
    errors: list[str] = []
    sent: Counter[str] = Counter()
    stop = threading.Event()

    def client() -> None:
        with grpc.insecure_channel(routed.router_address()) as channel:
            stub = pb_grpc.InferenceStub(channel)
            while not stop.is_set():
                try:
                    sent[complete(stub, "Deletion: hello")] += 1
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code().name}: {exc.details()}")

    pods = routed.pod_addresses()
    victim_address, victim = sorted(pods.items())[0]
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        wait_for(lambda: sent[victim_address] >= 1, "a request served by the pod to delete", timeout=30)
        routed.kubectl("delete", "pod", victim, "--wait=false")
        wait_for(lambda: routed.get("pod", victim) is None, "the pod gone", timeout=60)
        counted = sum(sent.values())
        wait_for(lambda: sum(sent.values()) >= counted + 5, "requests after the deletion", timeout=30)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    assert sent[victim_address] >= 1 and len(sent) >= 2, sent  # it served before it went


def test_a_restarted_router_has_its_view_again_and_routes_within_seconds(routed: Routed) -> None:
    wait_for(lambda: len(routed.ready_pods("model")) == 3, "three ready pods again", timeout=240)
    (old,) = routed.ready_pods("router")
    routed.kubectl("delete", "pod", old["metadata"]["name"], "--wait=false")
    new = wait_for(lambda: [p for p in routed.get("pods", "")["items"]
                            if p["metadata"]["labels"].get("app.kubernetes.io/component") == "router"
                            and p["metadata"]["name"] != old["metadata"]["name"]
                            and p.get("status", {}).get("podIP")], "the Deployment's new router pod")
    address = f"{new[0]['status']['podIP']}:50051"
    started = time.monotonic()
    pods = routed.pod_addresses()

    def routes() -> bool:
        try:
            with grpc.insecure_channel(address) as channel:
                stub = pb_grpc.InferenceStub(channel)
                return {complete(stub, f"Restart {i}") for i in range(6)} == set(pods)
        except grpc.RpcError:
            return False

    assert wait_for(routes, f"the new router routing to every pod ({routed.diagnostics()})", timeout=45, poll_s=0.5)
    # its process starts (imports, tokenizer) and then needs seconds, not minutes, to see and sync every pod
    assert time.monotonic() - started < 45
    with grpc.insecure_channel(address) as channel:
        assert set(router_view(pb_grpc.InferenceStub(channel)).values()) == {"in sync"}


def test_the_router_account_reads_endpointslices_in_its_namespace_and_nothing_else(routed: Routed) -> None:
    token = routed.cluster.service_account_token(routed.namespace, ROUTER)

    def can(*args: str) -> bool:
        answer = routed.cluster.kubectl("auth", "can-i", *args, as_token=token, check=False).strip()
        assert answer in ("yes", "no"), answer
        return answer == "yes"

    ns = ("-n", routed.namespace)
    for verb in ("get", "list", "watch"):
        assert can(verb, "endpointslices.discovery.k8s.io", *ns)
    assert not can("create", "endpointslices.discovery.k8s.io", *ns)
    assert not can("list", "pods", *ns) and not can("get", "secrets", *ns) and not can("list", "services", *ns)
    assert not can("watch", "endpointslices.discovery.k8s.io", "-n", "default")
    assert not can("list", "endpointslices.discovery.k8s.io", "--all-namespaces")
    sa = routed.get("serviceaccount", ROUTER)
    assert sa["metadata"]["ownerReferences"][0]["kind"] == "PagedModel"


def test_turning_the_router_off_points_the_service_at_the_pods_and_removes_the_router(routed: Routed) -> None:
    routed.kubectl("patch", "pm", "tiny", "--type=merge", "-p", '{"spec": {"router": {"enabled": false}}}')
    wait_for(lambda: routed.get("service", "tiny")["spec"]["selector"]["app.kubernetes.io/component"] == "model",
             "the Service at the pods")
    for kind in ("deployment", "role", "rolebinding", "serviceaccount"):
        wait_for(lambda kind=kind: routed.get(kind, ROUTER) is None, f"the router's {kind} gone")
    assert {p["name"] for p in routed.get("service", "tiny")["spec"]["ports"]} == {"grpc", "http", "metrics"}
