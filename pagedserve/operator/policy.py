"""The autoscaling policy: a window of pod metrics and an AutoscalingPolicy in, a replica count and why out.

Pure (no I/O, no clock, stdlib only), so every rule is tested without a cluster and the benchmark
replays a day through this very code. The caller keeps one `Observation` per scrape round, at least
`ScalingPolicy.history_s` of them, and compares the answer with the current size.

Per observation: n = pods measured, p = used / capacity blocks (the block pressure), so n * p is the
KV demand in pods' worth of blocks; a = goodput / finished (SLO attainment), q = requests waiting.
Targets: P = target_block_pressure, A = target_slo_attainment, band = P * (1 + tolerance).

- Bounds: the answer is always clamped to [min, max], even without data or in cooldown.
- No data (empty window, latest older than stale_after_s, or not every pod scraped): hold. A policy
  that cannot see the load neither removes pods nor adds them.
- Up: an observation asks for ceil(n * p / P) when p > band, and for n + 1 at least when requests wait
  while a < A (pooled over metrics_window_s: a ratio of rates, noisy at low traffic) or while the
  hottest pod is over the band. n counts the pods measured, not the replicas: pods still loading carry
  no load yet, and counting them would scale up twice for one surge. With scale_up_stabilization_s > 0
  the lowest ask over that window wins (HPA semantics). At most scale_up_max_step pods are added.
- Down: only when every observation of the last scale_down_stabilization_s is there (no gap longer
  than stale_after_s), complete and comfortable: p * n / (n - 1) <= P (one pod fewer would still be
  under target), a >= A or nothing finished, q == 0. Then down to the highest ceil(n_i * p_i / P) over
  that window, removing at most scale_down_max_percent of the pods (at least one).
- Cooldown: no change within cooldown_s of the last one.

Why it does not flap at constant load: after going up to m = ceil(n p / P) the pressure is n p / m <= P,
under the band, while one pod fewer would be over P, so neither side fires; after going down to
m = ceil(max n_i p_i / P) the same holds. Coming down needs a whole quiet window; going up needs one
scrape. The SLO triggers keep this only if attainment holds below P: if they fire under the target, P is
too high for the model and its objectives (the size then cycles once per down window): lower it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

_EPS = 1e-9  # ceil(10 * 0.7 / 0.7) must be 10, not 11


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


@dataclass(frozen=True)
class ScalingPolicy:
    """The AutoscalingPolicy CR's spec with the schema's defaults (the math: the module docstring).

    The defaults come from `pagedserve bench autoscale` (a pod of 23 ShareGPT-sized requests, TTFT 3 s):
    above half the KV cache, queueing for a slot already costs more than 1 % of requests their TTFT; a
    burst is met only by adding many pods at once (8 a step) at every scrape (a 15 s cooldown is one
    scrape interval: never two changes on one round of data).
    """

    target_block_pressure: float = 0.5
    target_slo_attainment: float = 0.95
    metrics_window_s: float = 60.0
    tolerance: float = 0.1
    scale_up_max_step: int = 8
    scale_up_stabilization_s: float = 0.0
    scale_down_max_percent: float = 50.0
    scale_down_stabilization_s: float = 300.0
    cooldown_s: float = 15.0

    def __post_init__(self) -> None:
        for name in ("target_block_pressure", "target_slo_attainment"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0.0 < self.scale_down_max_percent <= 100.0:
            raise ValueError(f"scale_down_max_percent must be in (0, 100], got {self.scale_down_max_percent}")
        if self.scale_up_max_step < 1:
            raise ValueError(f"scale_up_max_step must be >= 1, got {self.scale_up_max_step}")
        for name in ("metrics_window_s", "tolerance", "scale_up_stabilization_s", "scale_down_stabilization_s",
                     "cooldown_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> ScalingPolicy:
        """From the CR's camelCase spec; missing (or null) fields take the defaults."""
        up, down, default = spec.get("scaleUp") or {}, spec.get("scaleDown") or {}, cls()

        def number(source: Mapping[str, Any], key: str, fallback: float) -> float:
            return float(fallback if source.get(key) is None else source[key])

        return cls(
            target_block_pressure=number(spec, "targetBlockPressure", default.target_block_pressure),
            target_slo_attainment=number(spec, "targetSloAttainment", default.target_slo_attainment),
            metrics_window_s=number(spec, "metricsWindowSeconds", default.metrics_window_s),
            tolerance=number(spec, "tolerance", default.tolerance),
            scale_up_max_step=int(number(up, "maxStep", default.scale_up_max_step)),
            scale_up_stabilization_s=number(up, "stabilizationWindowSeconds", default.scale_up_stabilization_s),
            scale_down_max_percent=number(down, "maxPercent", default.scale_down_max_percent),
            scale_down_stabilization_s=number(down, "stabilizationWindowSeconds", default.scale_down_stabilization_s),
            cooldown_s=number(spec, "cooldownSeconds", default.cooldown_s),
        )

    @property
    def history_s(self) -> float:
        """How much history decide() reads: the caller must keep at least this much (one interval more)."""
        return max(self.metrics_window_s, self.scale_up_stabilization_s, self.scale_down_stabilization_s)


