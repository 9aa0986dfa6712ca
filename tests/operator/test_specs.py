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
    ROUTER_RULES,
    build_deployment,
    build_pods_service,
    build_router,
    build_service,
    selector,
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
    for service in (build_service("llm", "ns", "uid-1", {"router": {"enabled": False}}),
                    build_pods_service("llm", "ns", "uid-1")):
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


def router_objects(spec: dict[str, Any] = SPEC) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in build_router("llm", "ns", "uid-1", spec)}


def test_the_public_service_points_at_the_routers_and_the_pods_have_a_headless_service() -> None:
    public = build_service("llm", "ns", "uid-1", {"model": "m"})  # router.enabled defaults to true
    assert public["spec"]["selector"] == selector("llm", "router") and public["spec"]["type"] == "ClusterIP"
    assert {p["name"]: p["port"] for p in public["spec"]["ports"]} == {"grpc": 50051, "http": 8000, "metrics": 9400}
    off = build_service("llm", "ns", "uid-1", {"model": "m", "router": {"enabled": False}})
    assert off["spec"]["selector"] == selector("llm")  # as before the router: the pods
    pods = build_pods_service("llm", "ns", "uid-1")
    assert pods["metadata"]["name"] == "llm-pods" and pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["selector"] == selector("llm")
    assert pods["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    deployment_pods = build_deployment("llm", "ns", "uid-1", SPEC, 1)["spec"]["template"]["metadata"]["labels"]
    router_pods = router_objects()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    # each Service selects its own pods only: the routers never route to routers, the pods never get the public one
    assert selector("llm").items() <= deployment_pods.items() and not selector("llm").items() <= router_pods.items()
    assert selector("llm", "router").items() <= router_pods.items()
    assert not selector("llm", "router").items() <= deployment_pods.items()


def test_the_router_follows_the_pods_service_with_the_policy_asked_for() -> None:
    spec = {**SPEC, "router": {"replicas": 3, "policy": "least-load"}}
    deployment = router_objects(spec)["Deployment"]
    assert deployment["metadata"]["name"] == "llm-router" and deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["selector"]["matchLabels"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parsed(container)
    assert args.command == "router" and (args.kubernetes_service, args.namespace, args.policy) == (
        "llm-pods", "ns", "least-load")
    assert args.listen == "0.0.0.0:50051" and args.metrics_port == 9400 and args.endpoints == []
    assert args.model == "/models/smollm2"
    default = parsed(router_objects()["Deployment"]["spec"]["template"]["spec"]["containers"][0])
    assert default.policy == "kv-aware" and router_objects()["Deployment"]["spec"]["replicas"] == 1
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": 50051, "http": 8000, "metrics": 9400}


def test_the_router_pod_is_hardened_gpu_free_and_probed_by_its_health() -> None:
    pod = router_objects()["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["serviceAccountName"] == "llm-router" and pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {}) and container["resources"]["requests"]
    # the GPU pool's placement is the model pods', not the router's
    assert not {"tolerations", "nodeSelector", "runtimeClassName", "topologySpreadConstraints"} & pod.keys()
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["pagedserve", "health"] and parsed({"command": ["pagedserve"], "args": probe[1:]}).address == (
        "0.0.0.0:50051")
    assert container["livenessProbe"]["tcpSocket"] == {"port": "grpc"}  # no pod to route to is not a broken router
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True and mounts["scratch"]["mountPath"] == "/scratch"  # its tokenizer


def test_the_router_may_read_endpointslices_in_its_namespace_and_nothing_else() -> None:
    objects = router_objects()
    assert [o["kind"] for o in build_router("llm", "ns", "u", SPEC)] == [
        "ServiceAccount", "Role", "RoleBinding", "Deployment"]  # the rights exist before the pods that use them
    role, binding = objects["Role"], objects["RoleBinding"]
    assert role["rules"] == ROUTER_RULES == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                              "verbs": ["get", "list", "watch"]}]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ns"  # a Role: one namespace
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llm-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llm-router", "namespace": "ns"}]
    for owned in objects.values():
        assert owned["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_the_operator_holds_what_it_grants_the_router_and_may_manage_its_objects() -> None:
    import yaml

    role = yaml.safe_load((CRDS.parent / "files" / "rbac" / "operator-clusterrole.yaml").read_text())

    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in role["rules"])

    for rule in ROUTER_RULES:  # RBAC refuses a Role granting more than its creator holds
        assert all(allowed(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"])
    for group, resource in (("", "serviceaccounts"), ("rbac.authorization.k8s.io", "roles"),
                            ("rbac.authorization.k8s.io", "rolebindings"), ("apps", "deployments")):
        assert all(allowed(group, resource, verb) for verb in ("create", "patch", "delete")), resource
    assert not allowed("rbac.authorization.k8s.io", "roles", "escalate")
    assert not allowed("rbac.authorization.k8s.io", "roles", "bind")
    # Secrets: read one by name for the digest that rolls the pods (credentials.py); never listed nor watched
    assert allowed("", "secrets", "get")
    assert not any(allowed("", "secrets", verb) for verb in ("list", "watch", "create", "patch", "delete"))


def test_the_crd_bounds_and_defaults_of_the_router() -> None:
    import yaml

    crd = yaml.safe_load((CRDS / "pagedmodels.yaml").read_text())
    router = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]
    assert schema_defaults(router) == {"enabled": True, "replicas": 1, "policy": "kv-aware"}
    assert router["default"] == {}  # so that a model without `router` gets the defaults, the router included
    from pagedserve.services.router.choice import POLICIES

    assert router["properties"]["policy"]["enum"] == list(POLICIES)
    assert (router["properties"]["replicas"]["minimum"], router["properties"]["replicas"]["maximum"]) == (1, 16)
