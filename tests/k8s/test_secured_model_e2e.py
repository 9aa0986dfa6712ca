"""A secured PagedModel on a real control plane: credentials from Secrets, NetworkPolicies, a PodDisruptionBudget.

The operator runs with exactly the chart's ClusterRole (through a ServiceAccount's token); the test kubelet runs the
pods and the router as real processes from the operator's pod templates, with the Secrets' keys as files. The model
`tiny` (random weights, SmolLM2's tokenizer, 2 pods behind a router) serves mutual TLS with API keys: the test
checks, at the pods' own addresses, that only a client with a certificate from the CA and a listed key is served;
that the router (whose readiness is the TLS health probe) serves and reaches the pods the same way; that the guards
exist with the right selectors and the budget goes at one replica; that an edited Secret rolls the pods; and that the
API server refuses bad values of the new fields. The test kubelet enforces no NetworkPolicy: their content is
checked, not their effect.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import secrets
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import polling
import pytest
from namespaced import WithOperator

from pagedserve.operator.credentials import DIGEST_ANNOTATION
from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.services.router.servicer import POD_HEADER

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "charts" / "pagedserve" / "crds"
CLUSTER_ROLE = ROOT / "charts" / "pagedserve" / "files" / "rbac" / "operator-clusterrole.yaml"
EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
ALICE, BOB, ROUTER_KEY = "sk-alice-4f9a2c7e1b8d", "sk-bob-0d3e5f7a9c1b2", "sk-router-8e6c4a2f0d9b"
KEYS = f"{ALICE} alice\n{ROUTER_KEY} router\n"

wait_for = functools.partial(polling.wait_for, timeout=60.0, poll_s=0.5)


@dataclass(frozen=True)
class Certs:
    ca: bytes
    cert: bytes  # the model's: its pods and routers serve it, and the router presents it to the pods
    key: bytes
    client_cert: bytes
    client_key: bytes
    stranger_cert: bytes  # self-signed: from no CA the model trusts
    stranger_key: bytes


def make_certs(folder: Path, namespace: str) -> Certs:
    """A CA; the model's certificate for tiny.NAMESPACE.svc and the test kubelet's pod addresses (the router dials
    the pods by IP); a client certificate from the CA; a stranger's."""
    def openssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)

    def signed(name: str, subject: str, extensions: str) -> tuple[bytes, bytes]:
        key, csr, cert, ext = (folder / f"{name}.{s}" for s in ("key", "csr", "pem", "ext"))
        ext.write_text(extensions + "\n")
        openssl("req", *EC_KEY, "-keyout", key, "-out", csr, "-subj", subject)
        openssl("x509", "-req", "-in", csr, "-CA", folder / "ca.pem", "-CAkey", folder / "ca.key", "-CAcreateserial",
                "-out", cert, "-days", "2", "-extfile", ext)
        return cert.read_bytes(), key.read_bytes()

    openssl("req", "-x509", *EC_KEY, "-keyout", folder / "ca.key", "-out", folder / "ca.pem", "-days", "2",
            "-subj", "/CN=secured test CA")
    addresses = ",".join(f"IP:127.0.{a}.{b}" for a in range(1, 5) for b in range(2, 252))  # local_kubelet's
    model = signed("model", "/CN=tiny", f"subjectAltName=DNS:tiny.{namespace}.svc,{addresses}\n"
                                        "extendedKeyUsage=serverAuth,clientAuth")
    client = signed("client", "/CN=alice", "extendedKeyUsage=clientAuth")
    openssl("req", "-x509", *EC_KEY, "-keyout", folder / "stranger.key", "-out", folder / "stranger.pem", "-days", "2",
            "-subj", "/CN=stranger")
    return Certs((folder / "ca.pem").read_bytes(), *model, *client, (folder / "stranger.pem").read_bytes(),
                 (folder / "stranger.key").read_bytes())


def secret(name: str, data: dict[str, bytes], kind: str = "Opaque") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": kind,
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


