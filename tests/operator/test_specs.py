"""The pure manifest builders: what a PagedModel turns into, checked without a cluster. The containers'
arguments are parsed by pagedserve's own command line, so a pod never starts with flags a service refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedserve.cli import build_parser
from pagedserve.operator.specs import (
    BLOCK_MANAGER_SOCKET,
    EXECUTOR_SOCKET,
    build_deployment,
    build_service,
    selector_string,
)

CRDS = Path(__file__).resolve().parents[2] / "charts" / "pagedserve" / "crds"
SPEC: dict[str, Any] = {
    "model": "/models/smollm2", "modelVolume": {"mountPath": "/models", "hostPath": {"path": "/srv/weights"}},
    "gpusPerPod": 2, "cache": {"blockSize": 32, "numBlocks": 1000, "cpuSwapMiB": 256, "kvCacheDtype": "bfloat16"},
    "scheduler": {"maxNumSeqs": 8, "preemptionMode": "swap", "streamInterval": 4,
                  "spareLookahead": 3}, "slo": {"ttftMs": 500, "tpotMs": 50},
    "env": [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel:4317"}],
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                   "whenUnsatisfiable": "ScheduleAnyway"}],
    "imagePullSecrets": [{"name": "registry"}], "runtimeClassName": "nvidia",
}


def containers(spec: dict[str, Any] = SPEC) -> dict[str, dict[str, Any]]:
    deployment = build_deployment("llm", "ns", "uid-1", spec, replicas=3)
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def parsed(container: dict[str, Any]) -> Any:
    argv = list(container["args"])
    assert container["command"] == ["pagedserve"]
    return build_parser(argv).parse_args(argv)


def test_the_deployment_is_owned_selects_its_pods_and_has_the_replicas_asked_for() -> None:
    deployment = build_deployment("llm", "ns", "uid-1", SPEC, replicas=3)
    meta, spec = deployment["metadata"], deployment["spec"]
    assert meta["ownerReferences"] == [{"apiVersion": "pagedserve.io/v1alpha1", "kind": "PagedModel", "name": "llm",
                                        "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert spec["replicas"] == 3
    template_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= template_labels.items()
    assert selector_string("llm") == ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    # another model's pods never match
    other = build_deployment("llm2", "ns", "uid-2", SPEC, replicas=1)["spec"]["template"]["metadata"]["labels"]
    assert not spec["selector"]["matchLabels"].items() <= other.items()


def test_only_the_executor_asks_for_gpus_and_gpu_free_pods_ask_for_none() -> None:
    pods = containers()
    assert pods["executor"]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    for name in ("frontend", "block-manager"):
        assert "nvidia.com/gpu" not in pods[name]["resources"].get("limits", {})
        assert pods[name]["resources"]["requests"]
    cpu_only = containers({**SPEC, "gpusPerPod": 0})
    assert all("nvidia.com/gpu" not in c["resources"].get("limits", {}) for c in cpu_only.values())


def test_container_arguments_are_what_each_service_accepts() -> None:
    pods = containers()
    executor, block_manager, frontend = (parsed(pods[n]) for n in ("executor", "block-manager", "frontend"))
    assert executor.command == "executor" and executor.listen == EXECUTOR_SOCKET
    assert (executor.model, executor.block_size, executor.num_blocks, executor.cpu_swap_mib,
            executor.kv_cache_dtype) == ("/models/smollm2", 32, 1000, 256, "bfloat16")
    assert block_manager.listen == BLOCK_MANAGER_SOCKET and block_manager.geometry_from == EXECUTOR_SOCKET
    assert block_manager.num_blocks is None  # the geometry comes from the executor, never guessed twice
    assert (frontend.executor, frontend.block_manager) == (EXECUTOR_SOCKET, BLOCK_MANAGER_SOCKET)
    assert (frontend.max_num_seqs, frontend.preemption_mode, frontend.ttft_slo_ms, frontend.tpot_slo_ms) == (
        8, "swap", 500, 50)
    assert frontend.stream_interval == 4
    assert frontend.spare_lookahead == 3
    assert frontend.listen == "0.0.0.0:50051" and frontend.metrics_listen == "0.0.0.0:9400"
    assert frontend.http_listen == "0.0.0.0:8000"  # the OpenAI-compatible API


def test_the_pod_shares_one_socket_directory_and_mounts_the_weights_read_only() -> None:
    pod = build_deployment("llm", "ns", "uid-1", SPEC, replicas=1)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["run"] == {"name": "run", "emptyDir": {}}
    assert volumes["model"]["hostPath"]["path"] == "/srv/weights"
    for container in pod["containers"]:
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["run"]["mountPath"] == "/run/pagedserve"
        if container["name"] != "block-manager":
            assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel:4317"
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= container.keys()
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    for key in ("tolerations", "nodeSelector", "topologySpreadConstraints", "imagePullSecrets", "runtimeClassName"):
        assert pod[key] == SPEC[key], key
    assert "affinity" not in pod and "priorityClassName" not in pod  # unset: left to the cluster's defaults
    pvc = {**SPEC, "modelVolume": {"persistentVolumeClaim": {"claimName": "weights"}}}
    volumes = {v["name"]: v for v in build_deployment("llm", "ns", "u", pvc, 1)["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


def test_probes_check_each_container_where_it_listens() -> None:
    pods = containers()
    for name, socket in (("executor", EXECUTOR_SOCKET), ("block-manager", BLOCK_MANAGER_SOCKET)):
        probe = pods[name]["readinessProbe"]["exec"]["command"]
        assert probe == ["pagedserve", "health", socket]
        assert parsed({"command": ["pagedserve"], "args": probe[1:]}).address == socket
    ports = {p["name"]: p["containerPort"] for p in pods["frontend"]["ports"]}
    assert pods["frontend"]["readinessProbe"]["httpGet"] == {"port": "metrics", "scheme": "HTTP", "path": "/readyz"}
    assert pods["frontend"]["livenessProbe"]["httpGet"]["path"] == "/healthz" and "metrics" in ports
    grpc = build_deployment("llm", "ns", "u", SPEC, 1, grpc_probes=True)["spec"]["template"]["spec"]["containers"]
    frontend = next(c for c in grpc if c["name"] == "frontend")
    assert frontend["readinessProbe"]["grpc"] == {"port": 50051} and "httpGet" not in frontend["readinessProbe"]
    assert frontend["livenessProbe"]["httpGet"]["path"] == "/healthz"  # the engine thread: not in gRPC health
    assert all("exec" in c["readinessProbe"] for c in grpc if c["name"] != "frontend")  # unix sockets
    service = build_service("llm", "ns", "uid-1")
    assert {p["targetPort"] for p in service["spec"]["ports"]} == ports.keys() == {"grpc", "http", "metrics"}
    assert ports["http"] == int(parsed(pods["frontend"]).http_listen.rsplit(":", 1)[1])  # listens where exposed


def test_a_spec_change_changes_the_pod_template_and_replicas_do_not() -> None:
    template = build_deployment("llm", "ns", "u", SPEC, 1)["spec"]["template"]
    assert build_deployment("llm", "ns", "u", SPEC, 5)["spec"]["template"] == template
    changed = build_deployment("llm", "ns", "u", {**SPEC, "cache": {"blockSize": 16}}, 1)["spec"]["template"]
    assert changed != template


@pytest.mark.parametrize("dtype", ["bfloat16", None])
def test_optional_flags_and_volumes_appear_only_when_set(dtype: str | None) -> None:
    spec = {"model": "smollm2-135m", **({"dtype": dtype} if dtype else {})}
    executor = containers(spec)["executor"]
    assert ("--dtype" in executor["args"]) == (dtype is not None)
    assert "--num-blocks" not in executor["args"]
    volumes = build_deployment("m", "n", "u", spec, 1)["spec"]["template"]["spec"]["volumes"]
    assert "model" not in {v["name"] for v in volumes}


def schema_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """What the API server fills into an empty object of this schema."""
    return {key: schema_defaults(sub) if sub.get("type") == "object" and "properties" in sub else sub["default"]
            for key, sub in schema.get("properties", {}).items() if "default" in sub}


def test_the_crd_defaults_are_the_policy_defaults() -> None:
    import yaml

    from pagedserve.operator.policy import ScalingPolicy

    crd = yaml.safe_load((CRDS / "autoscalingpolicies.yaml").read_text())
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    defaults = schema_defaults(spec_schema)
    assert defaults.keys() == {"targetBlockPressure", "targetSloAttainment", "metricsWindowSeconds", "tolerance",
                               "scaleUp", "scaleDown", "cooldownSeconds"}
    assert ScalingPolicy.from_spec(defaults) == ScalingPolicy()
