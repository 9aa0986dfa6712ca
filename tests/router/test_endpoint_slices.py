"""The router's view of a Kubernetes Service: EndpointSlices -> endpoint set (pure), and the fleet following it
(pods added, drained and removed at run time). The real watch against an API server is in tests/k8s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_fleet import IDENTITY, KEYS_OF, idle, synced
from test_options import parse

from pagedserve.services.common.errors import NotReady
from pagedserve.services.common.kv_events import KvSnapshot
from pagedserve.services.router import endpoint_slices
from pagedserve.services.router.choice import Chooser
from pagedserve.services.router.endpoint_slices import endpoints_from_slices
from pagedserve.services.router.fleet import Fleet
from pagedserve.services.router.options import RouterConfigError, load_settings

GRPC = {"name": "grpc", "port": 50051, "protocol": "TCP"}
METRICS = {"name": "metrics", "port": 9400, "protocol": "TCP"}


def endpoint(ip: str, **conditions: bool | None) -> dict[str, Any]:
    return {"addresses": [ip], "conditions": {k: v for k, v in conditions.items() if v is not None}}


def slice_(*endpoints: dict[str, Any], ports: list[dict[str, Any]] | None = None,
           address_type: str = "IPv4") -> dict[str, Any]:
    return {"addressType": address_type, "ports": [METRICS, GRPC] if ports is None else ports,
            "endpoints": list(endpoints)}


def test_ready_pods_take_requests_and_not_ready_or_terminating_ones_drain() -> None:
    slices = [slice_(endpoint("10.0.0.1", ready=True), endpoint("10.0.0.2", ready=False),
                     endpoint("10.0.0.3", ready=False, serving=True, terminating=True),
                     endpoint("10.0.0.4"))]  # no conditions (v1beta1 may say nothing): ready, the API's advice
    assert endpoints_from_slices(slices) == {"10.0.0.1:50051": True, "10.0.0.2:50051": False,
                                             "10.0.0.3:50051": False, "10.0.0.4:50051": True}


def test_the_grpc_port_by_name_else_the_only_port_else_nothing() -> None:
    assert endpoints_from_slices([slice_(endpoint("10.0.0.1"), ports=[{"name": "", "port": 7000}])]) == {
        "10.0.0.1:7000": True}
    assert endpoints_from_slices([slice_(endpoint("10.0.0.1"), ports=[METRICS, {"name": "http", "port": 8000}])]) == {}
    assert endpoints_from_slices([slice_(endpoint("10.0.0.1"), ports=[])]) == {}
    assert endpoints_from_slices([slice_(endpoint("10.0.0.1"))], port_name="metrics") == {"10.0.0.1:9400": True}


def test_several_slices_merge_and_an_address_ready_in_any_slice_is_ready() -> None:
    slices = [slice_(endpoint("10.0.0.1", ready=False), endpoint("10.0.0.2")),
              slice_(endpoint("10.0.0.1", ready=True)),
              slice_(endpoint("fd00::1", ready=True), address_type="IPv6"),
              slice_(endpoint("pod.example", ready=True), address_type="FQDN"),
              slice_({"addresses": [], "conditions": {"ready": True}}),
              {"addressType": "IPv4", "ports": None, "endpoints": None}]  # an empty slice, as the API gives it
    assert endpoints_from_slices(slices) == {"10.0.0.1:50051": True, "10.0.0.2:50051": True,
                                             "[fd00::1]:50051": True}


def test_the_fleet_adds_drains_and_removes_pods_at_run_time() -> None:
    changes: list[bool] = []
    fleet = Fleet([], Chooser("round-robin"), on_availability=changes.append, no_pods="no pod behind Service ns/m")
    with pytest.raises(NotReady, match=r"^no pod to route to: no pod behind Service ns/m$"):
        fleet.choose(KEYS_OF, 0.0)
    a, b = "10.0.0.1:50051", "10.0.0.2:50051"
    assert fleet.add_pod(a) and fleet.add_pod(b) and not fleet.add_pod(a)
    synced(fleet, a)
    synced(fleet, b)
    assert fleet.routable() == [a, b] and changes == [True]
    ticket = fleet.send(a, 10, 1.0)
    fleet.drain(a)  # not ready or terminating: no new request, the one in flight is kept
    assert fleet.routable() == [b] and fleet.in_flight(a).requests == 1
    assert {fleet.choose(KEYS_OF, 2.0).pod for _ in range(4)} == {b}
    fleet.drain(b)
    assert not fleet.available and changes == [True, False]
    with pytest.raises(NotReady, match=r"10\.0\.0\.2:50051 draining \(not ready or terminating\)"):
        fleet.choose(KEYS_OF, 2.0)
    assert not fleet.add_pod(b)  # ready again: routable at once, its view was kept
    assert fleet.routable() == [b] and changes == [True, False, True]
    fleet.remove_pod(a)
    fleet.finish(ticket)  # a stream that ends after its pod left is forgotten quietly
    fleet.down(a, "UNAVAILABLE")  # and so is its watcher's last word
    assert list(fleet.pods) == [b] and a not in fleet.index.pods
    fleet.remove_pod(b)
    assert not fleet.available and changes == [True, False, True, False]
    assert fleet.add_pod(b) and not fleet.routable()  # back at the same address: a new pod, in sync once more
    assert fleet.identify(b, "m", IDENTITY) == ""
    assert fleet.apply(b, KvSnapshot("e2", 0, frozenset()), idle(3.0), 3.0) and fleet.routable() == [b]


def test_the_kubernetes_flags_replace_endpoints_and_the_namespace_defaults_to_the_pods_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse("--kubernetes-service", "m-pods", "--namespace", "ns")
    assert (args.kubernetes_service, args.namespace, args.endpoints) == ("m-pods", "ns", [])
    load_settings(args)
    with pytest.raises(RouterConfigError, match="give one of them"):
        load_settings(parse("--kubernetes-service", "m-pods", "--endpoints", "a:1"))
    with pytest.raises(RouterConfigError, match="--namespace is --kubernetes-service's"):
        load_settings(parse("--namespace", "ns", "--endpoints", "a:1"))
    (tmp_path / "namespace").write_text("from-the-pod\n")
    monkeypatch.setattr(endpoint_slices, "NAMESPACE_FILE", str(tmp_path / "namespace"))
    monkeypatch.setenv("POD_NAMESPACE", "from-the-env")
    assert endpoint_slices.default_namespace() == "from-the-pod"
    monkeypatch.setattr(endpoint_slices, "NAMESPACE_FILE", str(tmp_path / "absent"))
    assert endpoint_slices.default_namespace() == "from-the-env"


class FakeApi:
    """An API server that serves only v1beta1 and whose every listing is the current `slices`."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.lists: list[str] = []

    def list_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                      **kwargs: Any) -> dict[str, Any]:
        assert (group, namespace, plural) == ("discovery.k8s.io", "ns", "endpointslices")
        assert kwargs["label_selector"] == "kubernetes.io/service-name=m-pods"
        if version == "v1":
            raise endpoint_slices.ApiException(status=404)
        self.lists.append(version)
        return {"metadata": {"resourceVersion": "7"}, "items": list(self.slices.values())}


