"""Pure builders of the objects a PagedModel owns: its Deployment, its Services, and its router.

No kopf or kubernetes imports: a spec (the PagedModel's `spec`, as the API server stores it with the
schema's defaults) goes in, plain manifests come out, so they are unit-tested without a cluster and the
handlers only apply them. The pod runs three containers that talk over unix sockets in a shared emptyDir:

    executor       loads the weights, owns the KV tensors; the only container with `nvidia.com/gpu`
    block-manager  the KV bookkeeping sidecar; takes the cache geometry from the executor's Info
    frontend       public gRPC API (:50051), the OpenAI-compatible HTTP API (:8000), and Prometheus /metrics
                   with /readyz and /healthz (:9400)

Every container runs as a non-root user on a read-only root filesystem; scratch space is an emptyDir.

With `spec.router.enabled` (the default) the model's public Service NAME points at `pagedserve router` pods
(Deployment NAME-router, docs/routing.md), which spread each *request* over the model's pods; the routers find the
pods through the EndpointSlices of the pods' own headless Service NAME-pods, with a ServiceAccount whose Role
allows get/list/watch on endpointslices in the namespace and nothing else. Without the router, NAME points at the
pods as before (and NAME-pods exists all the same: one address per pod, for whoever wants them).

Credentials from Secrets (TLS, mutual TLS, API keys, the cache-salt secret) are credentials.py's: the frontend and
the router mount them, and the digest of their content in the pod template's annotation rolls the pods when one
changes. NetworkPolicies and the PodDisruptionBudget are guards.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import credentials

API_GROUP = "pagedserve.io"
API_VERSION = "v1alpha1"
FIELD_MANAGER = "pagedserve-operator"
GRPC_PORT, HTTP_PORT, METRICS_PORT = 50051, 8000, 9400
RUN_DIR, SCRATCH_DIR = "/run/pagedserve", "/scratch"  # sockets; HOME and TMPDIR (the root fs is read-only)
EXECUTOR_SOCKET = f"unix:{RUN_DIR}/executor.sock"
BLOCK_MANAGER_SOCKET = f"unix:{RUN_DIR}/block-manager.sock"
MODEL_LOAD_TIMEOUT_S = 1800  # a large model on a slow volume: the startup probes allow this long

Manifest = dict[str, Any]


def labels(name: str) -> dict[str, str]:
    """The labels of everything a PagedModel owns; all but the last select its pods."""
    return {**selector(name), "app.kubernetes.io/managed-by": FIELD_MANAGER}


def selector(name: str, component: str = "model") -> dict[str, str]:
    # the component keeps a model's pods apart from its routers' and the operator's (whose instance label may be
    # the same name)
    return {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def selector_string(name: str) -> str:
    """The label selector as the scale subresource reports it (`status.selector`)."""
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def owner_reference(name: str, uid: str) -> Manifest:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "PagedModel", "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def metadata(name: str, namespace: str, uid: str, own_name: str = "", component: str = "model") -> Manifest:
    """An owned object's metadata: named `own_name` (default the model's), labelled as the model's `component`."""
    return {"name": own_name or name, "namespace": namespace,
            "labels": {**selector(name, component), "app.kubernetes.io/managed-by": FIELD_MANAGER},
            "ownerReferences": [owner_reference(name, uid)]}


def _port(name: str, port: int) -> Manifest:
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}


def router_enabled(spec: Mapping[str, Any]) -> bool:
    return bool((spec.get("router") or {}).get("enabled", True))


def pods_service_name(name: str) -> str:
    return f"{name}-pods"


def router_name(name: str) -> str:
    """The router's Deployment, ServiceAccount, Role and RoleBinding."""
    return f"{name}-router"


def build_service(name: str, namespace: str, uid: str, spec: Mapping[str, Any] | None = None) -> Manifest:
    """The model's public Service: its routers (gRPC, HTTP and their /metrics), or its pods when the router is off."""
    target = selector(name, "router") if spec is not None and router_enabled(spec) else selector(name)
    ports = [_port("grpc", GRPC_PORT), _port("http", HTTP_PORT), _port("metrics", METRICS_PORT)]
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(name, namespace, uid),
            "spec": {"type": "ClusterIP", "selector": target, "ports": ports}}


