"""`--kubernetes-service NAME [--namespace NS]`: the router's pods, from the Service's EndpointSlices.

The EndpointSlice controller already knows which pods back a Service and which of them are ready (their readiness
probes) or terminating; the router follows the slices labelled `kubernetes.io/service-name=NAME` in its namespace,
the one object kind its Role lets it read (least privilege: not pods, not Services). Each change of the slices gives
a new endpoint set (`endpoints_from_slices`, pure), which the server turns into pods added, drained and removed:

- a ready endpoint takes requests (once its watcher is in sync: fleet.py);
- a present one that is not ready, or terminating, is *draining*: no new request goes there, and the requests the
  router has in flight there finish (its streams are not cut);
- one that is no longer in any slice leaves the fleet.

The port is the slice's port named `grpc` (the name the pods' headless Service gives it; the operator's), else the
slice's only port. `discovery.k8s.io/v1` where the API server serves it (1.21+), else `v1beta1` (1.20: without the
`serving`/`terminating` conditions, a terminating pod is simply removed). List, then watch from the list's version;
any error or an expired version (410) re-lists after a short pause, so a router whose watch broke (or that restarted)
has the current view again within a second or two.

The kubernetes client is synchronous: the watch runs on a thread of its own and hands each new set to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import kubernetes
from kubernetes.client.rest import ApiException

GROUP = "discovery.k8s.io"
VERSIONS = ("v1", "v1beta1")  # the first the API server serves
SERVICE_LABEL = "kubernetes.io/service-name"
PORT_NAME = "grpc"
WATCH_TIMEOUT_S = 60  # the server ends a watch after this long; the next one starts from the last version seen
RELIST_PAUSE_S = 1.0
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

# address ("IP:PORT") -> whether it takes new requests (ready and not terminating)
Endpoints = dict[str, bool]

log = logging.getLogger(__name__)


def endpoints_from_slices(slices: Iterable[Mapping[str, Any]], port_name: str = PORT_NAME) -> Endpoints:
    """The Service's endpoints across all its slices. An address in several slices (a pod moving between slices)
    takes requests if any of them says so. A slice without a usable port, and FQDN slices, give nothing."""
    endpoints: Endpoints = {}
    for item in slices:
        port = _port(item.get("ports") or [], port_name)
        if port is None or item.get("addressType") == "FQDN":
            continue
        for endpoint in item.get("endpoints") or []:
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            ip = addresses[0]  # the API promises one address per endpoint for IP slices
            address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            conditions = endpoint.get("conditions") or {}
            # an unset `ready` is to be read as ready (the API's own advice); `terminating` came in v1
            accepting = conditions.get("ready") is not False and conditions.get("terminating") is not True
            endpoints[address] = endpoints.get(address, False) or accepting
    return endpoints


def _port(ports: Iterable[Mapping[str, Any]], name: str) -> int | None:
    ports = [p for p in ports if p.get("port")]
    named = [p for p in ports if p.get("name") == name]
    chosen = named[0] if named else ports[0] if len(ports) == 1 else None
    return int(chosen["port"]) if chosen is not None else None


def default_namespace() -> str:
    """The router pod's own namespace, else $POD_NAMESPACE, else the kubeconfig context's, else `default`."""
    try:
        return Path(NAMESPACE_FILE).read_text().strip()
    except OSError:
        pass
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        _, context = kubernetes.config.list_kube_config_contexts()
        return str(context["context"].get("namespace") or "default")
    except (kubernetes.config.ConfigException, OSError, KeyError, TypeError):
        return "default"


def load_credentials() -> None:
    """The pod's ServiceAccount when in a cluster, else the kubeconfig ($KUBECONFIG)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


class EndpointSliceWatcher:
    """Follows one Service's slices; `on_change(endpoints)` runs on the event loop at each change of the set."""

    def __init__(self, service: str, namespace: str, on_change: Callable[[Endpoints], None],
                 api: kubernetes.client.CustomObjectsApi | None = None) -> None:
        self.service, self.namespace, self.on_change = service, namespace, on_change
        self.api = api
        self.selector = f"{SERVICE_LABEL}={service}"
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last: Endpoints | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.api is None:
            load_credentials()
            self.api = kubernetes.client.CustomObjectsApi()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"endpointslices/{self.service}")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # the thread ends at its watch's next event or timeout; it is a daemon

    def _run(self) -> None:
        version, problem = "", ""
        while not self._stop.is_set():
            try:
                version = version or self._version()
                self._follow(version)
                problem = ""
            except Exception as exc:  # the API server away, a timeout, a 410: re-list after a pause
                if str(exc) != problem:
                    problem = str(exc)
                    log.warning("EndpointSlices of %s/%s: %s; re-listing", self.namespace, self.service, exc)
                if isinstance(exc, ApiException) and exc.status == 404:
                    version = ""  # asked the wrong version: find the served one again
                self._stop.wait(RELIST_PAUSE_S)

    def _version(self) -> str:
        assert self.api is not None
        for version in VERSIONS:
            try:
                self.api.list_namespaced_custom_object(GROUP, version, self.namespace, "endpointslices", limit=1,
                                                       label_selector=self.selector, _request_timeout=10)
                log.info("following %s/%s EndpointSlices of Service %s/%s", GROUP, version, self.namespace,
                         self.service)
                return version
            except ApiException as exc:
                if exc.status != 404:
                    raise
        raise RuntimeError(f"the API server serves no {GROUP} version of {VERSIONS}")

    def _follow(self, version: str) -> None:
        """One list and the watch from it, until the watch ends or fails (the caller re-lists)."""
        assert self.api is not None
        args = (GROUP, version, self.namespace, "endpointslices")
        listing = cast(dict[str, Any], self.api.list_namespaced_custom_object(  # the API's JSON, a dict
            *args, label_selector=self.selector, _request_timeout=10))
        slices = {item["metadata"]["name"]: item for item in listing.get("items", [])}
        self._publish(slices)
        resource_version = listing["metadata"]["resourceVersion"]
        while not self._stop.is_set():
            stream = kubernetes.watch.Watch().stream(
                self.api.list_namespaced_custom_object, *args, label_selector=self.selector,
                resource_version=resource_version, timeout_seconds=WATCH_TIMEOUT_S,
                _request_timeout=WATCH_TIMEOUT_S + 10)
            for event in stream:
                if self._stop.is_set():
                    return
                item = event["object"]
                if event["type"] == "ERROR":  # 410 Gone, mostly: our version is too old
                    raise RuntimeError(f"the watch failed: {item.get('message', item)}")
                name = item["metadata"]["name"]
                resource_version = item["metadata"]["resourceVersion"]
                if event["type"] == "DELETED":
                    slices.pop(name, None)
                else:
                    slices[name] = item
                self._publish(slices)

    def _publish(self, slices: Mapping[str, Mapping[str, Any]]) -> None:
        endpoints = endpoints_from_slices(slices.values())
        if endpoints == self._last:
            return
        self._last = endpoints
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self.on_change, dict(endpoints))
