"""The few Kubernetes API calls the operator makes, as plain dicts in and out.

The `kubernetes` client (37.x) is synchronous and returns generated models: every call here runs on a
worker thread (`asyncio.to_thread`) and converts its answer to the API's own JSON shape, so the rest of
the operator reads the field names of the API reference. Owned objects are written with server-side
apply under one field manager: re-applying the same manifest changes nothing, and a hand edit of a field
the operator owns (replicas, the pod template) is put back on the next pass. NetworkPolicies and
PodDisruptionBudgets go through the client's raw REST call: the client has no policy/v1beta1 API, which a cluster
older than 1.21 serves alone.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from .specs import API_GROUP, API_VERSION, FIELD_MANAGER

Obj = dict[str, Any]
APPLY = "application/apply-patch+yaml"  # server-side apply; JSON is YAML
MERGE = "application/merge-patch+json"
PLURALS = {"NetworkPolicy": "networkpolicies", "PodDisruptionBudget": "poddisruptionbudgets"}  # raw REST kinds
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def operator_namespace() -> str | None:
    """The namespace this operator's pod runs in (its service account's), else $POD_NAMESPACE; None outside a
    cluster."""
    try:
        return IN_CLUSTER_NAMESPACE.read_text().strip() or None
    except OSError:
        return os.environ.get("POD_NAMESPACE") or None


def load_credentials() -> None:
    """In-cluster service-account credentials when in a pod, else the kubeconfig ($KUBECONFIG)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


class Kube:
    def __init__(self) -> None:
        self.client = kubernetes.client.ApiClient()
        self.apps = kubernetes.client.AppsV1Api(self.client)
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(self.client)
        self.hpa_api: Any = None  # AutoscalingV2Api or V1Api, chosen at the first hpas() call

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Obj:
        result = await asyncio.to_thread(fn, *args, **kwargs)
        return result if isinstance(result, dict) else self.client.sanitize_for_serialization(result)

    def _rest(self, method: str, path: str, query: list[tuple[str, str]] | None = None, body: Obj | None = None,
              content_type: str | None = None) -> Any:
        """A raw call; raises ApiException as the generated calls do."""
        headers = {"Accept": "application/json", **({"Content-Type": content_type} if content_type else {})}
        request = self.client.param_serialize(method=method, resource_path=path, query_params=query or [],
                                              header_params=headers, body=body, auth_settings=["BearerToken"])
        return self.client._call_with_legacy_options(request, {"200": "object", "201": "object", "202": "object"},
                                                     None, True, None, True)

    @staticmethod
    def _path(api_version: str, kind: str, namespace: str, name: str) -> str:
        return f"/apis/{api_version}/namespaces/{namespace}/{PLURALS[kind]}/{name}"

    async def apply(self, manifest: Obj) -> Obj:
        """Server-side apply of an object we own (force: our fields are ours)."""
        meta = manifest["metadata"]
        if manifest["kind"] in PLURALS:
            path = self._path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
            query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
            return await self._call(self._rest, "PATCH", path, query, manifest, APPLY)
        patch = {"Deployment": self.apps.patch_namespaced_deployment,
                 "Service": self.core.patch_namespaced_service,
                 "ServiceAccount": self.core.patch_namespaced_service_account,
                 "Role": self.rbac.patch_namespaced_role,
                 "RoleBinding": self.rbac.patch_namespaced_role_binding}[manifest["kind"]]
        def call() -> Any:
            return patch(meta["name"], meta["namespace"], manifest, field_manager=FIELD_MANAGER, force=True,
                         _content_type=APPLY)

        try:
            return await self._call(call)
        except ApiException as exc:  # two first applies raced to create it: the second one updates
            if exc.status != 409:
                raise
            return await self._call(call)

    async def delete(self, kind: str, name: str, namespace: str, api_version: str = "") -> bool:
        """Deletes an object we own if it exists (True when it did); `api_version` for NetworkPolicy and
        PodDisruptionBudget."""
        try:
            if kind in PLURALS:
                await self._call(self._rest, "DELETE", self._path(api_version, kind, namespace, name))
                return True
            delete = {"Deployment": self.apps.delete_namespaced_deployment,
                      "ServiceAccount": self.core.delete_namespaced_service_account,
                      "Role": self.rbac.delete_namespaced_role,
                      "RoleBinding": self.rbac.delete_namespaced_role_binding}[kind]
            await self._call(delete, name, namespace)
            return True
        except ApiException as exc:
            if exc.status != 404:
                raise
            return False

    async def has_grpc_probes(self) -> bool:
        """gRPC container probes are on by default from Kubernetes 1.24 (beta; GA in 1.27)."""
        version = await self._call(kubernetes.client.VersionApi(self.client).get_code)
        major, minor = (int("".join(c for c in version[key] if c.isdigit()) or 0) for key in ("major", "minor"))
        return (major, minor) >= (1, 24)

    async def disruption_budget_api(self) -> str:
        """policy/v1 where the cluster serves it (1.21+), else policy/v1beta1 (discovery, open to every caller)."""
        group = await self._call(kubernetes.client.PolicyApi(self.client).get_api_group)
        versions = {v["groupVersion"] for v in group.get("versions", [])}
        return "policy/v1" if "policy/v1" in versions else "policy/v1beta1"

    async def secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """A Secret's data (base64 values, as stored), or None when there is no such Secret."""
        try:
            secret = await self._call(self.core.read_namespaced_secret, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(secret.get("data") or {})

    async def pods(self, namespace: str, label_selector: str) -> list[Obj]:
        answer = await self._call(self.core.list_namespaced_pod, namespace, label_selector=label_selector)
        return list(answer.get("items", []))

    async def policy(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self._call(self.custom.get_namespaced_custom_object, API_GROUP, API_VERSION, namespace,
                                    "autoscalingpolicies", name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def hpas(self, namespace: str) -> list[Obj]:
        """The namespace's HorizontalPodAutoscalers, through autoscaling/v2 where the cluster serves it (1.23 and
        newer), else autoscaling/v1: both carry the `spec.scaleTargetRef` the operator reads."""
        if self.hpa_api is None:
            group = await self._call(kubernetes.client.AutoscalingApi(self.client).get_api_group)
            served = {version["version"] for version in group.get("versions", [])}
            api = kubernetes.client.AutoscalingV2Api if "v2" in served else kubernetes.client.AutoscalingV1Api
            self.hpa_api = api(self.client)
        answer = await self._call(self.hpa_api.list_namespaced_horizontal_pod_autoscaler, namespace)
        return list(answer.get("items", []))

    async def patch_model_status(self, namespace: str, name: str, status: Obj) -> Obj:
        return await self._call(self.custom.patch_namespaced_custom_object_status, API_GROUP, API_VERSION,
                                namespace, "pagedmodels", name, {"status": status}, _content_type=MERGE)
