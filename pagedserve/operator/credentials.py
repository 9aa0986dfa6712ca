"""The PagedModel's credentials, taken from Secrets: what the pods' frontend and the router mount, the flags that
name the mounted files, and the digest that rolls the pods when a Secret's content changes.

Pure, like specs.py: a spec in, volumes, mounts and arguments out. The Secrets the spec may name:

    spec.auth.apiKeysSecretRef    {name, key: api-keys, routerKey: router-key}: `KEY TENANT` lines (--api-keys-file);
                                  routerKey holds the router's own key for its calls to the pods (one of those keys)
    spec.auth.cacheSaltSecretRef  {name, key: cache-salt}: the fleet's cache-salt secret (--cache-salt-secret-file)
    spec.tls.secretName           a kubernetes.io/tls Secret: tls.crt, tls.key (--tls-cert, --tls-key), and ca.crt,
                                  the CA that signed it (the router verifies the pods and probes itself with it)
    spec.tls.clientCASecretName   its ca.crt: mutual TLS (--tls-client-ca)

Each is mounted read-only (mode 0440: the files' group is the pods' fsGroup) into the frontend and the router
only; the executor and the block manager never see them. A changed Secret reaches the pods by a rollout: the
operator reads the keys it mounts (`get` on secrets, nothing else) and puts their SHA-256 in the pod template's
annotation, so a new digest is a new template.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SECRETS_DIR = "/etc/pagedserve"
TLS_DIR, CLIENT_CA_DIR = f"{SECRETS_DIR}/tls", f"{SECRETS_DIR}/client-ca"
KEYS_DIR, SALT_DIR = f"{SECRETS_DIR}/api-keys", f"{SECRETS_DIR}/cache-salt"
SECRET_MODE = 0o440  # owner root, group the pod's fsGroup (uid 1000 reads it through its group); nobody writes
DIGEST_ANNOTATION = "pagedserve.io/secrets-sha256"

Manifest = dict[str, Any]


@dataclass(frozen=True)
class SecretKey:
    """One key of one Secret in the model's namespace."""

    secret: str
    key: str