class Secured(WithOperator):
    """The namespace, the operator, the Secrets and the PagedModel `tiny`."""

    def __init__(self, cluster: Any, kubelet: Any, namespace: str, certs: Certs, folder: Path) -> None:
        super().__init__(cluster, kubelet, namespace)
        self.certs, self.folder = certs, folder

    def diagnostics(self) -> str:
        pods = self.kubelet.logs(self.namespace, "tiny")[-6000:]
        return f"operator log (tail):\n{self.operator_log_tail()}\npods:\n{pods}"

    def credentials(self, client_cert: bool = True, stranger: bool = False) -> grpc.ChannelCredentials:
        c = self.certs
        cert, key = (c.stranger_cert, c.stranger_key) if stranger else (c.client_cert, c.client_key)
        return grpc.ssl_channel_credentials(c.ca, key if client_cert else None, cert if client_cert else None)

    def https(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=self.certs.ca.decode())
        (self.folder / "client.pem").write_bytes(self.certs.client_cert)
        (self.folder / "client.key").write_bytes(self.certs.client_key)
        context.load_cert_chain(self.folder / "client.pem", self.folder / "client.key")
        return context


@pytest.fixture(scope="module")
def secured(cluster: Any, kubelet: Any, tiny_chat_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    namespace = f"secured-{os.getpid()}"
    folder = tmp_path_factory.mktemp("secured-certs")
    certs = make_certs(folder, namespace)
    cluster.kubectl("apply", "-f", str(CRDS))
    cluster.kubectl("apply", "-f", str(CLUSTER_ROLE))
    cluster.kubectl("create", "namespace", namespace)
    s = Secured(cluster, kubelet, namespace, certs, folder)
    s.kubectl("create", "serviceaccount", "pagedserve-operator")
    s.kubectl("create", "rolebinding", "pagedserve-operator", "--clusterrole=pagedserve-operator",
              f"--serviceaccount={namespace}:pagedserve-operator")
    s.apply(secret("tiny-tls", {"tls.crt": certs.cert, "tls.key": certs.key, "ca.crt": certs.ca}, "kubernetes.io/tls"))
    s.apply(secret("tiny-clients", {"ca.crt": certs.ca}))
    s.apply(secret("tiny-keys", {"api-keys": KEYS.encode(), "router-key": f"{ROUTER_KEY}\n".encode()}))
    s.apply(secret("tiny-salt", {"cache-salt": secrets.token_bytes(32)}))
    s.start_operator()
    model = {"apiVersion": "pagedserve.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "tiny"},
             "spec": {"model": "/models/tiny", "replicas": 2, "gpusPerPod": 0,
                      "modelVolume": {"mountPath": "/models/tiny", "hostPath": {"path": str(tiny_chat_model_dir)}},
                      "cache": {"blockSize": 4, "numBlocks": 64}, "scheduler": {"maxNumSeqs": 4},
                      "router": {"policy": "round-robin"},
                      "auth": {"apiKeysSecretRef": {"name": "tiny-keys"},
                               "cacheSaltSecretRef": {"name": "tiny-salt"}},
                      "tls": {"secretName": "tiny-tls", "clientCASecretName": "tiny-clients"},
                      "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {
                          "kubernetes.io/metadata.name": "monitoring"}}}]}}}
    s.apply(model)
    try:
        yield s
    finally:
        s.kubectl("delete", "pagedmodel", "--all", "--wait=false", check=False)
        time.sleep(2)  # the operator removes its finalizer before it goes
        s.stop_operator()
        cluster.kubectl("delete", "pods", "--all", "-n", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def complete(channel: grpc.Channel, key: str | None) -> grpc.Call:
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    reply, call = pb_grpc.InferenceStub(channel).Complete.with_call(pb.GenerateRequest(
        text="Secured: hello", params=pb.GenerationParameters(max_tokens=2, ignore_eos=True)),
        metadata=metadata, timeout=60)
    assert reply.usage.completion_tokens == 2
    return call


def refused(address: str, credentials: grpc.ChannelCredentials | None, key: str | None) -> grpc.StatusCode:
    """The code a call is refused with (it must be refused)."""
    channel = (grpc.insecure_channel(address) if credentials is None
               else grpc.secure_channel(address, credentials))
    with channel, pytest.raises(grpc.RpcError) as error:
        complete(channel, key)
    return error.value.code()


def test_the_pods_serve_only_authenticated_tls_clients(secured: Secured) -> None:
    pods = wait_for(lambda: len(secured.ready_pods("model")) == 2 and secured.ready_pods("model"),
                    f"two ready model pods ({secured.diagnostics()})", timeout=300)
    for pod in pods:
        address = f"{pod['status']['podIP']}:50051"
        with grpc.secure_channel(address, secured.credentials()) as channel:
            complete(channel, ALICE)  # a certificate from the CA and a listed key: served
        assert refused(address, secured.credentials(), None) == grpc.StatusCode.UNAUTHENTICATED
        assert refused(address, secured.credentials(), "sk-mallory-7b1d3f5a9e") == grpc.StatusCode.UNAUTHENTICATED
        # no TLS, no client certificate, a certificate from another CA: the handshake fails, no call is made
        assert refused(address, None, ALICE) == grpc.StatusCode.UNAVAILABLE
        assert refused(address, secured.credentials(client_cert=False), ALICE) == grpc.StatusCode.UNAVAILABLE
        assert refused(address, secured.credentials(stranger=True), ALICE) == grpc.StatusCode.UNAVAILABLE
    # the HTTP API: the same certificate, the same keys
    url = f"https://{pods[0]['status']['podIP']}:8000/v1/models"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {ALICE}"}),
                                context=secured.https(), timeout=30) as answer:
        assert answer.status == 200
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(url, context=secured.https(), timeout=30)
    assert error.value.code == 401
    # plaintext HTTP to a TLS listener: the connection closes without an HTTP answer (not an HTTP error status)
    with pytest.raises((ConnectionError, urllib.error.URLError)) as plain:
        urllib.request.urlopen(f"http://{pods[0]['status']['podIP']}:8000/v1/models", timeout=30)
    assert not isinstance(plain.value, urllib.error.HTTPError)