def named(name: str, *endpoints: dict[str, Any]) -> dict[str, Any]:
    return {**slice_(*endpoints), "metadata": {"name": name, "resourceVersion": "8"}}


def test_the_watch_follows_changes_and_re_lists_after_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi()
    api.slices["a"] = named("a", endpoint("10.0.0.1", ready=True))
    both_ready = named("a", endpoint("10.0.0.1", ready=True), endpoint("10.0.0.2", ready=True))
    scripts: list[tuple[list[tuple[str, dict[str, Any]]], Exception | None]] = [  # per watch: events, its end
        ([("MODIFIED", named("a", endpoint("10.0.0.1", ready=True), endpoint("10.0.0.2", ready=False)))],
         ConnectionResetError("the API server went away")),  # meanwhile the pod turns ready: the re-list says so
        ([("ERROR", {"message": "too old resource version", "metadata": {}})], None),
        ([("DELETED", named("a"))], None),
    ]

    class FakeWatch:
        def stream(self, fn: Any, *args: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
            assert fn == api.list_namespaced_custom_object and args[1] == "v1beta1"
            assert kwargs["resource_version"] in ("7", "8")
            if not scripts:
                time.sleep(0.05)
                return
            events, failure = scripts.pop(0)
            for kind, item in events:
                yield {"type": kind, "object": item}
            if failure is not None:
                api.slices["a"] = both_ready
                raise failure

    monkeypatch.setattr(endpoint_slices.kubernetes.watch, "Watch", FakeWatch)
    monkeypatch.setattr(endpoint_slices, "RELIST_PAUSE_S", 0.01)
    seen: list[dict[str, bool]] = []

    async def follow() -> None:
        watcher = endpoint_slices.EndpointSliceWatcher("m-pods", "ns", seen.append, api=api)  # type: ignore[arg-type]
        watcher.start()
        try:
            for _ in range(300):
                await asyncio.sleep(0.01)
                if len(seen) >= 4:
                    break
        finally:
            watcher.stop()

    asyncio.run(follow())
    assert seen == [{"10.0.0.1:50051": True},
                    {"10.0.0.1:50051": True, "10.0.0.2:50051": False},
                    {"10.0.0.1:50051": True, "10.0.0.2:50051": True},  # from the re-list after the error
                    {}], seen  # the ERROR event re-listed too (no change: nothing said), then the slice went
    assert api.lists == ["v1beta1"] * 4 and not scripts  # the version probe, the first list, two re-lists
