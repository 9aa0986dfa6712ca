"""The router's own Status: the fleet's totals over the routable pods' latest reports, cached blocks from the
router's index, and every pod's view in the trailing metadata. The servicer runs in process; its context is a
stand-in that keeps the trailing metadata (Status reads nothing else from it)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from test_fleet import IDENTITY, KEYS_OF, PODS

from pagedserve.protos import inference_pb2 as pb
from pagedserve.services.common.kv_events import KvSnapshot
from pagedserve.services.router.choice import Chooser
from pagedserve.services.router.fleet import Fleet
from pagedserve.services.router.load import LoadReport
from pagedserve.services.router.request_blocks import RequestHasher
from pagedserve.services.router.servicer import PODS_HEADER, RouterServicer
from pagedserve.services.router.telemetry import RouterMetrics
from pagedserve.services.router.upstream import PodChannels


class TrailingMetadata:
    """A stand-in for grpc.aio.ServicerContext: Status only sets the trailing metadata."""

    def __init__(self) -> None:
        self.trailing: dict[str, str] = {}

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = dict(metadata)


def status(fleet: Fleet, now: float) -> tuple[pb.StatusResponse, dict[str, dict[str, Any]]]:
    servicer = RouterServicer(fleet, PodChannels([]), RequestHasher(None, None), RouterMetrics(fleet),
                              clock=lambda: now)
    context = TrailingMetadata()
    response = asyncio.run(servicer.Status(pb.StatusRequest(), context))  # type: ignore[arg-type]
    return response, {view["pod"]: view for view in json.loads(context.trailing[PODS_HEADER])}


def test_totals_are_the_routable_pods_reports_and_the_index() -> None:
    fleet = Fleet([*PODS, "10.0.0.4:50051"], Chooser())
    keys = frozenset(KEYS_OF.block_hashes)
    reports = {PODS[0]: LoadReport(2, 1, 30, 100, 1.0), PODS[1]: LoadReport(0, 0, 0, 80, 1.5),
               PODS[2]: LoadReport(5, 5, 70, 100, 1.0), "10.0.0.4:50051": LoadReport(1, 0, 9, 50, 1.0)}
    for pod, report in reports.items():
        assert fleet.identify(pod, "m", IDENTITY) == ""
        held = keys if pod != PODS[1] else frozenset(list(keys)[:1])
        assert fleet.apply(pod, KvSnapshot("e-" + pod, 0, held), report, report.reported_at)
    fleet.down(PODS[2], "UNAVAILABLE: Socket closed")  # not routable: its report and keys leave the totals
    fleet.drain("10.0.0.4:50051")  # terminating: no new request, out of the totals too
    response, views = status(fleet, now=2.0)
    assert (response.num_running, response.num_waiting) == (2, 1)
    assert (response.num_used_blocks, response.num_total_blocks) == (30, 180)
    assert response.num_free_blocks == 70 + 80  # total less used per pod: free counts cached blocks, as a pod's
    assert response.num_cached_blocks == len(keys) + 1 == views[PODS[0]]["cached_blocks"] + views[PODS[1]][
        "cached_blocks"]
    assert response.block_pressure == 30 / 180
    assert views[PODS[2]]["phase"] == "down" and views[PODS[2]]["cached_blocks"] == 0  # its view was dropped
    assert views["10.0.0.4:50051"]["cached_blocks"] == len(keys)  # draining keeps its view
    assert views[PODS[0]]["report_age_s"] == 1.0 and views[PODS[1]]["num_total_blocks"] == 80


def test_a_fleet_without_reports_has_zero_totals() -> None:
    fleet = Fleet(PODS[:1], Chooser())
    response, views = status(fleet, now=0.0)
    assert response.num_total_blocks == response.num_free_blocks == response.num_cached_blocks == 0
    assert response.block_pressure == 0.0
    assert views[PODS[0]]["phase"] == "connecting" and "num_total_blocks" not in views[PODS[0]]