def test_the_router_serves_tls_and_reaches_the_pods_over_mutual_tls(secured: Secured) -> None:
    # ready means its TLS health probe answered SERVING: a pod is in sync with it, over mutual TLS and its own key
    (router,) = wait_for(lambda: secured.ready_pods("router"), f"a ready router ({secured.diagnostics()})",
                         timeout=120)
    address = f"{router['status']['podIP']}:50051"
    pods = {f"{p['status']['podIP']}:50051" for p in secured.ready_pods("model")}
    with grpc.secure_channel(address, secured.credentials()) as channel:
        reached = {dict(complete(channel, ALICE).trailing_metadata())[POD_HEADER] for _ in range(4)}
    assert reached == pods  # round-robin over both, each over TLS
    assert refused(address, secured.credentials(), None) == grpc.StatusCode.UNAUTHENTICATED
    assert refused(address, secured.credentials(client_cert=False), ALICE) == grpc.StatusCode.UNAVAILABLE


def test_the_network_policies_and_the_disruption_budget_select_the_models_pods(secured: Secured) -> None:
    wait_for(lambda: secured.get("poddisruptionbudget", "tiny"), "the disruption budget")
    pods_policy, router_policy = secured.get("networkpolicy", "tiny"), secured.get("networkpolicy", "tiny-router")
    pod_labels = wait_for(lambda: secured.ready_pods("model"), "a ready pod", timeout=300)[0]["metadata"]["labels"]
    router_labels = wait_for(lambda: secured.ready_pods("router"), "a ready router", timeout=120)[0]["metadata"][
        "labels"]
    pods_selector = pods_policy["spec"]["podSelector"]["matchLabels"]
    assert pods_selector.items() <= pod_labels.items() and not pods_selector.items() <= router_labels.items()
    assert router_policy["spec"]["podSelector"]["matchLabels"].items() <= router_labels.items()
    ingress = {port["port"]: rule.get("from") for rule in pods_policy["spec"]["ingress"] for port in rule["ports"]}
    assert ingress[50051] == [{"podSelector": {"matchLabels": router_policy["spec"]["podSelector"]["matchLabels"]}}]
    assert ingress[9400] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    budget = secured.get("poddisruptionbudget", "tiny")
    assert budget["apiVersion"] == "policy/v1beta1"  # the test control plane (1.20) has no policy/v1
    assert budget["spec"]["maxUnavailable"] == 1 and budget["spec"]["selector"]["matchLabels"] == pods_selector
    for owned in (pods_policy, router_policy, budget):
        assert owned["metadata"]["ownerReferences"][0]["kind"] == "PagedModel"


