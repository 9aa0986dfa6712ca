"""The test kubelet against the real control plane: what the operator's pods will rely on.

One Deployment (three containers sharing an emptyDir, a hostPath for the test to flip liveness, fieldRef
env expanded into args, a 0.0.0.0 listener, httpGet/exec/tcpSocket probes, a GPU request) is created once
per module and the tests below act on it in order: serve, SIGKILL, liveness, delete.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kubernetes
import polling
import pytest
from kubelet_container import expand, rewriter
from kubernetes.client.exceptions import ApiException
from local_kubelet import as_dict

if TYPE_CHECKING:  # fixtures' types; conftest is not imported at run time (several conftest modules exist)
    from conftest import Cluster, Kubelet

Obj = dict[str, Any]


wait_for = functools.partial(polling.wait_for, timeout=20.0)


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits for PID 1, which may be slow to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def http_get(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, never a proxy
    with opener.open(url, timeout=5) as response:
        return str(response.read().decode())


@pytest.mark.parametrize(("text", "expanded"), [
    ("$(A)-$(B)", "1-two"),
    ("$$(A)", "$(A)"),          # escaped
    ("$$$(A)", "$1"),
    ("$(MISSING)", "$(MISSING)"),  # undefined names stay
    ("$(A", "$(A"),             # unterminated
    ("a$b$", "a$b$"),
    ("$()", "$()"),
])
def test_expand_is_kubernetes_expansion(text: str, expanded: str) -> None:
    assert expand(text, {"A": "1", "B": "two"}) == expanded


def test_rewriter_maps_mount_prefixes_longest_first_and_any_address_to_the_pod_ip() -> None:
    rewrite = rewriter({"/data": "/tmp/d", "/data/models/": "/tmp/m", "/run/s": "/tmp/s"}, "127.0.1.9")
    assert rewrite("--model=/data/models/x.gguf") == "--model=/tmp/m/x.gguf"
    assert rewrite("/data") == "/tmp/d"
    assert rewrite("unix:///run/s/bm.sock") == "unix:///tmp/s/bm.sock"
    assert rewrite("/var/run/s /database /data.bak") == "/var/run/s /database /data.bak"  # not a prefix of these
    assert rewrite("--listen=0.0.0.0:50051 10.0.0.0") == "--listen=127.0.1.9:50051 10.0.0.0"


def test_service_account_kubeconfig_has_exactly_its_rights(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    token = cluster.service_account_token(namespace, "reader")

    def can_list_pods() -> bool:
        answer = cluster.kubectl("auth", "can-i", "list", "pods", "-n", namespace, as_token=token, check=False)
        return answer.strip() == "yes"

    assert not can_list_pods()
    cluster.kubectl("create", "rolebinding", "reader", "--clusterrole=view", f"--serviceaccount={namespace}:reader",
                    "-n", namespace)
    wait_for(can_list_pods, "the RoleBinding in effect")
    with pytest.raises(RuntimeError, match="forbidden"):
        cluster.kubectl("create", "configmap", "nope", "-n", namespace, as_token=token)
    as_reader = kubernetes.client.CoreV1Api(
        kubernetes.config.new_client_from_config(config_file=cluster.service_account_kubeconfig(namespace, "reader")))
    assert as_reader.list_namespaced_pod(namespace).items == []
    with pytest.raises(ApiException) as denied:
        as_reader.list_namespaced_pod("default")
    assert denied.value.status == 403


WRITER = "echo 'hello from $(POD_NAME) at $(POD_IP) $$(KEPT)' > /shared/hello.txt; exec sleep 3600"


def web_deployment(ctl_dir: Path) -> Obj:
    probe = {"periodSeconds": 1, "failureThreshold": 2}
    containers = [
        {"name": "server", "image": "unused", "command": ["python", "-m", "http.server"],
         "args": ["8080", "--bind", "0.0.0.0", "--directory", "/shared"],
         "ports": [{"name": "http", "containerPort": 8080}],
         "resources": {"limits": {"nvidia.com/gpu": "1"}},
         "readinessProbe": {"httpGet": {"path": "/hello.txt", "port": "http"}, **probe},
         "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]},
        {"name": "writer", "image": "unused", "command": ["sh", "-c"], "args": [WRITER],
         "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                 {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
         "livenessProbe": {"exec": {"command": ["sh", "-c", "test ! -e /ctl/unhealthy"]}, "initialDelaySeconds": 1,
                           **probe},
         "volumeMounts": [{"name": "shared", "mountPath": "/shared"}, {"name": "ctl", "mountPath": "/ctl"}]},
        {"name": "reader", "image": "unused", "command": ["sleep", "3600"],
         "startupProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1, "failureThreshold": 30},
         "readinessProbe": {"exec": {"command": ["test", "-f", "/shared/hello.txt"]}, **probe},
         "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]},
    ]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                         "terminationGracePeriodSeconds": 5, "containers": containers,
                         "volumes": [{"name": "shared", "emptyDir": {}},
                                     {"name": "ctl", "hostPath": {"path": str(ctl_dir), "type": "Directory"}}]}}}}


@dataclass
class Web:
    namespace: str
    ctl_dir: Path
    cluster: Cluster
    kubelet: Kubelet
    api: kubernetes.client.CoreV1Api

    def pods(self) -> list[Obj]:
        listing = self.api.list_namespaced_pod(self.namespace, label_selector="app=web", _preload_content=False)
        return list(as_dict(listing)["items"])

    def ready_pod(self) -> Obj | None:
        ready = [p for p in self.pods() if not p["metadata"].get("deletionTimestamp") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]
        return ready[0] if ready else None

    def container(self, pod: Obj, name: str) -> Obj:
        fresh = as_dict(self.api.read_namespaced_pod(pod["metadata"]["name"], self.namespace, _preload_content=False))
        return next(c for c in fresh["status"]["containerStatuses"] if c["name"] == name)

    def pid(self, pod: Obj, container: str) -> int:
        return self.kubelet.pid(self.namespace, pod["metadata"]["name"], container)

    def deployment(self) -> Obj:
        return dict(json.loads(self.cluster.kubectl("get", "deployment", "web", "-n", self.namespace, "-o", "json")))


@pytest.fixture(scope="module")
def web(cluster: Cluster, kubelet: Kubelet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    namespace = f"t-web-{os.getpid()}"
    cluster.kubectl("create", "namespace", namespace)
    ctl_dir = tmp_path_factory.mktemp("ctl")
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(web_deployment(ctl_dir)))
    yield Web(namespace, ctl_dir, cluster, kubelet, kubernetes.client.CoreV1Api(cluster.api_client()))
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_pod_becomes_ready_and_serves_at_its_own_loopback_ip(web: Web) -> None:
    start = time.monotonic()
    pod = wait_for(web.ready_pod, "a Ready web pod", timeout=30)
    print(f"pod Ready {time.monotonic() - start:.1f} s after the test started")
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    assert ip.startswith("127.0.") and pod["status"]["podIPs"] == [{"ip": ip}]
    assert pod["spec"]["nodeName"] == "fake-node-1" and pod["status"]["phase"] == "Running"
    wait_for(lambda: web.deployment()["status"].get("readyReplicas") == 1, "readyReplicas == 1")
    assert http_get(f"http://{ip}:8080/hello.txt") == f"hello from {name} at {ip} $(KEPT)\n"
    statuses = {c["name"]: c for c in pod["status"]["containerStatuses"]}
    assert all(c["ready"] and c["started"] and "running" in c["state"] for c in statuses.values())


def test_killed_container_is_restarted(web: Web) -> None:
    pod = wait_for(web.ready_pod, "a Ready web pod")
    pid = web.pid(pod, "server")
    os.kill(pid, signal.SIGKILL)
    server = wait_for(lambda: (c := web.container(pod, "server"))["restartCount"] >= 1 and c["ready"] and c,
                      "server restarted and Ready again")
    assert server["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
    assert web.pid(pod, "server") != pid
    assert "hello from" in http_get(f"http://{pod['status']['podIP']}:8080/hello.txt")


def test_failing_liveness_probe_restarts_the_container(web: Web) -> None:
    pod = wait_for(web.ready_pod, "a Ready web pod")
    (web.ctl_dir / "unhealthy").touch()
    try:
        wait_for(lambda: web.container(pod, "writer")["restartCount"] >= 1, "writer restarted by its liveness probe")
    finally:
        (web.ctl_dir / "unhealthy").unlink()
    assert "livenessProbe failed" in web.kubelet.logs(web.namespace, pod["metadata"]["name"])
    wait_for(web.ready_pod, "the pod Ready again")


def test_deleting_the_pod_stops_its_processes_and_removes_it(web: Web) -> None:
    pod = wait_for(web.ready_pod, "a Ready web pod")
    name = pod["metadata"]["name"]
    pids = [web.pid(pod, c) for c in ("server", "writer", "reader")]
    web.cluster.kubectl("delete", "pod", name, "-n", web.namespace, "--wait=false")
    wait_for(lambda: not any(alive(pid) for pid in pids), "the pod's processes gone", timeout=10)
    wait_for(lambda: name not in {p["metadata"]["name"] for p in web.pods()}, "the pod removed", timeout=10)
    replacement = wait_for(web.ready_pod, "the Deployment's replacement pod Ready")
    assert replacement["status"]["podIP"] != pod["status"]["podIP"]  # pod IPs are never reused


def test_container_without_command_says_why(cluster: Cluster, kubelet: Kubelet, namespace: str) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "imageonly"},
           "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def waiting() -> Obj | None:
        status = json.loads(cluster.kubectl("get", "pod", "imageonly", "-n", namespace, "-o", "json"))["status"]
        states = [c["state"].get("waiting", {}) for c in status.get("containerStatuses", [])]
        return states[0] if states and "message" in states[0] else None

    state = wait_for(waiting, "the container's waiting reason")
    assert state["reason"] == "CreateContainerConfigError" and "no command" in state["message"]
    assert "no command" in kubelet.logs(namespace, "imageonly")



def test_config_map_and_secret_volumes_hold_their_keys(cluster: Cluster, kubelet: Kubelet, namespace: str) -> None:
    cluster.kubectl("create", "configmap", "settings", "--from-literal=mode=fast", "-n", namespace)
    cluster.kubectl("create", "secret", "generic", "creds", "--from-literal=token=s3cret", "-n", namespace)
    script = "cat /etc/settings/mode /etc/creds/token; touch $(WORK)/made-here; exec sleep 3600"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "configured"}, "spec": {
        "containers": [{"name": "main", "image": "unused", "command": ["sh", "-c", script],
                        "env": [{"name": "WORK", "value": "/work"}],
                        "readinessProbe": {"exec": {"command": ["test", "-f", "/work/made-here"]}, "periodSeconds": 1},
                        "volumeMounts": [{"name": "settings", "mountPath": "/etc/settings"},
                                         {"name": "creds", "mountPath": "/etc/creds", "readOnly": True},
                                         {"name": "work", "mountPath": "/work", "subPath": "home"}]}],
        "volumes": [{"name": "settings", "configMap": {"name": "settings"}},
                    {"name": "creds", "secret": {"secretName": "creds"}},
                    {"name": "work", "emptyDir": {}}]}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))
    cluster.kubectl("wait", "--for=condition=Ready", "pod/configured", "-n", namespace, "--timeout=20s")
    assert "fasts3cret" in kubelet.logs(namespace, "configured")


def test_a_pod_acts_with_its_service_account_and_only_when_it_mounts_it(
        cluster: Cluster, kubelet: Kubelet, namespace: str) -> None:
    """The operator's pod calls the API server as its ServiceAccount: the kubelet hands it a kubeconfig
    with that account's token; a pod that opts out (as the model pods do) gets no credentials at all."""
    cluster.kubectl("create", "serviceaccount", "lister", "-n", namespace)
    cluster.kubectl("create", "rolebinding", "lister", "--clusterrole=view", f"--serviceaccount={namespace}:lister",
                    "-n", namespace)
    script = ("import os, kubernetes; kubernetes.config.load_kube_config(); api = kubernetes.client.CoreV1Api(); "
              f"print('pods:', len(api.list_namespaced_pod('{namespace}').items)); "
              "print('default:', api.list_namespaced_pod('default', _preload_content=False).status)")
    check = "import os; print('credentials:', os.environ.get('KUBECONFIG', 'none'))"

    def pod(name: str, command: list[str], **spec: Any) -> Obj:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
            "restartPolicy": "Never", **spec,
            "containers": [{"name": "main", "image": "unused", "command": command}]}}

    for manifest in (pod("lister", ["python", "-c", script], serviceAccountName="lister"),
                     pod("sealed", ["python", "-c", check], automountServiceAccountToken=False)):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    wait_for(lambda: "exited" in kubelet.logs(namespace, "lister") and "exited" in kubelet.logs(namespace, "sealed"),
             "both pods ran", timeout=60)
    listed = kubelet.logs(namespace, "lister")
    assert "pods: " in listed and "default:" not in listed and "403" in listed, listed  # its rights, no more
    assert "credentials: none" in kubelet.logs(namespace, "sealed")
