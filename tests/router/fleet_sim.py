"""A small discrete-time fleet for the choice tests: pods with a batch limit, a queue and an LRU cache of tenants'
prefixes, fed a Poisson trace through a Chooser, with load reports that lag and the router's in-flight count."""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pagedserve.services.router.choice import Chooser
from pagedserve.services.router.load import InFlight, LoadReport, PodState
from pagedserve.services.router.prompt_blocks import PromptBlocks

BLOCK_SIZE = 16
OWN_BLOCKS = 2  # each request's question (its last, partly filled block included)
DECODE_TICKS = 20
PREFILL_TICKS_PER_BLOCK = 0.5
REPORT_EVERY_TICKS = 2


@dataclass
class Request:
    tenant: int
    sent_at: int
    new_tokens: int  # its prompt less the cached tokens the router predicted


@dataclass
class SimPod:
    name: str
    prefix_blocks: int  # a tenant's shared system prompt
    max_running: int = 8
    cache_tenants: int = 3  # prefixes its KV holds besides the running batch
    running: list[tuple[float, int]] = field(default_factory=list)  # (end tick, tenant)
    waiting: deque[Request] = field(default_factory=deque)
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    report: LoadReport | None = None
    served: int = 0
    hits: int = 0

    def step(self, now: int) -> list[Request]:
        """Finishes what ended, admits what fits; returns the requests admitted (no longer unreported)."""
        self.running = [(end, tenant) for end, tenant in self.running if end > now]
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting.popleft()
            hit = request.tenant in self.cache
            self.hits += hit
            prefill = OWN_BLOCKS + (0 if hit else self.prefix_blocks)
            self.running.append((now + DECODE_TICKS + prefill * PREFILL_TICKS_PER_BLOCK, request.tenant))
            self.cache[request.tenant] = None
            self.cache.move_to_end(request.tenant)
            while len(self.cache) > self.cache_tenants:
                self.cache.popitem(last=False)
            admitted.append(request)
        return admitted

    def used_blocks(self) -> int:
        return len(self.running) * OWN_BLOCKS + len({tenant for _, tenant in self.running}) * self.prefix_blocks


def prompt_of(tenant: int, prefix_blocks: int) -> PromptBlocks:
    """Keys stand in for hashes: the first byte names the tenant."""
    keys = tuple(bytes([tenant % 256, i % 256, i // 256]) * 5 for i in range(prefix_blocks + OWN_BLOCKS - 1))
    return PromptBlocks(keys, (prefix_blocks + OWN_BLOCKS - 1) * BLOCK_SIZE + 5, BLOCK_SIZE)


def run_fleet(chooser: Chooser, num_pods: int, tenant_weights: list[float], rate: float, ticks: int,
              seed: int = 0, prefix_blocks: int = 16) -> list[SimPod]:
    """Routes a Poisson trace (`rate` requests per tick, tenants drawn by weight) over num_pods pods."""
    rng = random.Random(seed)
    pods = [SimPod(f"pod-{i}", prefix_blocks) for i in range(num_pods)]
    sent: dict[str, list[Request]] = {pod.name: [] for pod in pods}  # this router's requests not finished
    for now in range(ticks):
        for pod in pods:
            pod.step(now)
            sent[pod.name] = [r for r in sent[pod.name] if r in pod.waiting or r.sent_at >= now - DECODE_TICKS]
            if now % REPORT_EVERY_TICKS == 0:
                pod.report = LoadReport(len(pod.running), len(pod.waiting), pod.used_blocks(), 1024, float(now))
        for _ in range(poisson(rng, rate)):
            tenant = rng.choices(range(len(tenant_weights)), tenant_weights)[0]
            prompt = prompt_of(tenant, prefix_blocks)
            states = [state_of(pod, sent[pod.name], prompt) for pod in pods]
            choice = chooser.choose(prompt, states, float(now))
            pod = next(pod for pod in pods if pod.name == choice.pod)
            request = Request(tenant, now, prompt.num_tokens - choice.predicted_cached_tokens)
            pod.waiting.append(request)
            pod.served += 1
            sent[pod.name].append(request)
    return pods


def state_of(pod: SimPod, sent: list[Request], prompt: PromptBlocks) -> PodState:
    reported_at = pod.report.reported_at if pod.report else -1.0
    unreported = [r for r in sent if r.sent_at >= reported_at]
    tenant = prompt.block_hashes[0][0]
    cached = pod.prefix_blocks if tenant in pod.cache else 0  # the tenant's prefix, nothing of the request's own
    inflight = InFlight(len(sent), sum(r.new_tokens for r in sent), len(unreported),
                        sum(r.new_tokens for r in unreported))
    return PodState(pod.name, cached, pod.report, reported_at if pod.report else None, inflight)


def poisson(rng: random.Random, rate: float) -> int:
    count, threshold, product = 0, pow(2.718281828459045, -rate), rng.random()
    while product > threshold:
        count += 1
        product *= rng.random()
    return count


def max_over_mean(pods: list[SimPod]) -> float:
    served = [pod.served for pod in pods]
    return max(served) / (sum(served) / len(served))


def hit_rate(pods: list[SimPod]) -> float:
    return sum(pod.hits for pod in pods) / max(1, sum(pod.served for pod in pods))
