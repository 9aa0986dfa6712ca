"""The cumulative serving metrics (latency histograms, requests by finish reason, token counters) against
brute-force references, and their Prometheus exposition as both Prometheus' parsers read it."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.operator.scrape import parse_pod_metrics
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.frontend.exporter import ServingCollector
from pagedserve.services.frontend.metrics import (
    INTER_TOKEN_BUCKETS,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    HistogramSnapshot,
    ServingMetrics,
    end_reason,
)
from pagedserve.services.frontend.request import (
    FinishReason,
    GenerationParams,
    Request,
    RequestMetrics,
    SeqStatus,
    Sequence,
)


def reference(bounds: tuple[float, ...], values: list[float]) -> tuple[int, ...]:
    """Prometheus' `le` buckets, counted the slow way."""
    return (*(sum(1 for v in values if v <= bound) for bound in bounds), len(values))


def check(snapshot: HistogramSnapshot, bounds: tuple[float, ...], values: list[float]) -> None:
    assert snapshot.bounds == bounds
    assert snapshot.cumulative == reference(bounds, values)
    assert snapshot.count == len(values) and snapshot.sum == sum(values)  # the same additions in the same order


@pytest.mark.parametrize("bounds", [TTFT_BUCKETS, INTER_TOKEN_BUCKETS, REQUEST_BUCKETS, (1.0,)])
def test_a_histogram_counts_each_value_in_every_bucket_at_or_above_it(bounds: tuple[float, ...]) -> None:
    rng = random.Random(13)
    values = [rng.lognormvariate(-2, 3) for _ in range(2000)]
    values += [*bounds, 0.0, bounds[-1] * 2, bounds[0] / 2, float(bounds[-1]) + 1e-9]  # on, below and above bounds
    rng.shuffle(values)
    histogram = Histogram(bounds)
    for value in values:
        histogram.observe(value)
    check(histogram.snapshot(), bounds, values)
    assert Histogram(bounds).snapshot().cumulative == (0,) * (len(bounds) + 1)


def test_bucket_bounds_must_increase() -> None:
    for bounds in [(1.0, 0.5), (1.0, 1.0)]:
        with pytest.raises(ValueError, match="must increase"):
            Histogram(bounds)


def make_request(prompt_len: int, samples: list[tuple[int, FinishReason]], times: RequestMetrics) -> Request:
    """A request whose samples generated the given token counts and ended for the given reasons."""
    params = GenerationParams(max_tokens=8, n=len(samples))
    request = Request(f"r{id(times)}", list(range(prompt_len)), params, b"ns", seed=0, metrics=times)
    for index, (num_tokens, reason) in enumerate(samples):
        seq = Sequence(index, request, index, list(range(prompt_len + num_tokens)), SeqStatus.FINISHED)
        seq.finish_reason = reason
        request.seqs.append(seq)
    request.num_unforked = 0
    return request


STOP, LENGTH, ABORT = FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT


def test_a_request_has_one_reason_whatever_its_samples_say() -> None:
    def reason(*reasons: FinishReason) -> str:
        return end_reason(make_request(3, [(1, r) for r in reasons], RequestMetrics(arrival=0.0)))

    assert reason(STOP) == "stop" and reason(LENGTH) == "length" and reason(ABORT) == "abort"
    assert reason(STOP, LENGTH) == reason(LENGTH, STOP) == "length"
    assert reason(STOP, ABORT) == reason(LENGTH, ABORT, STOP) == "abort"


def test_ended_requests_feed_the_histograms_and_counters_and_finished_ones_the_window() -> None:
    # times are dyadic fractions from 0: every difference below is exact
    requests = [  # (request, failed)
        # stop: queue 0.25 (a request bound), ttft 0.5, gaps 0.0625, 0.0625, 0.375 (tpot 0.5 / 3), e2e 1.0
        (make_request(5, [(4, STOP)], RequestMetrics(0.0, 0.25, 0.5, [0.5, 0.5625, 0.625, 1.0], 1.0)), False),
        # length, n=2: both samples' tokens count; gaps only of the first sample's token times
        (make_request(7, [(3, LENGTH), (3, STOP)], RequestMetrics(0.0, 0.125, 0.25, [0.25, 0.75, 2.5], 2.5)), False),
        # one token: no gap, no TPOT
        (make_request(2, [(1, STOP)], RequestMetrics(0.0, 0.0, 0.0078125, [0.0078125], 0.0078125)), False),
        # cancelled while waiting: neither scheduled nor a token, but it ended
        (make_request(9, [(0, ABORT)], RequestMetrics(0.0, None, None, [], 3.0)), False),
        # cancelled after two tokens
        (make_request(4, [(2, ABORT)], RequestMetrics(0.0, 1.0, 1.5, [1.5, 1.53125], 1.53125)), False),
        # a failed step ended it (its samples say abort)
        (make_request(6, [(1, ABORT)], RequestMetrics(0.0, 0.5, 10.0, [10.0], 10000.0)), True),
    ]
    metrics = ServingMetrics(ttft_slo_ms=1000, tpot_slo_ms=100)
    for request, failed in requests:
        metrics.record_ended(request, failed)
    totals = metrics.totals()

    times = [r.metrics for r, _ in requests]
    check(totals.e2e_latency, REQUEST_BUCKETS, [t.finished - t.arrival for t in times])  # type: ignore[operator]
    check(totals.queue_time, REQUEST_BUCKETS, [t.first_scheduled - t.arrival for t in times
                                               if t.first_scheduled is not None])
    check(totals.time_to_first_token, TTFT_BUCKETS, [t.first_token - t.arrival for t in times
                                                     if t.first_token is not None])
    gaps = [[b - a for a, b in itertools.pairwise(t.token_times)] for t in times]
    check(totals.inter_token_latency, INTER_TOKEN_BUCKETS, [gap for g in gaps for gap in g])
    check(totals.time_per_output_token, INTER_TOKEN_BUCKETS, [sum(g) / len(g) for g in gaps if g])
    assert totals.time_per_output_token.sum == 0.5 / 3 + 2.25 / 2 + 0.03125
    assert totals.requests_ended == {"stop": 2, "length": 1, "abort": 2, "error": 1}
    assert totals.num_requests_finished == metrics.num_requests_finished == 3
    assert totals.num_prompt_tokens == 5 + 7 + 2 + 9 + 4 + 6
    assert totals.num_generation_tokens == 4 + 6 + 1 + 0 + 2 + 1
    window = metrics.snapshot()
    assert window["finished_rps"] * window["window_s"] == 3  # aborted and failed requests stay out of the window
    assert window["ttft_ms_p50"] == 250.0  # of 500, 250 and 7.8125 ms


