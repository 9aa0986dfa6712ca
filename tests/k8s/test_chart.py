"""The Helm chart against a real API server: lint, render over several values sets and have the server
validate every object (dry run), refuse wrong values with a clear message, and then `helm install --wait`
with the test kubelet running the operator's pod (under the chart's ServiceAccount and RBAC) and the
model's pods as real processes; `helm upgrade` and `helm uninstall` (nothing left behind but the CRDs).
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import polling
import pytest
import yaml

from pagedserve.cli import build_parser
from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # fixtures' types; conftest is not imported at run time (several conftest modules exist)
    from conftest import Cluster, Kubelet

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagedserve"
HELM = Path("/opt/k8s-local/bin/helm")
Obj = dict[str, Any]

VALUE_SETS: dict[str, Obj] = {
    "defaults": {},
    "gpu-node-pool": {"model": {
        "gpusPerPod": 2, "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "runtimeClassName": "nvidia", "priorityClassName": "inference",
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H200"]}]}]}}},
        "executorResources": {"requests": {"cpu": "8", "memory": "64Gi"}},
        "modelVolume": {"mountPath": "/models", "persistentVolumeClaim": {"claimName": "weights"}},
        "model": "/models/SmolLM2-135M-Instruct.Q4_1.gguf"}, "imagePullSecrets": [{"name": "registry"}]},
    "autoscaling-off": {"model": {"replicas": 3, "autoscaling": {"enabled": False}, "router": {"enabled": False}},
                        "autoscalingPolicy": {"create": False, "name": "shared"}},
    "monitoring-on": {"monitoring": {"podMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
                      "otlp": {"endpoint": "http://otel-collector:4317"}},
    "ha-operator-all-namespaces": {"operator": {"replicas": 2, "allNamespaces": True}, "model": {"enabled": False}},
    "secured": {"model": {
        "auth": {"apiKeysSecretRef": {"name": "llm-keys"}, "cacheSaltSecretRef": {"name": "llm-salt", "key": "salt"}},
        "tls": {"secretName": "llm-tls", "clientCASecretName": "llm-clients"},
        "networkPolicy": {"publicFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
                          "podsFrom": [{"ipBlock": {"cidr": "10.8.0.0/16"}}], "monitoringNamespace": "monitoring"},
        "disruptionBudget": {"maxUnavailable": 2}}},
}


def helm(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def values_file(tmp_path: Path, values: Obj) -> str:
    path = tmp_path / "values.json"
    path.write_text(json.dumps(values))
    return str(path)


def render(tmp_path: Path, values: Obj, *extra: str) -> list[Obj]:
    out = helm("template", "rel", str(CHART), "--namespace", "chart-test", "-f", values_file(tmp_path, values),
               *extra).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


# every poll runs kubectl or helm: twice a second is enough
wait_for = functools.partial(polling.wait_for, timeout=60.0, poll_s=0.5)


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(CHART / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_chart_lints_and_the_api_server_accepts_what_it_renders(
        name: str, cluster: Cluster, crds: None, tmp_path: Path) -> None:
    values = values_file(tmp_path, VALUE_SETS[name])
    lint = helm("lint", "--strict", str(CHART), "-f", values)
    assert "0 chart(s) failed" in lint.stdout
    # --validate: capabilities come from this cluster (1.20), as at `helm install`
    manifest = helm("template", "rel", str(CHART), "--namespace", "chart-test", "-f", values, "--validate").stdout
    cluster.kubectl("create", "namespace", "chart-test", check=False)
    applied = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest)
    assert "created (server dry run)" in applied or "configured (server dry run)" in applied, applied
    kinds = {doc["kind"] for doc in yaml.safe_load_all(manifest) if doc}
    assert "PodMonitor" not in kinds  # the test cluster has no monitoring.coreos.com API
    pdb = [doc for doc in yaml.safe_load_all(manifest) if doc and doc["kind"] == "PodDisruptionBudget"]
    assert all(doc["apiVersion"] == "policy/v1beta1" for doc in pdb)  # 1.20 has no policy/v1


def test_gpu_scheduling_values_reach_the_model_and_hardening_the_operator(tmp_path: Path) -> None:
    docs = render(tmp_path, VALUE_SETS["gpu-node-pool"])
    (model,) = [d for d in docs if d["kind"] == "PagedModel"]
    wanted = VALUE_SETS["gpu-node-pool"]["model"]
    for key in ("gpusPerPod", "nodeSelector", "tolerations", "affinity", "topologySpreadConstraints",
                "runtimeClassName", "priorityClassName", "executorResources", "modelVolume"):
        assert model["spec"][key] == wanted[key], key
    assert model["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    (operator,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = operator["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["imagePullSecrets"] == [{"name": "registry"}]
    for container in pod["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["resources"]["requests"]
        assert "nvidia.com/gpu" not in json.dumps(container["resources"])


def test_router_values_reach_the_model_and_the_notes_say_where_each_api_is(crds: None, tmp_path: Path) -> None:
    (model,) = [d for d in render(tmp_path, {}) if d["kind"] == "PagedModel"]
    assert model["spec"]["router"] == {"enabled": True, "replicas": 1, "policy": "kv-aware"}  # on by default
    values = {"model": {"router": {"replicas": 2, "policy": "least-load"}}}
    (model,) = [d for d in render(tmp_path, values) if d["kind"] == "PagedModel"]
    assert model["spec"]["router"] == {"enabled": True, "replicas": 2, "policy": "least-load"}
    notes = helm("install", "rel", str(CHART), "--dry-run", "--namespace", "chart-test",
                 "-f", values_file(tmp_path, values)).stdout
    assert "port-forward svc/rel-pagedserve 50051:50051\n" in notes and "svc/rel-pagedserve-pods 8000:8000" in notes
    off = {"model": {"router": {"enabled": False}}}
    (model,) = [d for d in render(tmp_path, off) if d["kind"] == "PagedModel"]
    assert model["spec"]["router"]["enabled"] is False
    notes = helm("install", "rel", str(CHART), "--dry-run", "--namespace", "chart-test",
                 "-f", values_file(tmp_path, off)).stdout
    assert "port-forward svc/rel-pagedserve 50051:50051 8000:8000" in notes and "-pods" not in notes


def test_security_values_reach_the_model(tmp_path: Path) -> None:
    (model,) = [d for d in render(tmp_path, VALUE_SETS["secured"]) if d["kind"] == "PagedModel"]
    wanted = VALUE_SETS["secured"]["model"]
    assert model["spec"]["auth"] == wanted["auth"] and model["spec"]["tls"] == wanted["tls"]
    assert model["spec"]["networkPolicy"] == {
        "enabled": True, "publicFrom": wanted["networkPolicy"]["publicFrom"],
        "podsFrom": wanted["networkPolicy"]["podsFrom"],
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}
    assert model["spec"]["disruptionBudget"] == {"enabled": True, "maxUnavailable": 2}
    (default,) = [d for d in render(tmp_path, {}) if d["kind"] == "PagedModel"]
    assert "auth" not in default["spec"] and "tls" not in default["spec"]  # plain unless asked
    assert default["spec"]["networkPolicy"] == {"enabled": True}  # guarded by default: the CRD fills in the rest
    assert default["spec"]["disruptionBudget"] == {"enabled": True, "maxUnavailable": 1}


def test_monitoring_renders_only_where_the_cluster_has_the_api(tmp_path: Path) -> None:
    values = VALUE_SETS["monitoring-on"]
    without = {d["kind"] for d in render(tmp_path, values)}
    assert "PodMonitor" not in without and "ConfigMap" in without
    docs = render(tmp_path, values, "--api-versions", "monitoring.coreos.com/v1/PodMonitor")
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["selector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["model", "router"]}]
    assert monitor["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True  # the router's `pod` label
    (dashboard,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["pagedserve.json"])["panels"]
    (model,) = [d for d in docs if d["kind"] == "PagedModel"]
    assert {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel-collector:4317"} in model["spec"]["env"]


@pytest.mark.parametrize(("values", "message"), [
    ({"operator": {"replicas": 0}}, "/operator/replicas"),
    ({"model": {"gpusPerPod": -1}}, "/model/gpusPerPod"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"model": {"gpus": 1}}, "gpus"),  # a typo: unknown keys are refused
    ({"model": {"modelVolume": {"hostPath": {"path": "/w"}, "persistentVolumeClaim": {"claimName": "c"}}}},
     "/model/modelVolume"),
    ({"otlp": {"endpoint": "otel:4317"}}, "/otlp/endpoint"),
    ({"model": {"router": {"policy": "fastest"}}}, "/model/router/policy"),
    ({"model": {"router": {"replicas": 0}}}, "/model/router/replicas"),
    ({"model": {"tls": {"clientCASecretName": "clients"}}}, "/model/tls"),  # mutual TLS is TLS first
    ({"model": {"auth": {"apiKeysSecretRef": {"name": "Not_A_Name"}}}}, "/model/auth/apiKeysSecretRef/name"),
    ({"model": {"disruptionBudget": {"maxUnavailable": 0}}}, "/model/disruptionBudget/maxUnavailable"),
    ({"model": {"networkPolicy": {"monitoringNamespace": "Monitoring"}}}, "/model/networkPolicy/monitoringNamespace"),
])
def test_wrong_values_fail_at_install_with_the_field_named(values: Obj, message: str, tmp_path: Path) -> None:
    result = helm("template", "rel", str(CHART), "-f", values_file(tmp_path, values), check=False)
    assert result.returncode != 0 and "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_command_line_the_chart_gives_is_accepted_by_pagedserve(name: str, tmp_path: Path) -> None:
    """The chart's own containers (operator, cleanup hook); the model pods' come from operator/specs.py,
    whose arguments tests/operator/test_specs.py parses the same way."""
    docs = render(tmp_path, VALUE_SETS[name])
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job")]
    assert pods
    for pod in pods:
        for container in pod["containers"]:
            assert container["command"] == ["pagedserve"]
            argv = container["args"]
            args = build_parser(argv).parse_args(argv)
            assert args.command in ("operator", "delete-models")


def test_helm_install_serves_upgrade_changes_it_and_uninstall_leaves_nothing(
        cluster: Cluster, kubelet: Kubelet, crds: None, tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    namespace = "helm-e2e"
    values = {
        "operator": {"interval": 1},
        "model": {"name": "tiny", "model": "/models/tiny", "gpusPerPod": 1,
                  "modelVolume": {"mountPath": "/models/tiny", "hostPath": {"path": str(tiny_chat_model_dir)}},
                  "cache": {"blockSize": 4, "numBlocks": 64}, "scheduler": {"maxNumSeqs": 4},
                  "autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
        "autoscalingPolicy": {"spec": {"targetBlockPressure": 0.9, "cooldownSeconds": 2}},
    }
    install = helm("install", "rel", str(CHART), "--namespace", namespace, "--create-namespace", "--wait",
                   "--timeout", "4m", "-f", values_file(tmp_path, values), timeout=300)
    assert "pagedserve generate --address 127.0.0.1:50051" in install.stdout  # NOTES.txt
    assert "127.0.0.1:8000/v1/completions" in install.stdout

    def get(kind: str, name: str = "") -> Any:
        out = cluster.kubectl("-n", namespace, "get", kind, *([name] if name else []), "-o", "json", check=False)
        return json.loads(out) if out.strip() else None

    def ready_model_pods() -> list[Obj]:
        pods = get("pods", "")["items"]
        return [p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "model" and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]

    try:
        operator_pod = next(p for p in get("pods")["items"]
                            if p["metadata"]["labels"].get("app.kubernetes.io/component") == "operator")
        assert operator_pod["spec"]["serviceAccountName"] == "rel-pagedserve-operator"
        (pod,) = wait_for(ready_model_pods, "the model's pod ready", timeout=180)
        with grpc.insecure_channel(f"{pod['status']['podIP']}:50051") as channel:
            reply = pb_grpc.InferenceStub(channel).Complete(pb.GenerateRequest(
                text="Hello", params=pb.GenerationParameters(max_tokens=4, ignore_eos=True)), timeout=60)
        assert reply.usage.completion_tokens == 4
        wait_for(lambda: get("pagedmodel", "tiny").get("status", {}).get("readyReplicas") == 1, "status ready")

        upgrade = {**values, "model": {**values["model"], "replicas": 2, "autoscaling": {"enabled": False}},
                   "autoscalingPolicy": {"spec": {"targetBlockPressure": 0.6}}}
        helm("upgrade", "rel", str(CHART), "--namespace", namespace, "-f", values_file(tmp_path, upgrade),
             "--wait", "--timeout", "2m")
        assert get("autoscalingpolicy", "rel-pagedserve")["spec"]["targetBlockPressure"] == 0.6
        wait_for(lambda: get("deployment", "tiny")["spec"]["replicas"] == 2, "the model at 2 replicas")
    finally:
        uninstall = helm("uninstall", "rel", "--namespace", namespace, "--wait", "--timeout", "3m", check=False,
                         timeout=240)
    assert uninstall.returncode == 0, uninstall.stderr
    for kind in ("pagedmodels", "autoscalingpolicies", "deployments", "services", "serviceaccounts", "roles",
                 "rolebindings", "jobs", "kopfpeerings"):
        # the model's Deployment and Service go by garbage collection, a moment after their PagedModel
        wait_for(lambda kind=kind: not [i for i in get(kind)["items"] if i["metadata"]["name"] != "default"],
                 f"no {kind} left")
    wait_for(lambda: get("pods")["items"] == [], "every pod gone", timeout=90)
    assert "rel-pagedserve-operator" not in cluster.kubectl("get", "clusterroles", "-o", "name")
    assert "pagedmodels.pagedserve.io" in cluster.kubectl("get", "crds", "-o", "name")  # Helm keeps CRDs
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
