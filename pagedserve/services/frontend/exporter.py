"""Prometheus exposition of a pod's load: `GET /metrics` on `--metrics-listen` (the operator's and HPA's input),
beside the kubelet's probes: `/readyz` (200 once the engine runs over both sidecars, 503 while one is lost) and
`/healthz` (200 unless the engine thread died: a lost sidecar is waited for, not a reason to restart).

Nothing is counted twice: each scrape reads the engine loop's latest status (queues, block stats from the
block manager, preemptions, refusals), the serving metrics' sliding window (goodput, latency percentiles: the
`Status` RPC's numbers) and their cumulative totals (latency histograms, requests by finish reason, tokens),
each read at once. Before the model is loaded only `pagedserve_ready 0` is served. docs/observability.md
lists every metric.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..block_manager.contract import BlockStats
from .engine_loop import EngineLoop
from .metrics import HistogramSnapshot, Totals


class ServingCollector(Collector):
    def __init__(self, engine_loop: Callable[[], EngineLoop | None]) -> None:
        self.engine_loop = engine_loop  # None until the model is loaded

    def collect(self) -> Iterator[Metric]:
        loop = self.engine_loop()
        yield GaugeMetricFamily("pagedserve_ready", "1 once the model is loaded and the engine runs", loop is not None)
        if loop is None:
            return
        status, window, totals = loop.status, loop.metrics.snapshot(), loop.metrics.totals()
        yield _gauge("sidecars_available", "1 while both sidecars answer; 0 while one is lost and requests wait",
                     status["available"])
        yield CounterMetricFamily("pagedserve_sidecar_recoveries", "times the engine resumed after losing a sidecar",
                                  value=status["num_recoveries"])
        yield _gauge("running_seqs", "sequences in the running batch", status["num_running"])
        yield _gauge("waiting_seqs", "sequences waiting for admission (new or preempted)", status["num_waiting"])
        yield _gauge("swapped_seqs", "sequences swapped out to the CPU pool", status["num_swapped"])
        yield from _kv_cache(status["stats"], status["kv_cache_dtype"])
        preemptions = CounterMetricFamily("pagedserve_preemptions", "sequences preempted", labels=["mode"])
        for mode in ("recompute", "swap"):
            preemptions.add_metric([mode], status[f"num_preemptions_{mode}"])
        yield preemptions
        yield CounterMetricFamily("pagedserve_admissions_held_by_reserve", "steps in which the growth reserve, not the"
                                  " free blocks, kept the head of the queue waiting (--reserve-growth)",
                                  value=status["num_reserve_holds"])
        yield CounterMetricFamily("pagedserve_requests_finished", "requests finished (stop or length)",
                                  value=totals.num_requests_finished)
        yield from _request_totals(totals)
        yield CounterMetricFamily("pagedserve_requests_refused", "requests refused because the waiting queue was full",
                                  value=status["num_refused"])
        yield from _window(window)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"pagedserve_{name}", doc, value=value)


def _kv_cache(stats: BlockStats, kv_cache_dtype: str) -> Iterator[Metric]:
    """The block manager's statistics: blocks by state, pressure, utilization, the prefix cache's counters."""
    blocks = GaugeMetricFamily("pagedserve_kv_blocks", "device KV blocks by state", labels=["state"])
    blocks.add_metric(["used"], stats.num_used_blocks)
    blocks.add_metric(["cached"], stats.num_cached_blocks)
    blocks.add_metric(["free"], stats.num_free_blocks - stats.num_cached_blocks)  # free counts cached ones
    yield blocks
    yield _gauge("kv_blocks_capacity", "device KV blocks in the cache", stats.num_total_blocks)
    cache = GaugeMetricFamily("pagedserve_kv_cache_info", "the KV cache's element dtype and tokens per block (1)",
                              labels=["dtype", "block_size"])
    cache.add_metric([kv_cache_dtype, str(stats.block_size)], 1)
    yield cache
    yield _gauge("kv_block_pressure", "used blocks / capacity: the scaling signal", stats.block_pressure)
    yield _gauge("kv_utilization", "filled token slots / slots of used blocks (told to the block manager: up to a"
                 " block per sequence late)", stats.kv_utilization)
    yield _gauge("prefix_cache_hit_rate", "prompt tokens served from the prefix cache / looked up",
                 stats.prefix_hit_rate)
    # the block manager's own counters: they start again from 0 if its process does (a counter reset)
    yield CounterMetricFamily("pagedserve_prefix_cache_queries", "tokens looked up in the prefix cache"
                              " at admission", value=stats.prefix_cache_queries)
    yield CounterMetricFamily("pagedserve_prefix_cache_hits", "tokens served from the prefix cache at admission",
                              value=stats.prefix_cache_hits)


def _window(window: dict[str, float]) -> Iterator[Metric]:
    """The serving metrics' sliding window: throughput, goodput, TTFT and TPOT percentiles and objectives."""
    seconds = window["window_s"]
    yield _gauge("finished_requests_per_second", f"requests finished, over {seconds:g} s", window["finished_rps"])
    yield _gauge("goodput_requests_per_second", f"finished requests meeting both SLOs, over {seconds:g} s",
                 window["goodput_rps"])
    yield _gauge("generation_tokens_per_second", f"tokens generated, over {seconds:g} s",
                 window["generation_tokens_per_s"])
    for name, key in (("time_to_first_token", "ttft"), ("time_per_output_token", "tpot")):
        # `_window_`: the histograms hold the plain names
        quantiles = GaugeMetricFamily(f"pagedserve_{name}_window_seconds", f"{name.replace('_', ' ')} of"
                                      f" requests finished in the last {seconds:g} s", labels=["quantile"])
        quantiles.add_metric(["0.5"], window[f"{key}_ms_p50"] / 1000)
        quantiles.add_metric(["0.99"], window[f"{key}_ms_p99"] / 1000)
        yield quantiles
        yield _gauge(f"{name}_slo_seconds", f"the {key.upper()} objective goodput counts against",
                     window[f"{key}_slo_ms"] / 1000)


