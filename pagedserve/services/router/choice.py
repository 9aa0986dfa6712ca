"""Picking the pod for one request: `kv-aware` (the default), `least-load`, `round-robin`, `random`.

kv-aware, in the spirit of NVIDIA Dynamo's KV router, picks the lowest

    cost = PREFILL_WEIGHT * new_blocks + (load_blocks + new_blocks)

- `new_blocks`: the prompt's blocks the pod must compute, its blocks minus the leading ones the pod's cache holds.
  The first term is the prefill a hit saves, most of a long prompt's TTFT.
- `load_blocks + new_blocks`: the blocks the pod would hold with this request (Dynamo's "potential decode
  blocks"). `load_blocks` (load.py) is its blocks in use, its waiting sequences at the running ones' mean size,
  and what the prompts this router sent since its report add. The request's cached blocks count as held
  already (in use, they are; free, reviving them computes nothing). Blocks held track decode work (each step
  reads every live block) and how close the pod is to preempting; counting both terms in blocks puts them in
  one unit, as Dynamo does. Without the request's own blocks in this term, a pod would pay for a popular
  prefix twice: once in its blocks in use, and again as the advantage of a pod that has not computed it.
- `PREFILL_WEIGHT` 4.0: a block of prefill saved outweighs four blocks of queue. Dynamo's default is 1.0; here
  the waiting sequences' blocks are mostly cached prefixes (they cost no compute), so at 1.0 a queue soon outweighs
  the prefix and, under overload, tenants spread and evict one another: in `bench fleet --simulate --pods 64
  --request-rate 128` the hit rate was 0.35 at 1.0, 0.69 at 2.0 and 0.75 at 4.0 (oracle 0.86), p90 TTFT 0.38x,
  0.17x and 0.15x round-robin's; at light load 2.0 and 4.0 route alike. Lower favours spreading.

The cost alone still lets one pod run away, in two ways, and a guard stops each: a pod over the guard is left
out, and the lowest cost among the others wins (there the first request pays the prefill, and the prefix then
lives on two pods).
- *Sequences*: a popular prefix is counted once in the blocks in use however many sequences share it, so its
  holder looks light while its batch grows (the "death spiral" of cache-aware routers). As SGLang's router does
  when load is unbalanced, a fresh pod running more than `GUARD_FACTOR * mean + GUARD_SLACK_REQUESTS` sequences
  (the mean over fresh pods) is left out. `GUARD_FACTOR` 1.25: a pod may run a quarter above the fleet's mean for
  its prefix before the guard acts.
- *Requests over time*: at light load nothing runs long enough for the first guard, and a pod takes every
  request of the tenants whose prefixes it holds: with 171 tenants over 64 simulated pods, 1.95x the mean
  requests. So a pod this router sent more than `RECENT_GUARD_FACTOR * mean + GUARD_SLACK_REQUESTS` of its recent
  requests (each fading with a half-life of `load.RECENT_HALF_LIFE_S`, 60 s) is left out too. `RECENT_GUARD_FACTOR`
  1.4 kept that fleet at 1.45x for 2.1 points of hit rate (0.845 -> 0.824; 1.5 gave 1.55x, 1.25 1.32x at 0.808).
  It counts this replica's requests only: replicas that each balance their own share balance the sum.
- `GUARD_SLACK_REQUESTS` 2: at low load the mean is a handful, and 3 against a mean of 1 is no imbalance worth a
  cache miss.

Every policy ranks only fresh pods (a recent load report) when there are any: a stale or never-reported pod's
load is unknown, never zero. With no fresh pod at all, the one with the fewest requests in flight from this
router wins. Ties go to the pod after the last pick in name order, so equal pods take turns.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..common.errors import NotReady
from ..common.kv_events import STALE_AFTER_S
from .load import PodState, is_fresh, load_blocks, load_requests, trusted_cached_blocks
from .prompt_blocks import PromptBlocks

POLICIES = ("kv-aware", "least-load", "round-robin", "random")
PREFILL_WEIGHT = 4.0
GUARD_FACTOR = 1.25
GUARD_SLACK_REQUESTS = 2
RECENT_GUARD_FACTOR = 1.4
NO_PODS = "no pod to route to: the fleet has no ready endpoint"


class Choice(NamedTuple):
    pod: str
    reason: str
    predicted_cached_tokens: int  # what the pod should report in Usage, for telemetry
    cost: float | None = None  # kv-aware's, in blocks


class Chooser:
    """One router's policy; holds the turn for round-robin and ties, and the seeded generator for random."""

    def __init__(self, policy: str = "kv-aware", seed: int | None = None, max_report_age_s: float = STALE_AFTER_S):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.policy = policy
        self.max_report_age_s = max_report_age_s
        self._random = random.Random(seed)
        self._last_pick: str | None = None

    def choose(self, prompt: PromptBlocks, pods: Sequence[PodState], now: float) -> Choice:
        """The pod for this request; raises NotReady when there is none. Advances the turn."""
        if not pods:
            raise NotReady(NO_PODS)
        fresh = [pod for pod in pods if is_fresh(pod, now, self.max_report_age_s)]
        turn = self._turn_order(pods)
        if not fresh:
            pod = min(pods, key=lambda p: (p.inflight.requests, turn[p.name]))
            choice = self._choice(pod, prompt, now, "no fresh load report: fewest requests in flight from here")
        elif self.policy == "kv-aware":
            choice = self._kv_aware(prompt, fresh, now, turn)
        elif self.policy == "least-load":
            pod = min(fresh, key=lambda p: (load_requests(p), p.inflight.requests, turn[p.name]))
            choice = self._choice(pod, prompt, now, f"least-load: {load_requests(pod)} sequences")
        elif self.policy == "round-robin":
            choice = self._choice(min(fresh, key=lambda p: turn[p.name]), prompt, now, "round-robin")
        else:
            choice = self._choice(self._random.choice(fresh), prompt, now, "random")
        self._last_pick = choice.pod
        return choice

    def _kv_aware(self, prompt: PromptBlocks, fresh: list[PodState], now: float, turn: dict[str, int]) -> Choice:
        costs = {pod.name: self._cost(prompt, pod, now) for pod in fresh}

        def rank(pod: PodState) -> tuple[float, int, int]:
            return costs[pod.name], load_requests(pod), turn[pod.name]

        best = min(fresh, key=rank)
        running = _over_guard(fresh, load_requests, GUARD_FACTOR)
        recent = _over_guard(fresh, lambda p: p.inflight.recent_requests, RECENT_GUARD_FACTOR)
        allowed = [pod for pod in fresh if pod.name not in running and pod.name not in recent]
        pod = min(allowed or fresh, key=rank)  # empty only if one pod is over one guard and the rest the other
        cached = trusted_cached_blocks(pod, now, self.max_report_age_s)
        reason = f"kv-aware: cost {costs[pod.name]:.1f} blocks, {cached} of {prompt.num_blocks} prompt blocks cached"
        if pod is not best:
            why, factor = ((f"runs {load_requests(best)} sequences", GUARD_FACTOR) if best.name in running
                           else (f"took {best.inflight.recent_requests:.1f} recent requests", RECENT_GUARD_FACTOR))
            reason += f" (guard: {best.name} {why}, over {factor} x the mean + {GUARD_SLACK_REQUESTS})"
        return self._choice(pod, prompt, now, reason, costs[pod.name])

    def _cost(self, prompt: PromptBlocks, pod: PodState, now: float) -> float:
        new_blocks = prompt.num_blocks - trusted_cached_blocks(pod, now, self.max_report_age_s)
        return PREFILL_WEIGHT * new_blocks + load_blocks(pod, prompt.num_blocks, prompt.block_size) + new_blocks

    def _choice(self, pod: PodState, prompt: PromptBlocks, now: float, reason: str, cost: float | None = None
                ) -> Choice:
        return Choice(pod.name, reason, prompt.cached_tokens(trusted_cached_blocks(pod, now, self.max_report_age_s)),
                      cost)

    def _turn_order(self, pods: Sequence[PodState]) -> dict[str, int]:
        """Each pod's place in the queue of turns: name order, starting after the last pick."""
        names = sorted(pod.name for pod in pods)
        last = self._last_pick
        start = next((i for i, name in enumerate(names) if last is not None and name > last), 0)
        return {name: (i - start) % len(names) for i, name in enumerate(names)}


def _over_guard(pods: list[PodState], measure: Callable[[PodState], float], factor: float) -> set[str]:
    """The pods whose `measure` exceeds `factor` x its mean over `pods` + GUARD_SLACK_REQUESTS."""
    limit = factor * sum(map(measure, pods)) / len(pods) + GUARD_SLACK_REQUESTS
    return {pod.name for pod in pods if measure(pod) > limit}
