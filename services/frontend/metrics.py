"""Serving metrics: per-request latencies and goodput over a sliding window.

Per request: queue time (arrival to first scheduled), time to first token, time per output token after
the first, inter-token latencies, end to end. Goodput counts the finished requests per second that met
both objectives (TTFT and TPOT), as in DistServe: throughput that users actually felt.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

from .request import RequestMetrics


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


class ServingMetrics:
    """Thread-safe: the engine thread records, the API thread reads."""

    def __init__(self, ttft_slo_ms: float, tpot_slo_ms: float, window_s: float = 60.0) -> None:
        self.ttft_slo_ms, self.tpot_slo_ms, self.window_s = ttft_slo_ms, tpot_slo_ms, window_s
        self._finished: deque[tuple[float, RequestLatency]] = deque()
        self._tokens: deque[tuple[float, int]] = deque()
        self.num_requests_finished = 0
        self._lock = threading.Lock()

    def record_tokens(self, count: int) -> None:
        with self._lock:
            self._tokens.append((time.monotonic(), count))

    def record_finished(self, request_latency: RequestLatency) -> None:
        with self._lock:
            self._finished.append((time.monotonic(), request_latency))
            self.num_requests_finished += 1

    def snapshot(self) -> dict[str, float]:
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