def auth(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    return spec.get("auth") or {}


def tls(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    return spec.get("tls") or {}


def tls_on(spec: Mapping[str, Any]) -> bool:
    return bool(tls(spec).get("secretName"))


def server_name(name: str, namespace: str, spec: Mapping[str, Any]) -> str:
    """The DNS name the model's certificate must carry: what the router's own probe verifies."""
    return str(tls(spec).get("serverName") or f"{name}.{namespace}.svc")


def secret_keys(spec: Mapping[str, Any], router: bool) -> list[SecretKey]:
    """Every Secret key the pods (and, with `router`, the routers) mount: what the digest covers."""
    keys, salt, cert = auth(spec).get("apiKeysSecretRef"), auth(spec).get("cacheSaltSecretRef"), tls(spec)
    out: list[SecretKey] = []
    if keys:
        out.append(SecretKey(keys["name"], keys.get("key", "api-keys")))
        if router:
            out.append(SecretKey(keys["name"], keys.get("routerKey", "router-key")))
    if salt:
        out.append(SecretKey(salt["name"], salt.get("key", "cache-salt")))
    if cert.get("secretName"):
        out += [SecretKey(cert["secretName"], k) for k in ("tls.crt", "tls.key", "ca.crt")]
    if cert.get("clientCASecretName"):
        out.append(SecretKey(cert["clientCASecretName"], "ca.crt"))
    return out


def digest(values: Mapping[SecretKey, str | None]) -> str:
    """SHA-256 over each key's (base64) value as the API server returns it; None: the Secret or key is missing
    (its pods cannot start: they roll again when it comes). "" when the spec names no Secret."""
    if not values:
        return ""
    sha = hashlib.sha256()
    for ref in sorted(values, key=lambda r: (r.secret, r.key)):
        value = values[ref]
        sha.update(f"{ref.secret}\0{ref.key}\0{'-' if value is None else '+' + value}\n".encode())
    return sha.hexdigest()


def _secret_volume(volume: str, secret: str, items: list[tuple[str, str]] | None) -> Manifest:
    source: Manifest = {"secretName": secret, "defaultMode": SECRET_MODE}
    if items is not None:
        source["items"] = [{"key": key, "path": path} for key, path in items]
    return {"name": volume, "secret": source}


def volumes(spec: Mapping[str, Any], router: bool) -> tuple[list[Manifest], list[Manifest]]:
    """The Secret volumes and their read-only mounts, for the frontend (or, with `router`, the router)."""
    keys, salt, cert = auth(spec).get("apiKeysSecretRef"), auth(spec).get("cacheSaltSecretRef"), tls(spec)
    found: list[tuple[str, Manifest]] = []
    if keys:
        items = [(keys.get("key", "api-keys"), "api-keys")]
        if router:
            items.append((keys.get("routerKey", "router-key"), "router-key"))
        found.append((KEYS_DIR, _secret_volume("api-keys", keys["name"], items)))
    if salt:
        found.append((SALT_DIR, _secret_volume("cache-salt", salt["name"], [(salt.get("key", "cache-salt"),
                                                                              "cache-salt")])))
    if cert.get("secretName"):  # whole: ca.crt is optional in a kubernetes.io/tls Secret, and a listed key must exist
        found.append((TLS_DIR, _secret_volume("tls", cert["secretName"], None)))
    if cert.get("clientCASecretName"):
        found.append((CLIENT_CA_DIR, _secret_volume("client-ca", cert["clientCASecretName"], [("ca.crt", "ca.crt")])))
    mounts = [{"name": volume["name"], "mountPath": path, "readOnly": True} for path, volume in found]
    return [volume for _, volume in found], mounts


def public_args(spec: Mapping[str, Any]) -> list[str]:
    """The flags of the public side, the pods' frontend and the router alike: TLS, mutual TLS, keys, salt."""
    args: list[str] = []
    if tls_on(spec):
        args += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
        if tls(spec).get("clientCASecretName"):
            args += ["--tls-client-ca", f"{CLIENT_CA_DIR}/ca.crt"]
    if auth(spec).get("apiKeysSecretRef"):
        args += ["--api-keys-file", f"{KEYS_DIR}/api-keys"]
    if auth(spec).get("cacheSaltSecretRef"):
        args += ["--cache-salt-secret-file", f"{SALT_DIR}/cache-salt"]
    return args


def router_pod_args(name: str, namespace: str, spec: Mapping[str, Any]) -> list[str]:
    """The router's side towards the pods: it verifies them with the certificate's CA against the certificate's
    name (it dials them by IP, which the shared certificate cannot list), presents the same certificate where
    they ask for one (mutual TLS), and calls with its own key."""
    args: list[str] = []
    if tls_on(spec):
        args += ["--pod-tls-ca", f"{TLS_DIR}/ca.crt", "--pod-tls-server-name", server_name(name, namespace, spec)]
        if tls(spec).get("clientCASecretName"):
            args += ["--pod-tls-cert", f"{TLS_DIR}/tls.crt", "--pod-tls-key", f"{TLS_DIR}/tls.key"]
    if auth(spec).get("apiKeysSecretRef"):
        args += ["--pod-api-key-file", f"{KEYS_DIR}/router-key"]
    return args


def health_command(address: str, name: str, namespace: str, spec: Mapping[str, Any]) -> list[str]:
    """`pagedserve health` at the router's own listener: over TLS when it serves TLS (verified with ca.crt against
    the certificate's name, with the certificate itself as the client's under mutual TLS)."""
    command = ["pagedserve", "health", address]
    if tls_on(spec):
        command += ["--tls-ca", f"{TLS_DIR}/ca.crt", "--server-name", server_name(name, namespace, spec)]
        if tls(spec).get("clientCASecretName"):
            command += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
    return command