def test_an_edited_secret_rolls_the_pods_and_its_new_key_is_served(secured: Secured) -> None:
    before = secured.get("deployment", "tiny")["spec"]["template"]["metadata"]["annotations"][DIGEST_ANNOTATION]
    secured.apply(secret("tiny-keys", {"api-keys": f"{KEYS}{BOB} bob\n".encode(),
                                       "router-key": f"{ROUTER_KEY}\n".encode()}))
    wait_for(lambda: secured.get("deployment", "tiny")["spec"]["template"]["metadata"]["annotations"][
        DIGEST_ANNOTATION] != before, "a new digest in the pod template")

    def bob_served_everywhere() -> bool:
        pods = secured.ready_pods("model")
        if len(pods) != 2:
            return False
        try:
            for pod in pods:
                with grpc.secure_channel(f"{pod['status']['podIP']}:50051", secured.credentials()) as channel:
                    complete(channel, BOB)
        except grpc.RpcError:
            return False
        return True

    wait_for(bob_served_everywhere, f"the new key served by every pod ({secured.diagnostics()})", timeout=400, poll_s=2)


def test_the_budget_goes_at_one_replica_and_the_policies_when_turned_off(secured: Secured) -> None:
    wait_for(lambda: secured.get("poddisruptionbudget", "tiny"), "the disruption budget at two replicas")
    secured.kubectl("scale", "pm", "tiny", "--replicas=1")
    wait_for(lambda: secured.get("poddisruptionbudget", "tiny") is None, "the budget deleted at one replica")
    assert secured.get("networkpolicy", "tiny") is not None
    secured.kubectl("patch", "pm", "tiny", "--type=merge", "-p", '{"spec": {"networkPolicy": {"enabled": false}}}')
    for policy in ("tiny", "tiny-router"):
        wait_for(lambda policy=policy: secured.get("networkpolicy", policy) is None, f"NetworkPolicy {policy} gone")


BAD_SPECS = [
    ({"tls": {"clientCASecretName": "clients"}}, "spec.tls.secretName: Required value"),
    ({"tls": {"secretName": "Not_A_Name"}}, "spec.tls.secretName"),
    ({"auth": {"apiKeysSecretRef": {"key": "api-keys"}}}, "spec.auth.apiKeysSecretRef.name: Required value"),
    ({"auth": {"cacheSaltSecretRef": {"name": "salt", "key": "a/b"}}}, "spec.auth.cacheSaltSecretRef.key"),
    ({"disruptionBudget": {"maxUnavailable": 0}}, "spec.disruptionBudget.maxUnavailable"),
    ({"networkPolicy": {"publicFrom": [{}]}}, "spec.networkPolicy.publicFrom"),
    ({"networkPolicy": {"podsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}},
     "spec.networkPolicy.podsFrom"),
    ({"networkPolicy": {"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0"}}]}}, "spec.networkPolicy.metricsFrom"),
    ({"networkPolicy": {"publicFrom": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}]}},
     "spec.networkPolicy.publicFrom"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_SPECS)
def test_the_api_server_refuses_bad_security_fields(secured: Secured, fields: dict[str, Any], message: str) -> None:
    model = {"apiVersion": "pagedserve.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "bad"},
             "spec": {"model": "m", **fields}}
    with pytest.raises(RuntimeError) as error:  # conftest's KubectlError, with kubectl's stderr
        secured.kubectl("create", "--dry-run=server", "--validate=false", "-f", "-", input=json.dumps(model))
    assert "is invalid" in str(error.value) and message in str(error.value), str(error.value)


def test_the_operator_account_holds_the_new_verbs_and_no_more(secured: Secured) -> None:
    token = secured.cluster.service_account_token(secured.namespace, "pagedserve-operator")

    def can(verb: str, resource: str, namespace: str = secured.namespace) -> bool:
        answer = secured.cluster.kubectl("auth", "can-i", verb, resource, "-n", namespace, as_token=token,
                                         check=False).strip()
        assert answer in ("yes", "no"), answer
        return answer == "yes"

    for resource in ("networkpolicies.networking.k8s.io", "poddisruptionbudgets.policy"):
        assert all(can(verb, resource) for verb in ("get", "create", "patch", "delete")), resource
        assert not any(can(verb, resource) for verb in ("list", "watch", "update", "deletecollection")), resource
    assert can("get", "secrets")  # one by name, for the digest
    assert not any(can(verb, "secrets") for verb in ("list", "watch", "create", "patch", "update", "delete"))
    assert not can("get", "secrets", "default")  # a RoleBinding: nothing in another namespace