class _FakeLoop(SimpleNamespace):
    """What the collector reads from an EngineLoop: its status and its ServingMetrics."""


def scrape_text(metrics: ServingMetrics, openmetrics: bool = False) -> str:
    manager = BlockManager(16, 4)
    manager.create(0, list(range(10)), b"ns")
    status = {"available": True, "num_recoveries": 0, "num_running": 1, "num_waiting": 0, "num_swapped": 0,
              "stats": manager.stats(), "num_preemptions_recompute": 2, "num_preemptions_swap": 0, "num_refused": 0,
              "num_reserve_holds": 3, "kv_cache_dtype": "bfloat16"}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServingCollector(lambda: _FakeLoop(status=status, metrics=metrics)))  # type: ignore[arg-type]
    return (generate_openmetrics if openmetrics else generate_latest)(registry).decode()


def test_the_exposition_parses_and_carries_the_histograms_and_counters() -> None:
    metrics = ServingMetrics(ttft_slo_ms=1000, tpot_slo_ms=100)
    metrics.record_ended(make_request(5, [(3, LENGTH)], RequestMetrics(0.0, 0.25, 0.5, [0.5, 0.75, 1.0], 1.0)))
    metrics.record_ended(make_request(3, [(0, ABORT)], RequestMetrics(0.0, None, None, [], 2.0)))
    text = scrape_text(metrics)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}

    assert families["pagedserve_time_to_first_token_seconds"].type == "histogram"
    ttft = {s.labels["le"]: s.value for s in families["pagedserve_time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")}
    assert list(ttft) == [*(str(b) for b in TTFT_BUCKETS), "+Inf"]
    assert ttft["0.1"] == 0 and ttft["0.5"] == ttft["+Inf"] == 1  # 0.5 s is in the le="0.5" bucket
    assert samples[("pagedserve_time_to_first_token_seconds_sum", ())] == 0.5
    for name, count in [("request_queue_time", 1), ("time_to_first_token", 1), ("time_per_output_token", 1),
                        ("inter_token_latency", 2), ("e2e_request_latency", 2)]:
        assert families[f"pagedserve_{name}_seconds"].type == "histogram"
        assert samples[(f"pagedserve_{name}_seconds_count", ())] == count
        assert samples[(f"pagedserve_{name}_seconds_bucket", (("le", "+Inf"),))] == count
    assert samples[("pagedserve_e2e_request_latency_seconds_sum", ())] == 3.0
    ended = {reason: samples[("pagedserve_requests_ended_total", (("finish_reason", reason),))]
             for reason in ("stop", "length", "abort", "error")}
    assert ended == {"stop": 0, "length": 1, "abort": 1, "error": 0}  # every reason present from the start
    assert samples[("pagedserve_requests_finished_total", ())] == 1
    assert samples[("pagedserve_admissions_held_by_reserve_total", ())] == 3
    assert samples[("pagedserve_prompt_tokens_total", ())] == 8
    assert samples[("pagedserve_generation_tokens_total", ())] == 3
    assert samples[("pagedserve_prefix_cache_queries_total", ())] == 10
    assert samples[("pagedserve_prefix_cache_hits_total", ())] == 0
    # the window's quantile gauges, renamed beside the histograms; what the operator reads is unchanged
    assert families["pagedserve_time_to_first_token_window_seconds"].type == "gauge"
    assert samples[("pagedserve_time_to_first_token_window_seconds", (("quantile", "0.99"),))] == 0.5
    assert samples[("pagedserve_time_per_output_token_window_seconds", (("quantile", "0.5"),))] == 0.25
    assert samples[("pagedserve_kv_cache_info", (("block_size", "4"), ("dtype", "bfloat16")))] == 1
    assert parse_pod_metrics(text) is not None

    # Prometheus asks for OpenMetrics first: the same families must be valid there too
    open_families = {f.name: f for f in parse_openmetrics(scrape_text(metrics, openmetrics=True))}
    assert open_families["pagedserve_time_to_first_token_seconds"].type == "histogram"
    assert open_families["pagedserve_requests_ended"].type == "counter"
    assert set(open_families) == {name.removesuffix("_total") for name in families} | {"pagedserve_ready"}
