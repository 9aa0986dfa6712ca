"""What each arm of `bench fleet` shares, real or simulated: the run's shape, its workload, the arms' order and the
keys of an arm's outcome."""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .fleet_sim import ArmOutcome
from .fleet_workload import FleetWorkload, max_over_mean, multi_tenant, requests_per_pod


@dataclass(frozen=True)
class Shape:
    pods: int
    tenants: int
    users_per_tenant: int
    requests: int
    request_rate: float
    system_tokens: int
    question_tokens: int
    output_tokens: int
    block_size: int
    num_blocks: int
    max_num_seqs: int

    @property
    def prefix_blocks(self) -> int:
        return self.system_tokens // self.block_size

    @property
    def working_blocks(self) -> int:
        """Blocks the running sequences hold beyond their prefix: each one's question and output, and a spare."""
        return self.max_num_seqs * (math.ceil((self.question_tokens + self.output_tokens) / self.block_size) + 1)

def workload_for(shape: Shape, vocabulary: Sequence[int], seed: int) -> FleetWorkload:
    return multi_tenant(shape.requests, shape.tenants, shape.users_per_tenant, shape.system_tokens,
                        shape.question_tokens, shape.output_tokens, shape.request_rate, vocabulary, seed)

def arm_keys(outcome: ArmOutcome, pods: Sequence[str]) -> dict[str, Any]:
    ttft = sorted(outcome.ttft_s)
    counts = requests_per_pod(pods, outcome.served)
    return {
        "ttft_p50_s": round(quantile(ttft, 0.5), 4),
        "ttft_p90_s": round(quantile(ttft, 0.9), 4),
        "tok_s": round(outcome.output_tokens / outcome.duration_s, 3),
        "prefix_hit_rate": round(outcome.cached_tokens / outcome.prompt_tokens, 4),
        "max_over_mean_requests": round(max_over_mean(counts), 3),
        "requests": len(outcome.served),
        "requests_per_pod_max": max(counts.values()),
        "requests_per_pod_min": min(counts.values()),
    }

def quantile(values: Sequence[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]

def arm_order(names: Sequence[str], seed: int) -> list[str]:
    order = list(names)
    random.Random(seed).shuffle(order)
    return order

def progress(what: str, fields: dict[str, Any]) -> dict[str, Any]:
    print(f"bench fleet: {what}: {json.dumps(fields)}", file=sys.stderr, flush=True)
    return fields
