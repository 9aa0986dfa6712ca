"""Serving metrics: per-request latencies, goodput over a sliding window, and cumulative histograms and counters.

Per request: queue time (arrival to first scheduled), time to first token, time per output token after
the first, inter-token latencies, end to end. Goodput counts the finished requests per second that met
both objectives (TTFT and TPOT), as in DistServe: throughput that users actually felt.

The window says how this pod is doing now (the Status RPC, the operator's goodput), but percentiles of
different pods cannot be combined. The cumulative side can: latency histograms with fixed bucket bounds and
counters that only grow while the process lives, which Prometheus rates and sums over a fleet
(`histogram_quantile(0.99, sum by (le) (rate(pagedserve_time_to_first_token_seconds_bucket[5m])))`).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

from .request import FinishReason, Request, RequestMetrics

# Bucket upper bounds in seconds: vLLM's, so that the two engines' dashboards read alike. Inter-token gaps
# get three more below 10 ms: a small model's decode step on one GPU takes a few milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # end to end and queue time
ERROR = "error"  # a request ended by a failed step or by sidecars lost for too long (its samples say "abort")
END_REASONS = (FinishReason.STOP.value, FinishReason.LENGTH.value, FinishReason.ABORT.value, ERROR)


@dataclass(frozen=True)
class RequestLatency:
    queue_ms: float
    ttft_ms: float
    tpot_ms: float  # mean time per output token after the first (0 for a single token)
    e2e_ms: float
    itl_ms: tuple[float, ...]  # inter-token latencies of the first sample
    num_output_tokens: int


def latency(metrics: RequestMetrics, num_output_tokens: int) -> RequestLatency:
    now = time.monotonic()
    first_token = metrics.first_token or now
    finished = metrics.finished or now
    tokens = metrics.token_times
    itl = tuple((b - a) * 1000 for a, b in itertools.pairwise(tokens))
    tpot = (tokens[-1] - tokens[0]) * 1000 / (len(tokens) - 1) if len(tokens) > 1 else 0.0
    return RequestLatency(
        queue_ms=((metrics.first_scheduled or now) - metrics.arrival) * 1000,
        ttft_ms=(first_token - metrics.arrival) * 1000,
        tpot_ms=tpot,
        e2e_ms=(finished - metrics.arrival) * 1000,
        itl_ms=itl,
        num_output_tokens=num_output_tokens,
    )


def end_reason(request: Request) -> str:
    """One reason per request from its samples': abort if any was aborted, else length if any ran out, else stop."""
    reasons = {seq.finish_reason for seq in request.seqs}
    for reason in (FinishReason.ABORT, FinishReason.LENGTH):
        if reason in reasons:
            return reason.value
    return FinishReason.STOP.value


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]  # observations <= each bound, then all of them (Prometheus' `le` buckets, +Inf last)
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class Histogram:
    """Observations counted per bucket, and their sum. Not locked: ServingMetrics holds its lock around it."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must increase, got {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # counts[i]: values in (bounds[i-1], bounds[i]]; the last: above all
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # a value equal to a bound falls in its bucket
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(itertools.accumulate(self.counts)), self.sum)


@dataclass(frozen=True)
class Totals:
    """Everything cumulative, read under one lock: a scrape sees one consistent state."""

    queue_time: HistogramSnapshot  # arrival to first scheduled, of requests that were scheduled
    time_to_first_token: HistogramSnapshot  # of requests that got a token
    time_per_output_token: HistogramSnapshot  # per request, of the first sample, when it has two tokens or more
    inter_token_latency: HistogramSnapshot  # every gap between two tokens of a request's first sample
    e2e_latency: HistogramSnapshot  # arrival to end, of every request
    requests_ended: dict[str, int]  # by END_REASONS
    num_requests_finished: int  # ended by stop or length (the window's requests)
    num_prompt_tokens: int  # of the requests that ended
    num_generation_tokens: int  # of the requests that ended, every sample


class ServingMetrics:
    """Thread-safe: the engine thread records, the API and exporter threads read."""

    def __init__(self, ttft_slo_ms: float, tpot_slo_ms: float, window_s: float = 60.0) -> None:
        self.ttft_slo_ms, self.tpot_slo_ms, self.window_s = ttft_slo_ms, tpot_slo_ms, window_s
        self._finished: deque[tuple[float, RequestLatency]] = deque()
        self._tokens: deque[tuple[float, int]] = deque()
        self.num_requests_finished = 0
        self._queue_time, self._ttft, self._e2e = (Histogram(REQUEST_BUCKETS), Histogram(TTFT_BUCKETS),
                                                   Histogram(REQUEST_BUCKETS))
        self._tpot, self._itl = Histogram(INTER_TOKEN_BUCKETS), Histogram(INTER_TOKEN_BUCKETS)
        self._requests_ended = dict.fromkeys(END_REASONS, 0)
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._lock = threading.Lock()

    def record_tokens(self, count: int) -> None:
        with self._lock:
            self._tokens.append((time.monotonic(), count))

    def record_ended(self, request: Request, failed: bool = False) -> None:
        """A request left the engine, however it ended (`failed`: by an error, not its samples). Counted and
        measured in the cumulative histograms; a request that finished (stop or length) enters the window too."""
        reason = ERROR if failed else end_reason(request)
        times = request.metrics
        num_output_tokens = sum(len(seq.output_token_ids) for seq in request.seqs)
        request_latency = latency(times, num_output_tokens)
        finished = times.finished if times.finished is not None else time.monotonic()
        gaps = [b - a for a, b in itertools.pairwise(times.token_times)]
        with self._lock:
            if reason in (FinishReason.STOP.value, FinishReason.LENGTH.value):
                self._finished.append((time.monotonic(), request_latency))
                self.num_requests_finished += 1
            self._requests_ended[reason] += 1
            self._num_prompt_tokens += len(request.prompt_token_ids)
            self._num_generation_tokens += num_output_tokens
            self._e2e.observe(finished - times.arrival)
            if times.first_scheduled is not None:
                self._queue_time.observe(times.first_scheduled - times.arrival)
            if times.first_token is not None:
                self._ttft.observe(times.first_token - times.arrival)
            if gaps:
                self._tpot.observe((times.token_times[-1] - times.token_times[0]) / len(gaps))
            for gap in gaps:
                self._itl.observe(gap)

    def totals(self) -> Totals:
        with self._lock:
            return Totals(
                queue_time=self._queue_time.snapshot(), time_to_first_token=self._ttft.snapshot(),
                time_per_output_token=self._tpot.snapshot(), inter_token_latency=self._itl.snapshot(),
                e2e_latency=self._e2e.snapshot(), requests_ended=dict(self._requests_ended),
                num_requests_finished=self.num_requests_finished, num_prompt_tokens=self._num_prompt_tokens,
                num_generation_tokens=self._num_generation_tokens,
            )

    def snapshot(self) -> dict[str, float]:
        """The window (its keys are the Status RPC's fields)."""
        now = time.monotonic()
        with self._lock:
            for queue in (self._finished, self._tokens):
                while queue and queue[0][0] < now - self.window_s:
                    queue.popleft()
            finished = [r for _, r in self._finished]
            tokens = sum(count for _, count in self._tokens)
        good = sum(1 for r in finished if r.ttft_ms <= self.ttft_slo_ms and r.tpot_ms <= self.tpot_slo_ms)
        return {
            "num_requests_finished": self.num_requests_finished,
            "generation_tokens_per_s": tokens / self.window_s,
            "goodput_rps": good / self.window_s,
            "finished_rps": len(finished) / self.window_s,
            "ttft_slo_ms": self.ttft_slo_ms,
            "tpot_slo_ms": self.tpot_slo_ms,
            "ttft_ms_p50": _percentile([r.ttft_ms for r in finished], 50),
            "ttft_ms_p99": _percentile([r.ttft_ms for r in finished], 99),
            "tpot_ms_p50": _percentile([r.tpot_ms for r in finished], 50),
            "tpot_ms_p99": _percentile([r.tpot_ms for r in finished], 99),
            "window_s": self.window_s,
        }


def _percentile(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
