"""The router's Prometheus metrics on `--metrics-port` (`/metrics`), docs/routing.md lists them.

Counted per request as it ends: the pod and the status it ended with, the prefix the router predicted there and
the prefix the pod reports in its `Usage` (both, so that a drift between them, the sign of a router hashing
differently from its pods, shows as two diverging rates rather than hiding in one ratio), and its prompt tokens:
the fleet's prefix hit rate is reported cached tokens over prompt tokens. Read at each scrape: each pod's phase,
requests in flight from this router, and cached blocks as its events describe them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...protos import inference_pb2 as pb
from .fleet import Fleet, PodPhase

DECISION_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3)


class RouterMetrics:
    def __init__(self, fleet: Fleet) -> None:
        self._lock = threading.Lock()  # the hit rate's two totals, read by the exporter's thread
        self._cached_total = self._prompt_total = 0
        self.registry = CollectorRegistry(auto_describe=True)
        self.decision_seconds = Histogram(
            "pagedserve_router_decision_seconds", "time to pick a pod for a request (tokenizing and hashing included)",
            buckets=DECISION_BUCKETS_S, registry=self.registry)
        self.requests = Counter("pagedserve_router_requests",
                                "requests forwarded, by pod and the status they ended with", ["pod", "code"],
                                registry=self.registry)
        self.retries = Counter("pagedserve_router_retries",
                               "requests sent to a second pod after the first failed UNAVAILABLE before any output",
                               registry=self.registry)
        self.unroutable = Counter("pagedserve_router_unroutable", "requests answered UNAVAILABLE: no pod to route to",
                                  registry=self.registry)
        self.predicted_cached = Counter("pagedserve_router_predicted_cached_tokens",
                                        "prompt tokens the router predicted the pod serves from its prefix cache",
                                        ["pod"], registry=self.registry)
        self.reported_cached = Counter("pagedserve_router_reported_cached_tokens",
                                       "prompt tokens the pod reported served from its prefix cache (Usage)",
                                       ["pod"], registry=self.registry)
        self.prompt_tokens = Counter("pagedserve_router_prompt_tokens", "prompt tokens the pods reported (Usage)",
                                     ["pod"], registry=self.registry)
        self.registry.register(FleetCollector(fleet))
        self.registry.register(GaugeFunction("pagedserve_router_prefix_hit_rate",
                                             "prompt tokens served from the pods' prefix caches over all prompt tokens",
                                             lambda: self.prefix_hit_rate))

    def ended(self, pod: str, code: str, predicted_cached_tokens: int, usage: pb.Usage | None) -> None:
        """One forwarded request's end: `usage` is the pod's, when the request got that far."""
        self.requests.labels(pod, code).inc()
        if usage is None:
            return
        self.predicted_cached.labels(pod).inc(predicted_cached_tokens)
        self.reported_cached.labels(pod).inc(usage.cached_prompt_tokens)
        self.prompt_tokens.labels(pod).inc(usage.prompt_tokens)
        with self._lock:
            self._cached_total += usage.cached_prompt_tokens
            self._prompt_total += usage.prompt_tokens

    @property
    def prefix_hit_rate(self) -> float:
        with self._lock:
            return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def serve(self, host: str, port: int) -> threading.Thread:
        """Serves /metrics on host:port from a daemon thread (it ends with the process)."""
        _, thread = start_http_server(port, host, registry=self.registry)
        return thread


class GaugeFunction(Collector):
    def __init__(self, name: str, documentation: str, value: Callable[[], float]) -> None:
        self.name, self.documentation, self.value = name, documentation, value

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, value=self.value())


class FleetCollector(Collector):
    """The fleet as the router sees it, read at each scrape (from the exporter's thread: counts, no iteration
    over what the event loop changes)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        records = list(self.fleet.pods.values())
        phases = GaugeMetricFamily("pagedserve_router_pods", "pods by phase", labels=["phase"])
        for phase in PodPhase:
            phases.add_metric([phase.value], sum(record.phase == phase for record in records))
        yield phases
        routable = GaugeMetricFamily("pagedserve_router_pod_routable", "1 while the pod takes requests", labels=["pod"])
        in_flight = GaugeMetricFamily("pagedserve_router_in_flight_requests",
                                      "this router's requests at the pod that have not ended", labels=["pod"])
        cached = GaugeMetricFamily("pagedserve_router_pod_cached_blocks",
                                   "blocks in the pod's prefix cache, as its KV events describe it", labels=["pod"])
        for record in records:
            routable.add_metric([record.address], record.routable)
            in_flight.add_metric([record.address], len(record.in_flight))
            cached.add_metric([record.address], self.fleet.index.num_cached_blocks(record.address))
        yield from (routable, in_flight, cached)