def build_pods_service(name: str, namespace: str, uid: str) -> Manifest:
    """The pods' headless Service: no virtual IP, one address per pod in its EndpointSlices (which the routers
    follow: the `grpc` port by name) and in DNS."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(name, namespace, uid, pods_service_name(name)),
            "spec": {"clusterIP": "None", "selector": selector(name), "publishNotReadyAddresses": False,
                     "ports": [_port("grpc", GRPC_PORT), _port("http", HTTP_PORT), _port("metrics", METRICS_PORT)]}}


# what the router may do, and all it may do: follow its pods' EndpointSlices in its own namespace
ROUTER_RULES: list[Manifest] = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                 "verbs": ["get", "list", "watch"]}]


def build_router(name: str, namespace: str, uid: str, spec: Mapping[str, Any],
                 secrets_digest: str = "") -> list[Manifest]:
    """The router's ServiceAccount, Role, RoleBinding and Deployment, in the order they are applied (the account
    and its rights before the pods that use them)."""
    own = router_name(name)
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": metadata(name, namespace, uid, own, "router"), "automountServiceAccountToken": False}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": metadata(name, namespace, uid, own, "router"), "rules": ROUTER_RULES}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": metadata(name, namespace, uid, own, "router"),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": own},
               "subjects": [{"kind": "ServiceAccount", "name": own, "namespace": namespace}]}
    return [account, role, binding, build_router_deployment(name, namespace, uid, spec, secrets_digest)]


def build_router_deployment(name: str, namespace: str, uid: str, spec: Mapping[str, Any],
                            secrets_digest: str = "") -> Manifest:
    """`secrets_digest`: of the Secrets the router mounts (credentials.digest); a new one rolls the routers."""
    router = spec.get("router") or {}
    secret_volumes, secret_mounts = credentials.volumes(spec, router=True)
    volumes: list[Manifest] = [{"name": "scratch", "emptyDir": {}}, *secret_volumes]
    mounts: list[Manifest] = [{"name": "scratch", "mountPath": SCRATCH_DIR}, *secret_mounts]
    model_volume, model_mounts = _model_volume(spec)
    args = ["router", "--listen", f"0.0.0.0:{GRPC_PORT}", "--http-listen", f"0.0.0.0:{HTTP_PORT}",
            "--metrics-port", str(METRICS_PORT),
            "--kubernetes-service", pods_service_name(name), "--namespace", namespace,
            "--policy", str(router.get("policy", "kv-aware")),
            "--model", spec["model"],  # the tokenizer it hashes prompts with (checked against the pods' identity)
            *credentials.public_args(spec), *credentials.router_pod_args(name, namespace, spec)]
    resources = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
    container = {
        **_container("router", args, spec, mounts + model_mounts, resources),
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        **_router_probes(name, namespace, spec),
    }
    pod_spec: Manifest = {
        "serviceAccountName": router_name(name),
        "automountServiceAccountToken": True,  # the router reads EndpointSlices, and only those (its Role)
        "containers": [container],
        "volumes": volumes + ([model_volume] if model_volume else []),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    for key in ("imagePullSecrets", "priorityClassName"):  # not the GPU pool's placement: the router needs none
        if spec.get(key):
            pod_spec[key] = spec[key]
    labels_ = {**selector(name, "router"), "app.kubernetes.io/managed-by": FIELD_MANAGER}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(name, namespace, uid, router_name(name), "router"),
        "spec": {
            "replicas": int(router.get("replicas", 1)),
            "selector": {"matchLabels": selector(name, "router")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": _template_metadata(labels_, secrets_digest), "spec": pod_spec},
        },
    }


def _router_probes(name: str, namespace: str, spec: Mapping[str, Any]) -> Manifest:
    # ready while a pod is in sync (gRPC health SERVING); alive while it listens: a router with no pod to
    # route to is not broken, and restarting it would not bring one. 0.0.0.0: the router's own listener,
    # checked over TLS where it serves TLS
    health = credentials.health_command(f"0.0.0.0:{GRPC_PORT}", name, namespace, spec)
    return {"startupProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 1, "failureThreshold": 120},
            "readinessProbe": {"exec": {"command": health}, "timeoutSeconds": 5, "periodSeconds": 2,
                               "failureThreshold": 2},
            "livenessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 20, "failureThreshold": 3}}


def _template_metadata(labels_: dict[str, str], secrets_digest: str) -> Manifest:
    out: Manifest = {"labels": labels_}
    if secrets_digest:
        out["annotations"] = {credentials.DIGEST_ANNOTATION: secrets_digest}
    return out


def _model_volume(spec: Mapping[str, Any]) -> tuple[Manifest | None, list[Manifest]]:
    """The weights' volume and its read-only mount, when the spec names one."""
    model_volume = spec.get("modelVolume")
    if not model_volume:
        return None, []
    source = ({"persistentVolumeClaim": {"claimName": model_volume["persistentVolumeClaim"]["claimName"],
                                         "readOnly": True}}
              if "persistentVolumeClaim" in model_volume
              else {"hostPath": {"path": model_volume["hostPath"]["path"], "type": "Directory"}})
    return ({"name": "model", **source},
            [{"name": "model", "mountPath": model_volume.get("mountPath", "/models"), "readOnly": True}])