def _request_totals(totals: Totals) -> Iterator[Metric]:
    ended = CounterMetricFamily("pagedserve_requests_ended", "requests that left the engine, by how they ended"
                                " (abort: cancelled or past the deadline; error: a failed step or lost sidecars)",
                                labels=["finish_reason"])
    for reason, count in totals.requests_ended.items():
        ended.add_metric([reason], count)
    yield ended
    yield CounterMetricFamily("pagedserve_prompt_tokens", "prompt tokens of the requests that ended",
                              value=totals.num_prompt_tokens)
    yield CounterMetricFamily("pagedserve_generation_tokens", "tokens generated for the requests that ended"
                              " (all samples)", value=totals.num_generation_tokens)
    for name, doc, histogram in (
        ("request_queue_time", "arrival to first scheduled", totals.queue_time),
        ("time_to_first_token", "arrival to the first token", totals.time_to_first_token),
        ("time_per_output_token", "mean time per token after the first, per request (first sample)",
         totals.time_per_output_token),
        ("inter_token_latency", "each gap between two tokens (first sample)", totals.inter_token_latency),
        ("e2e_request_latency", "arrival to end, every request that ended", totals.e2e_latency),
    ):
        yield _histogram(f"pagedserve_{name}_seconds", doc, histogram)


def _histogram(name: str, doc: str, histogram: HistogramSnapshot) -> HistogramMetricFamily:
    bounds = [*map(floatToGoString, histogram.bounds), "+Inf"]
    buckets = list(zip(bounds, histogram.cumulative, strict=True))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=histogram.sum)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not worth a log line
        pass


def start_exporter(listen: str, engine_loop: Callable[[], EngineLoop | None]) -> tuple[WSGIServer, threading.Thread]:
    """Serves /metrics, /readyz and /healthz on HOST:PORT from a daemon thread; `server.shutdown()` stops it."""
    host, _, port = listen.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServingCollector(engine_loop))
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in ("/readyz", "/healthz"):
            return metrics_app(environ, start_response)
        loop = engine_loop()
        if path == "/healthz":
            ok, why = loop is None or loop.alive, b"engine thread stopped\n"
        else:
            ok = loop is not None and loop.alive and loop.status["available"]
            why = b"not ready\n" if loop is None else b"a sidecar is lost\n"
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return [b"ok\n" if ok else why]

    server = make_server(host.strip("[]") or "127.0.0.1", int(port), app, ThreadingWSGIServer, _QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread
