"""What the router knows about each pod when it picks one: its cached prefix, its reported load, its own traffic.

Two sources of load, because each misses something: the pod's report (running and waiting sequences, blocks in
use) sees every router's traffic but is as old as its `reported_at`; the router's own in-flight count is exact
but sees only this replica's requests. The estimate is the report plus what this router sent after it was
taken (`InFlight.unreported_*`), so neither a second router replica nor the report's age hides load.

A pod whose report is older than the chooser's `max_report_age_s`, or missing, is *stale*: its load is
unknown, never zero (a pod never scraped is not idle). A pod whose event stream is stale or out of sync
matches no prefix (`cached_blocks` counts only while its view is confirmed).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common.kv_geometry import blocks_for

RECENT_HALF_LIFE_S = 60.0  # how long a request sent counts toward a pod's share of the traffic (recent_requests)


@dataclass(frozen=True)
class LoadReport:
    """A pod's own account of its load, at `reported_at` (the router's clock when it arrived)."""

    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued for admission (preempted ones included)
    num_used_blocks: int
    num_total_blocks: int
    reported_at: float


@dataclass(frozen=True)
class InFlight:
    """This router's requests at a pod that have not finished, and the part sent after the pod's last report."""

    requests: int = 0
    new_tokens: int = 0  # their prompt tokens that the pod computes: each prompt less its predicted cached tokens
    unreported_requests: int = 0
    unreported_new_tokens: int = 0
    recent_requests: float = 0.0  # all it sent there, finished or not, each fading with RECENT_HALF_LIFE_S


@dataclass(frozen=True)
class PodState:
    name: str
    cached_blocks: int  # leading prompt blocks the pod's index holds (pod_index.PodIndex.longest_prefixes)
    load: LoadReport | None
    events_heard_at: float | None  # pod_index.PodIndex.heard_at: None while its view is out of sync
    inflight: InFlight = InFlight()


def faded(count: float, since_s: float) -> float:
    """A count of requests `since_s` seconds later, each halving every RECENT_HALF_LIFE_S."""
    return count * 0.5 ** (max(since_s, 0.0) / RECENT_HALF_LIFE_S)


def is_fresh(pod: PodState, now: float, max_age_s: float) -> bool:
    """Whether the pod's load report is recent enough to be believed."""
    return pod.load is not None and now - pod.load.reported_at <= max_age_s


def trusted_cached_blocks(pod: PodState, now: float, max_age_s: float) -> int:
    """The pod's cached prefix, counted only while its event stream confirms it (else 0: never a guess)."""
    heard = pod.events_heard_at
    return pod.cached_blocks if heard is not None and now - heard <= max_age_s else 0


def load_requests(pod: PodState) -> int:
    """Sequences at the fresh pod: running plus waiting as reported, plus what this router sent since."""
    assert pod.load is not None, f"load_requests of {pod.name}, which has no report: rank it as stale"
    return pod.load.num_running + pod.load.num_waiting + pod.inflight.unreported_requests


def load_blocks(pod: PodState, prompt_blocks: int, block_size: int) -> float:
    """The fresh pod's queued work in blocks: blocks in use, each waiting sequence as much as a running one
    holds on average (the prompt's own size when nothing runs), and what the prompts sent since the report add
    (their cached prefixes are held already)."""
    report = pod.load
    assert report is not None, f"load_blocks of {pod.name}, which has no report: rank it as stale"
    per_sequence = report.num_used_blocks / report.num_running if report.num_running else float(prompt_blocks)
    unreported = blocks_for(pod.inflight.unreported_new_tokens, block_size)
    return report.num_used_blocks + report.num_waiting * per_sequence + unreported