@dataclass(frozen=True)
class Observation:
    """One scrape round over the ready pods of one model; sums over the pods that answered."""

    time: float
    num_pods: int
    num_scraped: int
    used_blocks: int
    total_blocks: int
    max_pod_pressure: float
    goodput_rps: float
    finished_rps: float
    waiting_requests: int
    preemptions_per_s: float

    @property
    def block_pressure(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def slo_attainment(self) -> float | None:
        return self.goodput_rps / self.finished_rps if self.finished_rps > 0 else None

    @property
    def complete(self) -> bool:
        return self.num_scraped == self.num_pods and self.num_pods > 0

    @property
    def load_pods(self) -> float:
        """The KV demand in pods' worth of blocks (n * p)."""
        return self.num_pods * self.block_pressure


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    metrics_available: bool
    limited: bool  # min/max, the step bound or cooldown held back what the metrics asked for


class _Ask(NamedTuple):
    """What the metrics ask for (`wanted`), what the step bounds allow of it, and why."""

    wanted: int
    allowed: int
    why: str


def decide(window: Sequence[Observation], replicas: int, min_replicas: int, max_replicas: int,
           policy: ScalingPolicy, now: float, last_scale_time: float | None,
           stale_after_s: float = 45.0) -> Decision:
    """The replica count for a model, from its observations (oldest first) and the policy."""
    if not 0 <= min_replicas <= max_replicas:
        raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {min_replicas} and {max_replicas}")
    bounded = min(max(replicas, min_replicas), max_replicas)
    clamp_note = f"; clamped to [{min_replicas}, {max_replicas}]: {replicas} -> {bounded}" * (bounded != replicas)
    missing = _missing_data(window, now, stale_after_s)
    if missing is not None:
        return Decision(bounded, f"{missing}: holding {bounded}{clamp_note}", False, False)
    ask = _ask_up(window, replicas, policy, now) or _ask_down(window, replicas, policy, now, stale_after_s)
    if ask is None:
        return Decision(bounded, _hold_reason(window, replicas, policy, now, stale_after_s) + clamp_note, True, False)
    if last_scale_time is not None and now - last_scale_time < policy.cooldown_s:
        why = (f"{ask.why}, but in cooldown ({now - last_scale_time:.0f}s since the last change < "
               f"{policy.cooldown_s:.0f}s): holding {replicas}")
        return Decision(bounded, why + clamp_note, True, True)
    final = min(max(ask.allowed, min_replicas), max_replicas)
    held_back = [f"step bound, {ask.wanted} wanted"] * (ask.allowed != ask.wanted)
    held_back += [f"bounds [{min_replicas}, {max_replicas}]"] * (final != ask.allowed)
    change = f"{replicas} -> {final}" if final != replicas else f"holding {replicas}"
    why = f"{ask.why}: {change}" + (f" ({'; '.join(held_back)})" if held_back else "")
    return Decision(final, why, True, final != ask.wanted)


def _missing_data(window: Sequence[Observation], now: float, stale_after_s: float) -> str | None:
    if not window:
        return "no metrics yet"
    latest = window[-1]
    if now - latest.time > stale_after_s:
        return f"stale metrics (latest {now - latest.time:.0f}s old > {stale_after_s:.0f}s)"
    if not latest.complete:
        return f"incomplete metrics ({latest.num_scraped} of {latest.num_pods} pods scraped)"
    return None


def _since(window: Sequence[Observation], start: float) -> list[Observation]:
    """The observations at or after `start`, the latest always included."""
    return [o for o in window if o.time >= start] or [window[-1]]


def _pooled_attainment(window: Sequence[Observation], until: float, span: float) -> float | None:
    """goodput / finished summed over the complete observations in [until - span, until]."""
    pool = [o for o in window if until - span <= o.time <= until and o.complete]
    finished = sum(o.finished_rps for o in pool)
    return sum(o.goodput_rps for o in pool) / finished if finished > 0 else None


def _up_ask(window: Sequence[Observation], at: Observation, policy: ScalingPolicy) -> tuple[int, str] | None:
    """What one (complete) observation asks for above its own pod count, and why; None if nothing."""
    band = policy.target_block_pressure * (1 + policy.tolerance)
    target = f"target {policy.target_block_pressure:.2f} (x{1 + policy.tolerance:g})"
    n, asks = at.num_pods, []
    if at.block_pressure > band:
        asks.append((_ceil(at.load_pods / policy.target_block_pressure),
                     f"block pressure {at.block_pressure:.2f} > {target}"))
    if at.waiting_requests > 0:
        attainment = _pooled_attainment(window, at.time, policy.metrics_window_s)
        if attainment is not None and attainment < policy.target_slo_attainment:
            asks.append((n + 1, f"SLO attainment {attainment:.2f} < target {policy.target_slo_attainment:.2f} "
                                f"with {at.waiting_requests} requests waiting"))
        if at.max_pod_pressure > band:
            asks.append((n + 1, f"hottest pod's block pressure {at.max_pod_pressure:.2f} > {target} with "
                                f"{at.waiting_requests} requests waiting"))
    return max(asks) if asks else None


def _stabilized_up(window: Sequence[Observation], policy: ScalingPolicy, now: float) -> tuple[int, str] | None:
    """The latest observation's ask, lowered to the lowest ask over scale_up_stabilization_s (a quiet
    observation asks for its own pod count); None when the latest asks for nothing."""
    latest_ask = _up_ask(window, window[-1], policy)
    if latest_ask is None:
        return None
    wanted, why = latest_ask
    if policy.scale_up_stabilization_s > 0:
        for o in _since(window, now - policy.scale_up_stabilization_s):
            ask = _up_ask(window, o, policy) if o.complete else None
            wanted = min(wanted, ask[0] if ask else o.num_pods)
        why += f" (lowest ask over {policy.scale_up_stabilization_s:.0f}s: {wanted})"
    return wanted, why


def _ask_up(window: Sequence[Observation], replicas: int, policy: ScalingPolicy, now: float) -> _Ask | None:
    up = _stabilized_up(window, policy, now)
    if up is None or up[0] <= replicas:  # enough pods are already there or on their way
        return None
    wanted, why = up
    return _Ask(wanted, min(wanted, replicas + policy.scale_up_max_step), why)


def _down_blocker(window: Sequence[Observation], policy: ScalingPolicy, now: float,
                  stale_after_s: float) -> str | None:
    """Why the last scale_down_stabilization_s do not allow going down; None if they do."""
    span = policy.scale_down_stabilization_s
    recent = _since(window, now - span)
    times = [now - span, *(o.time for o in recent), now]
    gap = max(later - earlier for earlier, later in itertools.pairwise(times))
    if gap > stale_after_s:
        return f"the last {span:.0f}s are not covered (a {gap:.0f}s gap)"
    for o in recent:
        n, attainment = o.num_pods, o.slo_attainment
        if not o.complete:
            return f"an incomplete scrape ({o.num_scraped} of {n} pods) in the last {span:.0f}s"
        if n < 2 or o.block_pressure * n / (n - 1) > policy.target_block_pressure:
            return (f"block pressure {o.block_pressure:.2f} on {n} pods would exceed "
                    f"{policy.target_block_pressure:.2f} on one fewer")
        if attainment is not None and attainment < policy.target_slo_attainment:
            return f"SLO attainment {attainment:.2f} < {policy.target_slo_attainment:.2f}"
        if o.waiting_requests > 0:
            return f"{o.waiting_requests} requests waiting"
    return None


def _ask_down(window: Sequence[Observation], replicas: int, policy: ScalingPolicy, now: float,
              stale_after_s: float) -> _Ask | None:
    if _down_blocker(window, policy, now, stale_after_s) is not None:
        return None
    recent = _since(window, now - policy.scale_down_stabilization_s)
    peak = max(recent, key=lambda o: o.load_pods)
    wanted = max(1, _ceil(peak.load_pods / policy.target_block_pressure))
    if wanted >= replicas:
        return None
    floor = replicas - max(1, math.floor(replicas * policy.scale_down_max_percent / 100))
    why = (f"comfortable for {policy.scale_down_stabilization_s:.0f}s, peak demand {peak.load_pods:.2f} pods "
           f"(pressure {peak.block_pressure:.2f} on {peak.num_pods}) fits {wanted} at target "
           f"{policy.target_block_pressure:.2f}")
    return _Ask(wanted, max(wanted, floor), why)


def _hold_reason(window: Sequence[Observation], replicas: int, policy: ScalingPolicy, now: float,
                 stale_after_s: float) -> str:
    up = _stabilized_up(window, policy, now)
    if up is not None:
        return f"{up[1]} asks for {up[0]} pods; {replicas} replicas (ready or starting) cover it: holding {replicas}"
    latest = window[-1]
    blocker = _down_blocker(window, policy, now, stale_after_s) or "the load needs every pod"
    return (f"block pressure {latest.block_pressure:.2f} on {latest.num_pods} pods within target "
            f"{policy.target_block_pressure:.2f} (x{1 + policy.tolerance:g}); not down: {blocker}: holding {replicas}")
