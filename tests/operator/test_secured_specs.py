"""A secured PagedModel's manifests, checked without a cluster: credentials from Secrets (mounts, flags, probes, the
digest that rolls the pods), the NetworkPolicies and the PodDisruptionBudget. Every flag is parsed by pagedserve's
own command line, and every file a flag names lies under a read-only mount of the Secret that holds it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pagedserve.cli import build_parser
from pagedserve.operator import credentials
from pagedserve.operator.credentials import SecretKey
from pagedserve.operator.guards import (
    build_disruption_budget,
    build_network_policies,
    disruption_budget_wanted,
    operator_peer,
)
from pagedserve.operator.specs import build_deployment, build_router, selector

CRD = Path(__file__).resolve().parents[2] / "charts" / "pagedserve" / "crds" / "pagedmodels.yaml"
SECURED: dict[str, Any] = {
    "model": "/models/m", "modelVolume": {"mountPath": "/models", "hostPath": {"path": "/srv/weights"}},
    "auth": {"apiKeysSecretRef": {"name": "keys", "key": "lines", "routerKey": "mine"},
             "cacheSaltSecretRef": {"name": "salt", "key": "cache-salt"}},
    "tls": {"secretName": "cert", "clientCASecretName": "clients"},
}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def pod(spec: dict[str, Any], grpc_probes: bool = False, digest: str = "") -> dict[str, Any]:
    return dict(build_deployment("llm", "ns", "u", spec, 2, grpc_probes, digest)["spec"]["template"])


def router_pod(spec: dict[str, Any], digest: str = "") -> dict[str, Any]:
    return dict(build_router("llm", "ns", "u", spec, digest)[-1]["spec"]["template"])


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}


def parsed(argv: list[str]) -> Any:
    return build_parser(argv).parse_args(argv)


def mounted_file(path: str, template: dict[str, Any], container: dict[str, Any]) -> tuple[str, str]:
    """The (Secret, key) a file path of `container` comes from, through its read-only mount."""
    volumes = by_name(template["spec"]["volumes"])
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/") and "secret" in volumes[mount["name"]]:
            assert mount["readOnly"] is True
            source = volumes[mount["name"]]["secret"]
            assert source["defaultMode"] == 0o440  # the pods' group reads it; nobody writes it
            file = path.removeprefix(mount["mountPath"] + "/")
            keys = {i["path"]: i["key"] for i in source.get("items", [{"key": file, "path": file}])}
            return source["secretName"], keys[file]
    raise AssertionError(f"{path} is under no Secret mount of {container['name']}")


def test_the_frontend_serves_tls_mutual_tls_and_keys_from_the_secrets_on_both_listeners() -> None:
    template = pod(SECURED)
    containers = by_name(template["spec"]["containers"])
    args = parsed(containers["frontend"]["args"])
    files = {flag: getattr(args, flag) for flag in ("tls_cert", "tls_key", "tls_client_ca", "api_keys_file",
                                                    "cache_salt_secret_file")}
    assert {flag: mounted_file(path, template, containers["frontend"]) for flag, path in files.items()} == {
        "tls_cert": ("cert", "tls.crt"), "tls_key": ("cert", "tls.key"), "tls_client_ca": ("clients", "ca.crt"),
        "api_keys_file": ("keys", "lines"), "cache_salt_secret_file": ("salt", "cache-salt")}
    assert args.http_listen and args.listen  # one process, both listeners under the same flags
    # only the frontend holds them: the executor and the block manager talk over the pod's unix sockets
    for name in ("executor", "block-manager"):
        assert not {m["name"] for m in containers[name]["volumeMounts"]} & {"tls", "client-ca", "api-keys",
                                                                             "cache-salt"}
    assert "router-key" not in str(template)  # the router's own key is the router's


def test_the_router_serves_and_calls_with_the_same_credentials() -> None:
    template = router_pod(SECURED)
    (container,) = template["spec"]["containers"]
    args = parsed(container["args"])
    flags = ("tls_cert", "tls_key", "tls_client_ca", "api_keys_file", "cache_salt_secret_file", "pod_tls_ca",
             "pod_tls_cert", "pod_tls_key", "pod_api_key_file")
    assert {flag: mounted_file(getattr(args, flag), template, container) for flag in flags} == {
        "tls_cert": ("cert", "tls.crt"), "tls_key": ("cert", "tls.key"), "tls_client_ca": ("clients", "ca.crt"),
        "api_keys_file": ("keys", "lines"), "cache_salt_secret_file": ("salt", "cache-salt"),
        "pod_tls_ca": ("cert", "ca.crt"), "pod_tls_cert": ("cert", "tls.crt"), "pod_tls_key": ("cert", "tls.key"),
        "pod_api_key_file": ("keys", "mine")}
    # the pods are dialled by IP: their certificate is checked against the name it carries (the public Service's)
    assert args.pod_tls_server_name == "llm.ns.svc"
    named = router_pod({**SECURED, "tls": {"secretName": "cert", "serverName": "llm.example.com"}})
    assert parsed(named["spec"]["containers"][0]["args"]).pod_tls_server_name == "llm.example.com"
    # without mutual TLS the router presents no certificate to the pods; without tls, no TLS flag at all
    one_way = parsed(router_pod({**SECURED, "tls": {"secretName": "cert"}})["spec"]["containers"][0]["args"])
    assert one_way.pod_tls_ca and not one_way.pod_tls_cert and not one_way.tls_client_ca
    plain = parsed(router_pod({"model": "m"})["spec"]["containers"][0]["args"])
    assert not (plain.tls_cert or plain.pod_tls_ca or plain.api_keys_file or plain.pod_api_key_file)
    assert not plain.pod_tls_server_name


def test_probes_keep_working_with_tls_on() -> None:
    frontend = by_name(pod(SECURED, grpc_probes=True)["spec"]["containers"])["frontend"]
    # a kubelet's gRPC probe speaks no TLS: /readyz on the plain metrics port answers for the same state
    assert frontend["readinessProbe"]["httpGet"] == {"port": "metrics", "scheme": "HTTP", "path": "/readyz"}
    assert "grpc" in by_name(pod({"model": "m"}, grpc_probes=True)["spec"]["containers"])["frontend"]["readinessProbe"]
    template = router_pod(SECURED)
    (container,) = template["spec"]["containers"]
    command = container["readinessProbe"]["exec"]["command"]
    probe = parsed(command[1:])
    assert probe.address == "0.0.0.0:50051" and probe.server_name == "llm.ns.svc"  # the name its clients use
    assert mounted_file(probe.tls_ca, template, container) == ("cert", "ca.crt")
    assert (mounted_file(probe.tls_cert, template, container), mounted_file(probe.tls_key, template, container)) == (
        ("cert", "tls.crt"), ("cert", "tls.key"))  # mutual TLS: the router's own certificate
    named = router_pod({**SECURED, "tls": {"secretName": "cert", "serverName": "llm.example.com"}})
    assert parsed(named["spec"]["containers"][0]["readinessProbe"]["exec"]["command"][1:]).server_name == (
        "llm.example.com")
    plain = router_pod({"model": "m"})["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    assert plain == ["pagedserve", "health", "0.0.0.0:50051"]


def test_a_changed_secret_rolls_the_pods_and_no_secret_adds_nothing() -> None:
    pods_keys = credentials.secret_keys(SECURED, router=False)
    values: dict[SecretKey, str | None] = {ref: "djE=" for ref in pods_keys}
    first = credentials.digest(values)
    rotated = credentials.digest({**values, SecretKey("cert", "tls.key"): "djI="})
    missing = credentials.digest({**values, SecretKey("salt", "cache-salt"): None})
    assert len({first, rotated, missing}) == 3
    assert pod(SECURED, digest=first) != pod(SECURED, digest=rotated)  # a new template: a rollout
    assert pod(SECURED, digest=first)["metadata"]["annotations"] == {credentials.DIGEST_ANNOTATION: first}
    assert router_pod(SECURED, first)["metadata"]["annotations"] == {credentials.DIGEST_ANNOTATION: first}
    assert SecretKey("keys", "mine") not in pods_keys  # the pods' digest leaves out what only the router mounts
    assert SecretKey("keys", "mine") in credentials.secret_keys(SECURED, router=True)
    assert credentials.secret_keys({"model": "m"}, router=True) == [] and credentials.digest({}) == ""
    assert "annotations" not in pod({"model": "m"})["metadata"]  # models without Secrets do not roll on upgrade


def rules(policy: dict[str, Any]) -> dict[int, list[dict[str, Any]] | None]:
    """port -> who may reach it (None: anyone)."""
    out: dict[int, list[dict[str, Any]] | None] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port["protocol"] == "TCP" and port["port"] not in out
            out[port["port"]] = rule.get("from")
    return out


def test_network_policies_open_each_port_to_whom_it_serves() -> None:
    spec = {"model": "m", "networkPolicy": {"podsFrom": [{"podSelector": {"matchLabels": {"app": "batch"}}}],
                                            "metricsFrom": [MONITORING]}}
    pods, routers = build_network_policies("llm", "ns", "u", spec, "ops")
    assert pods["spec"]["podSelector"]["matchLabels"] == selector("llm")
    assert routers["spec"]["podSelector"]["matchLabels"] == selector("llm", "router")
    assert pods["spec"]["policyTypes"] == routers["spec"]["policyTypes"] == ["Ingress"]
    assert [p["metadata"]["name"] for p in (pods, routers)] == ["llm", "llm-router"]
    assert all(p["metadata"]["ownerReferences"][0]["uid"] == "u" for p in (pods, routers))
    operator = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pagedserve",
                                                "app.kubernetes.io/component": "operator"}},
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}
    routed = [{"podSelector": {"matchLabels": selector("llm", "router")}}, *spec["networkPolicy"]["podsFrom"]]
    assert rules(pods) == {50051: routed, 8000: routed, 9400: [MONITORING, operator]}  # both APIs: the routers'
    assert rules(routers) == {50051: None, 8000: None, 9400: [MONITORING, operator]}  # the front door: anyone


def test_network_policies_narrow_the_front_door_and_follow_the_router() -> None:
    office = {"ipBlock": {"cidr": "10.1.0.0/16"}}
    spec = {"model": "m", "router": {"enabled": False}, "networkPolicy": {"publicFrom": [office]}}
    (pods,) = build_network_policies("llm", "ns", "u", spec, None)  # no router, no routers' policy
    assert rules(pods) == {50051: [office], 8000: [office]}  # no metrics peer at all: nobody scrapes
    (pods,) = build_network_policies("llm", "ns", "u", {**spec, "networkPolicy": {}}, "ns")
    same_namespace = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pagedserve",
                                                      "app.kubernetes.io/component": "operator"}}}
    assert rules(pods) == {50051: None, 8000: None, 9400: [same_namespace]}
    assert operator_peer("ns", "ns") == [same_namespace] and operator_peer(None, "ns") == []


def test_the_disruption_budget_guards_more_than_one_pod_in_the_api_the_cluster_serves() -> None:
    budget = build_disruption_budget("llm", "ns", "u", {"model": "m"}, "policy/v1beta1")
    assert budget["apiVersion"] == "policy/v1beta1" and budget["kind"] == "PodDisruptionBudget"
    assert budget["spec"] == {"selector": {"matchLabels": selector("llm")}, "maxUnavailable": 1}
    assert budget["metadata"]["ownerReferences"][0]["uid"] == "u"
    wider = build_disruption_budget("llm", "ns", "u", {"disruptionBudget": {"maxUnavailable": 3}}, "policy/v1")
    assert wider["apiVersion"] == "policy/v1" and wider["spec"]["maxUnavailable"] == 3
    assert [disruption_budget_wanted({}, n) for n in (0, 1, 2)] == [False, False, True]
    assert not disruption_budget_wanted({"disruptionBudget": {"enabled": False}}, 5)


def test_the_crd_fills_in_the_guards_and_the_secret_keys() -> None:
    spec = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    assert props["networkPolicy"]["default"] == {} and props["disruptionBudget"]["default"] == {}
    assert props["networkPolicy"]["properties"]["enabled"]["default"] is True
    assert props["disruptionBudget"]["properties"]["maxUnavailable"]["minimum"] == 1
    keys = props["auth"]["properties"]["apiKeysSecretRef"]
    assert keys["required"] == ["name"] and keys["properties"]["key"]["default"] == "api-keys"
    assert keys["properties"]["routerKey"]["default"] == "router-key"
    assert props["auth"]["properties"]["cacheSaltSecretRef"]["properties"]["key"]["default"] == "cache-salt"
    assert props["tls"]["required"] == ["secretName"]
    for peers in ("publicFrom", "podsFrom", "metricsFrom"):
        assert props["networkPolicy"]["properties"][peers]["maxItems"] == 32
