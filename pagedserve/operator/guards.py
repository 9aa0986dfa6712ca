"""What guards a PagedModel's pods: NetworkPolicies (who may reach which port) and a PodDisruptionBudget (how
many pods a drain may take at once). Pure, like specs.py: a spec in, manifests out.

NetworkPolicies (`spec.networkPolicy`, on by default) restrict ingress only; the pods' own calls out (DNS,
OTLP, the weights' volume) are left alone. One selects the model's pods (named NAME), one the routers'
(NAME-router, with the router on):

    pods' gRPC/HTTP  the router's pods (for the ports the router serves) and `podsFrom`; a port the router does not
                     serve, or every port with the router off, is the front door: `publicFrom` (omitted: anyone)
    routers' gRPC    `publicFrom` (omitted: anyone: it is the model's public address)
    metrics, both    `metricsFrom` (the chart fills in its monitoring namespace) and the operator's own pods,
                     which scrape the model pods' /metrics; nobody else

A peer is Kubernetes' own NetworkPolicyPeer (podSelector, namespaceSelector, ipBlock), passed through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .specs import GRPC_PORT, HTTP_PORT, METRICS_PORT, Manifest, metadata, router_enabled, router_name, selector

OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/component": "operator"}
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server from 1.21
ROUTER_SERVES = {"grpc": GRPC_PORT, "http": HTTP_PORT}  # the pod ports the router forwards to
POD_PUBLIC_PORTS = {"grpc": GRPC_PORT, "http": HTTP_PORT}


def network_policy_enabled(spec: Mapping[str, Any]) -> bool:
    return bool((spec.get("networkPolicy") or {}).get("enabled", True))


def operator_peer(operator_namespace: str | None, namespace: str) -> list[Manifest]:
    """The operator's pods, which scrape /metrics; none when it runs outside the cluster (its namespace unknown)."""
    if not operator_namespace:
        return []
    pods: Manifest = {"podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}
    if operator_namespace == namespace:
        return [pods]
    return [{**pods, "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}}}]


def _ports(ports: Mapping[str, int]) -> list[Manifest]:
    return [{"protocol": "TCP", "port": port} for port in ports.values()]


def _rule(ports: Mapping[str, int], peers: list[Manifest] | None) -> list[Manifest]:
    """An ingress rule: `peers` None opens the ports to anyone; an empty list opens them to no one (no rule)."""
    if not ports or peers == []:
        return []
    return [{"ports": _ports(ports)} if peers is None else {"ports": _ports(ports), "from": peers}]


def build_network_policies(name: str, namespace: str, uid: str, spec: Mapping[str, Any],
                           operator_namespace: str | None) -> list[Manifest]:
    """The pods' NetworkPolicy, and the routers' when the router is on."""
    config = spec.get("networkPolicy") or {}
    public: list[Manifest] | None = list(config["publicFrom"]) if config.get("publicFrom") else None
    pods_from, metrics = list(config.get("podsFrom") or []), list(config.get("metricsFrom") or [])
    metrics += operator_peer(operator_namespace, namespace)
    routed = router_enabled(spec)
    forwarded = {k: v for k, v in POD_PUBLIC_PORTS.items() if routed and k in ROUTER_SERVES}
    front = {k: v for k, v in POD_PUBLIC_PORTS.items() if k not in forwarded}
    routers = [{"podSelector": {"matchLabels": selector(name, "router")}}]
    # pods_from widens the front door where it is closed, and is moot where it is open to anyone
    pods_ingress = [*_rule(forwarded, routers + pods_from),
                    *_rule(front, None if public is None else public + pods_from),
                    *_rule({"metrics": METRICS_PORT}, metrics)]
    policies = [_policy(name, namespace, uid, name, "model", pods_ingress)]
    if routed:
        router_ingress = [*_rule(ROUTER_SERVES, public), *_rule({"metrics": METRICS_PORT}, metrics)]
        policies.append(_policy(name, namespace, uid, router_name(name), "router", router_ingress))
    return policies


def _policy(name: str, namespace: str, uid: str, own: str, component: str, ingress: list[Manifest]) -> Manifest:
    # policyTypes Ingress with these rules: whatever no rule allows is refused (an empty list refuses everything)
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(name, namespace, uid, own, component),
            "spec": {"podSelector": {"matchLabels": selector(name, component)}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def disruption_budget_wanted(spec: Mapping[str, Any], replicas: int) -> bool:
    """A budget guards a fleet of more than one pod: with one, it would only block a drain forever."""
    return replicas > 1 and bool((spec.get("disruptionBudget") or {}).get("enabled", True))


def build_disruption_budget(name: str, namespace: str, uid: str, spec: Mapping[str, Any],
                            api_version: str) -> Manifest:
    """The model pods' PodDisruptionBudget in the policy API the cluster serves (policy/v1, else v1beta1)."""
    max_unavailable = int((spec.get("disruptionBudget") or {}).get("maxUnavailable", 1))
    return {"apiVersion": api_version, "kind": "PodDisruptionBudget", "metadata": metadata(name, namespace, uid),
            "spec": {"selector": {"matchLabels": selector(name)}, "maxUnavailable": max_unavailable}}