def build_deployment(name: str, namespace: str, uid: str, spec: Mapping[str, Any], replicas: int,
                     grpc_probes: bool = False, secrets_digest: str = "") -> Manifest:
    """The model's Deployment at `replicas` pods (the autoscaler's or the user's number, see handlers).
    `grpc_probes`: the cluster has gRPC probes (1.24+), used for the frontend's readiness without TLS.
    `secrets_digest`: of the Secrets the pods mount (credentials.digest); a new one rolls the pods."""
    template = build_pod_template(name, spec, grpc_probes, secrets_digest)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(name, namespace, uid),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(name)},
            # a new pod is ready before an old one goes: serving capacity never dips during a rollout
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": template,
        },
    }


def build_pod_template(name: str, spec: Mapping[str, Any], grpc_probes: bool = False,
                       secrets_digest: str = "") -> Manifest:
    volumes: list[Manifest] = [{"name": "run", "emptyDir": {}}, {"name": "scratch", "emptyDir": {}}]
    mounts: list[Manifest] = [{"name": "run", "mountPath": RUN_DIR}, {"name": "scratch", "mountPath": SCRATCH_DIR}]
    model_volume, model_mounts = _model_volume(spec)
    if model_volume:
        volumes.append(model_volume)
    secret_volumes, secret_mounts = credentials.volumes(spec, router=False)  # the frontend's alone
    volumes += secret_volumes
    containers = [_executor(spec, mounts + model_mounts), _block_manager(spec, mounts),
                  _frontend(spec, mounts + model_mounts + secret_mounts, grpc_probes)]
    pod_spec: Manifest = {
        "containers": containers,
        "volumes": volumes,
        "automountServiceAccountToken": False,  # the pods never call the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "imagePullSecrets",
                "priorityClassName", "runtimeClassName"):
        if spec.get(key):
            pod_spec[key] = spec[key]
    return {"metadata": _template_metadata(labels(name), secrets_digest), "spec": pod_spec}


