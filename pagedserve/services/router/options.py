"""`pagedserve router`'s flags, and the files they name loaded once at startup (a bad file stops the router with
the flag named, as a pod's public options do: frontend/public_options.py, whose limit flags a router has no use for:
the pods enforce their own limits).

Two sides, two sets of credentials: the router's public API (`--tls-*`, `--api-keys-file`: as a pod's), and its
calls to the pods (`--pod-tls-*`, and `--pod-api-key-file`: the key of the router's own calls, ListModels and
SubscribeKvEvents; a forwarded request carries its caller's key instead).
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from ..common.cache_salt import load_secret
from ..common.http_server import parse_listen
from ..common.tls import TlsConfigError, channel_credentials, server_credentials
from ..frontend.auth import ApiKeys
from ..frontend.public_options import DEFAULT_MAX_MESSAGE_BYTES, positive_int
from .choice import POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50050", help="the public gRPC API: HOST:PORT or unix:PATH")
    parser.add_argument("--http-listen", default="", metavar="HOST:PORT",
                        help="also serve the OpenAI-compatible HTTP API here, forwarding to the pods' own (off if "
                             "empty); TLS and keys as gRPC's")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port, on --listen's host (0: off)")
    parser.add_argument("--endpoints", type=endpoint_list, default=[], metavar="ADDR,ADDR,...",
                        help="the pods' public gRPC addresses (everything else about a pod is learnt from the pod)")
    parser.add_argument("--kubernetes-service", metavar="NAME", default="",
                        help="instead of --endpoints: the pods behind this Service, followed through its "
                             "EndpointSlices (ready pods join, not-ready and terminating ones drain, removed ones "
                             "leave); credentials in-cluster or from $KUBECONFIG")
    parser.add_argument("--namespace", default="",
                        help="--kubernetes-service's namespace (default: the router pod's own, else $POD_NAMESPACE,"
                             " else the kubeconfig context's)")
    parser.add_argument("--policy", choices=POLICIES, default="kv-aware",
                        help="how a pod is picked for a request (docs/routing.md)")
    parser.add_argument("--model", default="",
                        help="the served model, for the tokenizer the router hashes prompts with (default: the model"
                             " the first pod names, when this machine can resolve it)")
    public = parser.add_argument_group("the router's public API")
    public.add_argument("--tls-cert", metavar="PEM", help="serve over TLS with this certificate (chain)")
    public.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    public.add_argument("--tls-client-ca", metavar="PEM",
                        help="mutual TLS: require client certificates signed by this CA")
    public.add_argument("--api-keys-file", metavar="FILE",
                        help="`KEY TENANT` per line, the pods' file: calls need a listed key (checked here and by the"
                             " pod), and the tenant decides the cache salt")
    public.add_argument("--cache-salt-secret-file", metavar="FILE",
                        help="the fleet's cache-salt secret, the pods' file: without it the router predicts prefix "
                             "hits only for callers without a key or x-cache-salt")
    public.add_argument("--max-message-bytes", type=positive_int, default=DEFAULT_MAX_MESSAGE_BYTES,
                        help="largest request message the public API accepts")
    pods = parser.add_argument_group("the router's calls to the pods")
    pods.add_argument("--pod-tls-ca", metavar="PEM", help="the pods serve TLS: verify them with this CA")
    pods.add_argument("--pod-tls-cert", metavar="PEM", help="mutual TLS to the pods: the router's certificate")
    pods.add_argument("--pod-tls-key", metavar="PEM", help="mutual TLS to the pods: its private key")
    pods.add_argument("--pod-tls-server-name", metavar="NAME", default="",
                      help="the name the pods' certificate is checked against (default: the pod's address, which a "
                           "certificate shared by pods whose addresses come and go cannot list)")
    pods.add_argument("--pod-api-key-file", metavar="FILE",
                      help="a file holding the router's own key for the pods (its ListModels and KV event streams)")


def endpoint_list(text: str) -> list[str]:
    endpoints = [part.strip() for part in text.split(",") if part.strip()]
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"{endpoint!r} is not HOST:PORT")
    if len(set(endpoints)) != len(endpoints):
        raise argparse.ArgumentTypeError(f"an endpoint is listed twice in {text!r}")
    return endpoints


@dataclass(frozen=True)
class RouterSettings:
    credentials: grpc.ServerCredentials | None
    keys: ApiKeys | None
    cache_salt_secret: bytes | None  # None: the router cannot compute a keyed tenant's namespace
    max_message_bytes: int
    pod_credentials: grpc.ChannelCredentials | None
    pod_metadata: tuple[tuple[str, str], ...]  # the router's own calls to the pods
    pod_ssl: ssl.SSLContext | None = None  # the pods' HTTP APIs: HTTPS with the same CA and client certificate
    pod_server_name: str = ""  # the name the pods' certificate is checked against ("": the address dialled)


def load_settings(args: argparse.Namespace) -> RouterSettings:
    """Reads every file the flags name; raises ValueError (TlsConfigError, KeysFileError, CacheSaltSecretError,
    RouterConfigError) naming the flag."""
    if args.endpoints and args.kubernetes_service:
        raise RouterConfigError("--endpoints and --kubernetes-service: give one of them (the pods come from either)")
    if args.namespace and not args.kubernetes_service:
        raise RouterConfigError("--namespace is --kubernetes-service's: give that too")
    if args.http_listen:
        try:
            parse_listen(args.http_listen)
        except ValueError as exc:
            raise RouterConfigError(f"--http-listen {exc}") from None
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    keys = ApiKeys.load(args.api_keys_file) if args.api_keys_file else None
    secret = load_secret(args.cache_salt_secret_file) if args.cache_salt_secret_file else None
    pod_credentials, pod_ssl = None, None
    if args.pod_tls_ca or args.pod_tls_cert or args.pod_tls_key:
        try:
            pod_credentials = channel_credentials(args.pod_tls_ca, args.pod_tls_cert, args.pod_tls_key)
        except TlsConfigError as exc:  # its messages name the client's flags: --tls-ca is --pod-tls-ca here
            raise RouterConfigError(f"--pod-tls-*: {exc}") from None
        pod_ssl = _pod_ssl(args.pod_tls_ca, args.pod_tls_cert, args.pod_tls_key)
    if args.pod_tls_server_name and pod_credentials is None:
        raise RouterConfigError("--pod-tls-server-name is for TLS to the pods: give --pod-tls-ca too")
    pod_metadata = (("authorization", f"Bearer {_read_key(args.pod_api_key_file)}"),) if args.pod_api_key_file else ()
    return RouterSettings(credentials, keys, secret, args.max_message_bytes, pod_credentials, pod_metadata, pod_ssl,
                          args.pod_tls_server_name)


class RouterConfigError(ValueError):
    """A flag of the router's own that names a bad file: the message names the flag, never a key."""


def _pod_ssl(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """The client TLS of the router's HTTP calls to the pods, from the files the gRPC credentials were read from
    (already checked to be PEM, the certificate and key given together)."""
    try:
        context = ssl.create_default_context(cafile=ca)
        if cert and key:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise RouterConfigError(f"--pod-tls-*: cannot load them for HTTPS ({exc})") from None
    return context


def _read_key(path: str) -> str:
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise RouterConfigError(f"--pod-api-key-file {path}: cannot read it ({exc})") from None
    if not key or len(key.split()) != 1:
        raise RouterConfigError(f"--pod-api-key-file {path}: must hold one key, on one line")
    return key
