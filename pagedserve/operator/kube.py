"""The few Kubernetes API calls the operator makes, as plain dicts in and out.

The `kubernetes` client (37.x) is synchronous and returns generated models: every call here runs on a
worker thread (`asyncio.to_thread`) and converts its answer to the API's own JSON shape, so the rest of
the operator reads the field names of the API reference. Owned objects are written with server-side
apply under one field manager: re-applying the same manifest changes nothing, and a hand edit of a field
the operator owns (replicas, the pod template) is put back on the next pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from .specs import API_GROUP, API_VERSION, FIELD_MANAGER

Obj = dict[str, Any]
APPLY = "application/apply-patch+yaml"  # server-side apply; JSON is YAML
MERGE = "application/merge-patch+json"


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

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Obj:
        result = await asyncio.to_thread(fn, *args, **kwargs)
        return result if isinstance(result, dict) else self.client.sanitize_for_serialization(result)

    async def apply(self, manifest: Obj) -> Obj:
        """Server-side apply of an object we own (force: our fields are ours)."""
        meta = manifest["metadata"]
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

    async def delete(self, kind: str, name: str, namespace: str) -> bool:
        """Deletes an object we own if it exists (True when it did)."""
        delete = {"Deployment": self.apps.delete_namespaced_deployment,
                  "ServiceAccount": self.core.delete_namespaced_service_account,
                  "Role": self.rbac.delete_namespaced_role,
                  "RoleBinding": self.rbac.delete_namespaced_role_binding}[kind]
        try:
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

    async def patch_model_status(self, namespace: str, name: str, status: Obj) -> Obj:
        return await self._call(self.custom.patch_namespaced_custom_object_status, API_GROUP, API_VERSION,
                                namespace, "pagedmodels", name, {"status": status}, _content_type=MERGE)
