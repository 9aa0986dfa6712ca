"""`bench fleet`'s workload, in the shape of llm-d's multi-tenant benchmark scaled to a CPU, and its oracle.

llm-d's: 150 tenants, each a ~6k-token system prompt shared by its users, short questions, Poisson arrivals, over
8 pods. Here: a few tenants with a few hundred tokens of system prompt each, several users (client connections)
per tenant, a question of a few dozen tokens unique to every request, and a few output tokens, so that prefill
dominates and what a policy saves is prefill. Seedable: the same seed gives the same trace, tokens included.

The oracle (`oracle_hit_rate`) is an upper bound of any policy's prefix hit rate on the trace: each tenant's
system prompt is computed once, at its first request, and every later request of the tenant reuses all of it
(the blocks a pod can reuse: its full blocks, leaving the prompt's last token). Questions are unique, so nothing
else can hit. The bound is reachable when each tenant lives on one pod whose KV budget holds its tenants'
prefixes (`prefixes_fit`: first-fit decreasing into the pods' budgets), and no eviction ever strikes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FleetRequest:
    tenant: int
    client: int  # one connection: the user, numbered across tenants (tenant * users_per_tenant + user)
    arrival_s: float
    token_ids: tuple[int, ...]  # the tenant's system prompt, then the request's own question
    output_len: int


@dataclass(frozen=True)
class FleetWorkload:
    requests: list[FleetRequest]
    num_tenants: int
    num_clients: int
    system_len: int  # tokens of each tenant's shared system prompt


def multi_tenant(num_requests: int, num_tenants: int, users_per_tenant: int, system_len: int, question_len: int,
                 output_len: int, request_rate: float, vocabulary: Sequence[int], seed: int = 0) -> FleetWorkload:
    """Each request from a user drawn uniformly (so tenants are equally popular), Poisson arrivals at
    request_rate; token ids drawn from `vocabulary` (ids the model reads as ordinary text)."""
    if min(num_requests, num_tenants, users_per_tenant, system_len, question_len, output_len) <= 0:
        raise ValueError("every size of the fleet workload must be positive")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    rng = random.Random(seed)
    ids = list(vocabulary)
    systems = [tuple(rng.choices(ids, k=system_len)) for _ in range(num_tenants)]
    requests, now = [], 0.0
    for _ in range(num_requests):
        client = rng.randrange(num_tenants * users_per_tenant)
        tenant = client // users_per_tenant
        now += rng.expovariate(request_rate)
        question = tuple(rng.choices(ids, k=question_len))
        requests.append(FleetRequest(tenant, client, now, systems[tenant] + question, output_len))
    return FleetWorkload(requests, num_tenants, num_tenants * users_per_tenant, system_len)


def reusable_tokens(num_tokens: int, shared_tokens: int, block_size: int) -> int:
    """The tokens of a prompt's shared leading part that a pod holding all of it serves from its cache: its full
    blocks, leaving at least the prompt's last token (block_manager's admission)."""
    return min(shared_tokens // block_size, (num_tokens - 1) // block_size) * block_size


def oracle_hit_rate(workload: FleetWorkload, block_size: int) -> float:
    """Cached prompt tokens / prompt tokens if every tenant's system prompt were computed once (module docstring)."""
    seen: set[int] = set()
    cached = total = 0
    for request in workload.requests:
        total += len(request.token_ids)
        if request.tenant in seen:
            cached += reusable_tokens(len(request.token_ids), workload.system_len, block_size)
        seen.add(request.tenant)
    return cached / total if total else 0.0


def prefixes_fit(num_tenants: int, prefix_blocks: int, num_pods: int, blocks_per_pod: int,
                 working_blocks: int) -> bool:
    """Whether one pod per tenant can hold every tenant's prefix (all the same size: first-fit decreasing is a
    round-robin fill), each pod keeping `working_blocks` for the sequences it runs."""
    per_pod = (blocks_per_pod - working_blocks) // prefix_blocks if prefix_blocks else num_tenants
    return per_pod * num_pods >= num_tenants


def requests_per_pod(pods: Sequence[str], served: Sequence[str]) -> dict[str, int]:
    counts = dict.fromkeys(pods, 0)
    for pod in served:
        counts[pod] += 1
    return counts


def max_over_mean(counts: dict[str, int]) -> float:
    mean = sum(counts.values()) / len(counts)
    return max(counts.values()) / mean if mean else 0.0
