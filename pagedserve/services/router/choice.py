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
- `PREFILL_WEIGHT` 1.0 (Dynamo's default overlap weight): a block of prefill saved is worth a block of queue
  avoided. Higher favours TTFT through affinity, lower favours spreading (inter-token latency).

The cost alone still lets one pod run away: a popular prefix is counted once in the blocks in use however many
sequences share it, so its holder looks light while its batch grows (the "death spiral" of cache-aware routers).
So, as SGLang's router does when load is unbalanced, a guard counts *sequences*: a fresh pod holding more than
`GUARD_FACTOR * mean + GUARD_SLACK_REQUESTS` of them (the mean over fresh pods) is left out, and the lowest
cost among the others wins. There the first request pays the prefill, and the prefix then lives on two pods.
- `GUARD_FACTOR` 1.25: a pod may run a quarter above the fleet's mean for its prefix before the guard acts,
  which keeps requests per pod within the 1.5x of the mean that the fleet benchmark asks of every policy.
- `GUARD_SLACK_REQUESTS` 2: at low load the mean is a handful, and 3 sequences against a mean of 1 is no
  imbalance worth a cache miss.

Every policy ranks only fresh pods (a recent load report) when there are any: a stale or never-reported pod's
load is unknown, never zero. With no fresh pod at all, the one with the fewest requests in flight from this
router wins. Ties go to the pod after the last pick in name order, so equal pods take turns.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

from ..common.errors import NotReady
from ..common.kv_events import STALE_AFTER_S
from .load import PodState, is_fresh, load_blocks, load_requests, trusted_cached_blocks
from .prompt_blocks import PromptBlocks

POLICIES = ("kv-aware", "least-load", "round-robin", "random")
PREFILL_WEIGHT = 1.0
GUARD_FACTOR = 1.25
GUARD_SLACK_REQUESTS = 2
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
        mean = sum(map(load_requests, fresh)) / len(fresh)
        limit = GUARD_FACTOR * mean + GUARD_SLACK_REQUESTS
        costs = {pod.name: self._cost(prompt, pod, now) for pod in fresh}

        def rank(pod: PodState) -> tuple[float, int, int]:
            return costs[pod.name], load_requests(pod), turn[pod.name]

        best = min(fresh, key=rank)
        allowed = [pod for pod in fresh if load_requests(pod) <= limit]  # never empty: the least loaded <= mean
        pod = min(allowed, key=rank)
        cached = trusted_cached_blocks(pod, now, self.max_report_age_s)
        reason = f"kv-aware: cost {costs[pod.name]:.1f} blocks, {cached} of {prompt.num_blocks} prompt blocks cached"
        if pod is not best:
            reason += (f" (guard: {best.name} runs {load_requests(best)} sequences, over"
                       f" {GUARD_FACTOR} x the mean {mean:.1f} + {GUARD_SLACK_REQUESTS})")
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