def _env(spec: Mapping[str, Any]) -> list[Manifest]:
    def field(path: str) -> Manifest:
        return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}

    env: list[Manifest] = [
        {"name": "POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
        {"name": "POD_IP", "valueFrom": field("status.podIP")},
        {"name": "HOME", "value": SCRATCH_DIR},
        {"name": "TMPDIR", "value": SCRATCH_DIR},
    ]
    return env + [{"name": e["name"], "value": e.get("value", "")} for e in spec.get("env", [])]


def _container(name: str, args: list[str], spec: Mapping[str, Any], mounts: list[Manifest],
               resources: Manifest) -> Manifest:
    return {
        "name": name, "image": spec.get("image", "pagedserve/pagedserve:0.1.0"),
        "imagePullPolicy": spec.get("imagePullPolicy", "IfNotPresent"),
        "command": ["pagedserve"], "args": args,
        "env": [*_env(spec), {"name": "OTEL_SERVICE_NAME", "value": f"pagedserve-{name}"}],
        "volumeMounts": mounts, "resources": resources,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }


def _health_probes(address: str, startup_s: int) -> Manifest:
    """gRPC health over the socket (`pagedserve health`); 1.20 has no grpc probe, so an exec one."""
    check = {"exec": {"command": ["pagedserve", "health", address]}, "timeoutSeconds": 5}
    return {
        "startupProbe": {**check, "periodSeconds": 2, "failureThreshold": startup_s // 2},
        "readinessProbe": {**check, "periodSeconds": 10, "failureThreshold": 2},
        "livenessProbe": {**check, "periodSeconds": 20, "failureThreshold": 3},
    }


def _executor(spec: Mapping[str, Any], mounts: list[Manifest]) -> Manifest:
    cache = spec.get("cache", {})
    args = ["executor", "--listen", EXECUTOR_SOCKET, "--model", spec["model"],
            "--block-size", str(cache.get("blockSize", 16)), "--kv-cache-mib", str(cache.get("kvCacheMiB", 512)),
            "--gpu-memory-utilization", str(cache.get("gpuMemoryUtilization", 0.9)),
            "--cpu-swap-mib", str(cache.get("cpuSwapMiB", 0)),
            "--kv-cache-dtype", str(cache.get("kvCacheDtype", "auto"))]
    for flag, value in (("--num-blocks", cache.get("numBlocks")), ("--max-model-len", cache.get("maxModelLen")),
                        ("--dtype", spec.get("dtype"))):
        if value is not None:
            args += [flag, str(value)]
    resources: Manifest = {"requests": {"cpu": "2", "memory": "8Gi"}}
    custom = spec.get("executorResources") or {}
    resources = {"requests": {**resources["requests"], **custom.get("requests", {})},
                 "limits": dict(custom.get("limits", {}))}
    gpus = int(spec.get("gpusPerPod", 1))
    if gpus:
        resources["limits"]["nvidia.com/gpu"] = str(gpus)  # a quantity: server-side apply wants a string
    if not resources["limits"]:
        del resources["limits"]
    return {**_container("executor", args, spec, mounts, resources), **_health_probes(EXECUTOR_SOCKET,
                                                                                     MODEL_LOAD_TIMEOUT_S)}


def _block_manager(spec: Mapping[str, Any], mounts: list[Manifest]) -> Manifest:
    args = ["block-manager", "--listen", BLOCK_MANAGER_SOCKET, "--geometry-from", EXECUTOR_SOCKET,
            "--geometry-timeout", str(MODEL_LOAD_TIMEOUT_S)]
    resources = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    return {**_container("block-manager", args, spec, mounts, resources),
            **_health_probes(BLOCK_MANAGER_SOCKET, MODEL_LOAD_TIMEOUT_S)}


def _frontend(spec: Mapping[str, Any], mounts: list[Manifest], grpc_probes: bool) -> Manifest:
    scheduler, slo = spec.get("scheduler", {}), spec.get("slo", {})
    args = ["frontend", "--listen", f"0.0.0.0:{GRPC_PORT}", "--http-listen", f"0.0.0.0:{HTTP_PORT}",
            "--metrics-listen", f"0.0.0.0:{METRICS_PORT}",
            "--executor", EXECUTOR_SOCKET, "--block-manager", BLOCK_MANAGER_SOCKET,
            "--sidecar-timeout", str(MODEL_LOAD_TIMEOUT_S), "--model", spec["model"],
            "--max-num-seqs", str(scheduler.get("maxNumSeqs", 64)),
            "--max-num-batched-tokens", str(scheduler.get("maxNumBatchedTokens", 512)),
            "--max-waiting-requests", str(scheduler.get("maxWaitingRequests", 256)),
            "--preemption-mode", scheduler.get("preemptionMode", "recompute"),
            "--stream-interval", str(scheduler.get("streamInterval", 1)),
            "--spare-lookahead", str(scheduler.get("spareLookahead", 8)),
            "--ttft-slo-ms", str(slo.get("ttftMs", 2000)), "--tpot-slo-ms", str(slo.get("tpotMs", 200)),
            *credentials.public_args(spec)]  # both listeners, gRPC and HTTP
    resources = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    http = {"port": "metrics", "scheme": "HTTP"}
    # the gRPC health service says NOT_SERVING until the engine runs, as /readyz does; the sidecars listen
    # on unix sockets, which gRPC probes cannot reach: they keep their exec probes. A kubelet's gRPC probe
    # speaks no TLS: with TLS on, /readyz on the plain metrics port answers for the same state
    grpc_ready = grpc_probes and not credentials.tls_on(spec)
    ready = {"grpc": {"port": GRPC_PORT}} if grpc_ready else {"httpGet": {**http, "path": "/readyz"}}
    return {
        **_container("frontend", args, spec, mounts, resources),
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        # ready once the engine runs over both sidecars; alive while its engine thread is
        "startupProbe": {"httpGet": {**http, "path": "/healthz"}, "periodSeconds": 2,
                         "failureThreshold": MODEL_LOAD_TIMEOUT_S // 2},
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {**http, "path": "/healthz"}, "periodSeconds": 20, "failureThreshold": 3},
    }
