"""Reading the pods' load: scrape `/metrics` at each ready pod's IP, and fold one round into an Observation.

`parse_pod_metrics` and `observe` are pure (tested on text a real frontend served); `scrape` does the I/O,
all pods at once, each with its own short timeout so that one hung pod cannot stall the round. A pod that
cannot be read counts as missing: the policy then holds the size rather than decide on part of the fleet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .policy import Observation


@dataclass(frozen=True)
class PodMetrics:
    """One pod's answer to one scrape (the names are the frontend exporter's, docs/observability.md)."""

    used_blocks: int
    total_blocks: int
    goodput_rps: float
    finished_rps: float
    waiting_requests: int
    preemptions_total: float  # a counter: the rate comes from two scrapes

    @property
    def block_pressure(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


def parse_pod_metrics(text: str) -> PodMetrics | None:
    """None when the pod has not loaded its model yet (`pagedserve_ready 0`) or is not a pagedserve pod."""
    samples: dict[str, float] = {}
    preemptions = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pagedserve_preemptions_total":
                preemptions += sample.value
            elif sample.name == "pagedserve_kv_blocks":
                samples[f"kv_blocks_{sample.labels.get('state')}"] = sample.value
            else:
                samples[sample.name] = sample.value
    if samples.get("pagedserve_ready") != 1.0:
        return None
    try:
        return PodMetrics(
            used_blocks=int(samples["kv_blocks_used"]),
            total_blocks=int(samples["pagedserve_kv_blocks_capacity"]),
            goodput_rps=samples["pagedserve_goodput_requests_per_second"],
            finished_rps=samples["pagedserve_finished_requests_per_second"],
            waiting_requests=int(samples["pagedserve_waiting_seqs"]),
            preemptions_total=preemptions,
        )
    except KeyError:
        return None


def observe(now: float, pods: Mapping[str, PodMetrics | None], previous: Mapping[str, tuple[float, PodMetrics]],
            ) -> Observation:
    """One round over the ready pods (name -> metrics, None where unread). `previous` holds each pod's last
    answer with its time, for the preemption rate; a pod seen for the first time adds no rate."""
    read = {name: m for name, m in pods.items() if m is not None}
    preemptions_per_s = 0.0
    for name, metrics in read.items():
        if name in previous:
            then, before = previous[name]
            if now > then and metrics.preemptions_total >= before.preemptions_total:  # a restart resets it
                preemptions_per_s += (metrics.preemptions_total - before.preemptions_total) / (now - then)
    values = list(read.values())
    return Observation(
        time=now, num_pods=len(pods), num_scraped=len(read),
        used_blocks=sum(m.used_blocks for m in values), total_blocks=sum(m.total_blocks for m in values),
        max_pod_pressure=max((m.block_pressure for m in values), default=0.0),
        goodput_rps=sum(m.goodput_rps for m in values), finished_rps=sum(m.finished_rps for m in values),
        waiting_requests=sum(m.waiting_requests for m in values), preemptions_per_s=preemptions_per_s,
    )


async def scrape(pod_urls: Mapping[str, str], timeout_s: float = 3.0) -> dict[str, PodMetrics | None]:
    """GET every pod's /metrics URL at once; name -> metrics, None for a pod that did not answer in time."""
    async def one(session: aiohttp.ClientSession, url: str) -> PodMetrics | None:
        try:
            async with session.get(url) as response:
                if response.status != 200:
                    return None
                return parse_pod_metrics(await response.text())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None

    names: Sequence[str] = list(pod_urls)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        results = await asyncio.gather(*(one(session, pod_urls[name]) for name in names))
    return dict(zip(names, results, strict=True))
