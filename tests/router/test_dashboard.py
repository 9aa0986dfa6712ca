"""The chart's Grafana dashboard, its routing row: every `pagedserve_router_*` name in any of its PromQL expressions
is one the router's registry exports (the exposition `/metrics` serves), and the row draws what the router
measures. The pods' names are checked against a live pod (tests/integration/test_serve_stack.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from test_fleet import KEYS_OF, PODS, synced

from pagedserve.protos import inference_pb2 as pb
from pagedserve.services.router.choice import Chooser
from pagedserve.services.router.fleet import Fleet
from pagedserve.services.router.telemetry import RouterMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "charts/pagedserve/files/dashboards/pagedserve.json"
ROUTER_NAME = re.compile(r"\bpagedserve_router_[a-z0-9_]+")


def exported_names() -> set[str]:
    """The sample names on the router's /metrics once a request ended (labelled series appear at their first
    sample): the registry the router serves, rendered as its exporter renders it."""
    fleet = Fleet(PODS[:1], Chooser())
    synced(fleet, PODS[0], frozenset(KEYS_OF.block_hashes))
    metrics = RouterMetrics(fleet)
    metrics.decision_seconds.observe(1e-4)
    metrics.ended(PODS[0], "OK", 8, pb.Usage(prompt_tokens=17, cached_prompt_tokens=8, completion_tokens=1))
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def routing_row(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The panels after the "Routing" row, up to the next row (an expanded row's panels follow it)."""
    (start,) = [i for i, p in enumerate(panels) if p["type"] == "row" and p["title"].startswith("Routing")]
    row = []
    for panel in panels[start + 1:]:
        if panel["type"] == "row":
            break
        row.append(panel)
    return row


def test_every_router_metric_on_the_dashboard_is_exported() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    expressions = [t["expr"] for panel in panels for t in panel.get("targets", [])]
    used = {name for expr in expressions for name in ROUTER_NAME.findall(expr)}
    exported = exported_names()
    assert len(used) >= 8
    assert used <= exported, f"not exported by the router: {sorted(used - exported)}"


def test_the_routing_row_draws_the_routers_measures_and_only_them() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    row = routing_row(panels)
    row_expressions = [t["expr"] for panel in row for t in panel["targets"]]
    used = {name for expr in row_expressions for name in ROUTER_NAME.findall(expr)}
    assert {"pagedserve_router_decision_seconds_bucket", "pagedserve_router_requests_total",
            "pagedserve_router_predicted_cached_tokens_total", "pagedserve_router_reported_cached_tokens_total",
            "pagedserve_router_prompt_tokens_total", "pagedserve_router_retries_total",
            "pagedserve_router_unroutable_total"} <= used
    assert all(ROUTER_NAME.search(expr) for expr in row_expressions)  # a router panel, a router metric
    outside = [t["expr"] for panel in panels if panel not in row for t in panel.get("targets", [])]
    assert not [expr for expr in outside if ROUTER_NAME.search(expr)]  # the pods' test checks those
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
