"""kopf wiring: the PagedModel's objects are applied from the pure builders, and one loop per model
(model_loop.py) scrapes its pods, asks the pure policy for a size, applies it and writes the status. Nothing
here decides anything.

Level-based: every pass re-applies the whole desired state (server-side apply, a no-op when nothing
drifted), so a hand edit of the Deployment is put back within one interval and an operator that restarts
mid-way picks up where the status says it was. The replica count comes from `spec.replicas` when
autoscaling is off (so `kubectl scale pm/NAME`, an HPA or KEDA drive it through the scale subresource) and
from the autoscaler's `status.desiredReplicas` when it is on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from . import credentials
from .guards import build_disruption_budget, build_network_policies, disruption_budget_wanted, network_policy_enabled
from .kube import Kube, Obj, operator_namespace
from .model_loop import Logger, ModelLoop, desired_replicas
from .specs import (
    API_GROUP,
    build_deployment,
    build_pods_service,
    build_router,
    build_service,
    router_enabled,
    router_name,
)

MODELS = (API_GROUP, "pagedmodels")


@dataclass(frozen=True)
class OperatorConfig:
    interval_s: float = 15.0  # between scrapes and decisions
    scrape_timeout_s: float = 3.0
    all_namespaces: bool = False


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's own bookkeeping goes to annotations: our status schema is structural and would prune it
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # Events: our scaling decisions and real problems only
    # watching named namespaces needs no cluster-wide look at namespaces and CRDs (nor the rights for it)
    settings.scanning.disabled = not memo.config.all_namespaces
    memo.kube = Kube()
    memo.grpc_probes = await memo.kube.has_grpc_probes()
    memo.disruption_budget_api = await memo.kube.disruption_budget_api()
    memo.operator_namespace = operator_namespace()  # its pods may scrape the models' metrics port


async def apply_model(body: kopf.Body, memo: kopf.Memo, replicas: int) -> Obj:
    name, namespace, uid = body.metadata.name, body.metadata.namespace, body.metadata.uid
    assert name and namespace and uid, "a PagedModel without name, namespace or uid: not from the API server"
    kube: Kube = memo.kube
    pods_digest, router_digest = await secrets_digests(kube, namespace, body.spec)
    await apply_guards(body, memo, replicas)
    await kube.apply(build_pods_service(name, namespace, uid))
    if router_enabled(body.spec):
        for manifest in build_router(name, namespace, uid, body.spec, router_digest):
            await kube.apply(manifest)
    else:  # turned off: its objects go (the public Service below points at the pods again)
        for kind in ("Deployment", "RoleBinding", "Role", "ServiceAccount"):
            await kube.delete(kind, router_name(name), namespace)
    await kube.apply(build_service(name, namespace, uid, body.spec))
    return await kube.apply(build_deployment(name, namespace, uid, body.spec, replicas, memo.grpc_probes,
                                             pods_digest))


async def secrets_digests(kube: Kube, namespace: str, spec: Mapping[str, Any]) -> tuple[str, str]:
    """The digests of what the pods and the routers mount, read each pass: an edited Secret rolls them within an
    interval. A missing Secret is hashed as missing (its pods cannot start until it exists)."""
    wanted = credentials.secret_keys(spec, router=True)
    found = {secret: await kube.secret_data(namespace, secret) for secret in {ref.secret for ref in wanted}}
    values = {ref: (found[ref.secret] or {}).get(ref.key) for ref in wanted}
    pods = credentials.secret_keys(spec, router=False)
    return credentials.digest({ref: values[ref] for ref in pods}), credentials.digest(values)


async def apply_guards(body: kopf.Body, memo: kopf.Memo, replicas: int) -> None:
    """The NetworkPolicies (before the pods, so that none serves unguarded) and the PodDisruptionBudget (only
    for more than one pod): each made, or deleted when turned off."""
    name, namespace, uid, spec = body.metadata.name, body.metadata.namespace, body.metadata.uid, body.spec
    assert name and namespace and uid
    kube: Kube = memo.kube
    netpol = "networking.k8s.io/v1"
    if network_policy_enabled(spec):
        for manifest in build_network_policies(name, namespace, uid, spec, memo.operator_namespace):
            await kube.apply(manifest)
        if not router_enabled(spec):
            await kube.delete("NetworkPolicy", router_name(name), namespace, netpol)
    else:
        for own in (name, router_name(name)):
            await kube.delete("NetworkPolicy", own, namespace, netpol)
    if disruption_budget_wanted(spec, replicas):
        await kube.apply(build_disruption_budget(name, namespace, uid, spec, memo.disruption_budget_api))
    else:
        await kube.delete("PodDisruptionBudget", name, namespace, memo.disruption_budget_api)


@kopf.on.create(*MODELS)
@kopf.on.update(*MODELS)
@kopf.on.resume(*MODELS)
async def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A spec change (or `kubectl scale`) is applied at once, not at the next pass of the loop."""
    await apply_model(body, memo, desired_replicas(body.spec, body.status))


@kopf.daemon(*MODELS, cancellation_timeout=10.0)
async def autoscale(stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: Logger, **_: Any) -> None:
    """One loop per PagedModel for as long as it exists: scrape, decide, apply, report (model_loop.py)."""
    config: OperatorConfig = memo.config

    async def apply(replicas: int) -> Obj:
        return await apply_model(body, memo, replicas)

    def post_event(kind: str, reason: str, message: str) -> None:
        kopf.event(body, type=kind, reason=reason, message=message)

    loop = ModelLoop(body, memo.kube, apply, post_event, logger, interval_s=config.interval_s,
                     scrape_timeout_s=config.scrape_timeout_s)
    while not stopped:
        try:
            await loop.run_once()
        except Exception:  # the API server or a pod misbehaving must not end the loop
            logger.exception("reconciliation pass failed; retrying in %.0f s", memo.config.interval_s)
        await stopped.wait(memo.config.interval_s)

