"""`pagedserve bench autoscale`: a simulated day replayed through the operator's own `decide()`, against
static provisioning and the single-metric autoscalers the ecosystem runs.

The pod (calibration, from this project's measured and default figures; printed under `calibration`):
- KV blocks: 728 = the CPU pod's default 512 MiB KV budget / 720 KiB a block (SmolLM2-135M in fp32:
  K and V x 30 layers x 3 KV heads x 64 dims x 16 tokens x 4 bytes).
- Decode speed: `bench executor`, the whole engine on the torch CPU path (docs/operator.md): 22.9, 98.2,
  261.5 tok/s at batch 1, 8, 32, i.e. 43.7, 81.5, 122.4 ms a step; linear in between, the last slope beyond.
- Requests: ShareGPT-shaped lengths (`workloads.sharegpt_like`, unscaled: `bench serve` scales them
  down only to keep a CPU run short). A running request holds `mean_blocks_held` blocks on average over
  its decode, so a pod runs c = blocks x (1 - 1 % watermark) / that many at once (at most 64,
  --max-num-seqs). A request takes S = mean output tokens x the step time at batch c; the pod's
  saturation point is c / S requests/s.
- Objectives: `bench serve`'s TTFT 3 s and TPOT 300 ms. TPOT at batch c is well under its objective,
  so waiting for a free slot (TTFT) decides goodput.

Queueing, per interval (the operator's scrape interval, 15 s), for r ready pods sharing the load evenly:
- Slots (fluid): requests in flight finish at rate in-flight / S; a request starts when a slot is free
  (free slots take arrivals at once), else it waits in a backlog that carries over (at most 256 a pod,
  --max-waiting-requests; past it requests are refused: misses). A request can meet TTFT only if the
  backlog ahead of it drains within the TTFT budget (at the saturation rate r x c / S).
- Randomness under the saturation point (M/M/c per pod: c slots, exponential service): a request waits
  longer than the budget T with probability ErlangC(c, a) x exp(-(c - a) T / S) at offered load
  a = rate x S per pod (a >= c: all miss). A request meets the objective when both let it.
- What the pods report: block pressure = in flight x mean_blocks_held / capacity; waiting = backlog +
  the M/M/c mean queue; goodput and finished requests/s over 60 s, counted when requests finish (S
  after they start).
New replicas serve only --startup-s after they are created (model load) and count in replica-hours
from creation. Scale-down removes the newest pods first (a starting one before a serving one).

Trace: rate = peak x (0.55 - 0.45 cos(2 pi t / day)), 10 % to 100 % of peak, plus bursts at 150 % of
peak for 5 minutes at seeded times; Poisson arrivals per interval (seeded), the same for every policy.
The peak is --peak-pods pods' saturation rate.

Policies: ours (`decide()` with the default `ScalingPolicy`); static (the fewest fixed pods whose
attainment reaches ours, searched); HPA's formula desired = ceil(sum of the metric / target) on KV
cache usage alone (ours' target) and on waiting requests alone (5 a pod, the KEDA examples' value),
as KEDA/HPA run them: 10 % tolerance, up by at most max(100 %, 4 pods) a step, down only to the highest
recommendation of the last 300 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import random
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..operator.policy import Observation, ScalingPolicy, decide
from .report import emit
from .workloads import sharegpt_like

MEASURED_DECODE = ((1, 22.9), (8, 98.2), (32, 261.5))  # (batch, tokens/s): bench executor, torch CPU path
KV_BLOCKS_PER_POD = 728  # 512 MiB // (2 * 30 * 3 * 64 * 16 * 4 bytes)
BLOCK_SIZE, MAX_NUM_SEQS, WATERMARK, MAX_WAITING_PER_POD = 16, 64, 0.01, 256
TTFT_SLO_S, TPOT_SLO_S = 3.0, 0.3
REPORT_WINDOW_S = 60.0  # the pods' goodput window
RECOVERY_S = 600.0  # "outside bursts" leaves out each burst and the 10 minutes after it
HPA_TOLERANCE, HPA_DOWN_WINDOW_S, QUEUE_TARGET_PER_POD = 0.1, 300.0, 5.0


def step_s(batch: float) -> float:
    """Decode step time at a batch size: the measured points, linear in between, the last slope beyond."""
    points = [(b, b / tok_s) for b, tok_s in MEASURED_DECODE]
    for (b0, t0), (b1, t1) in itertools.pairwise(points):
        if batch <= b1 or b1 == points[-1][0]:
            return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    raise AssertionError("MEASURED_DECODE needs two points")


@dataclass(frozen=True)
class Pod:
    """One pod's capacity model (module docstring)."""

    slots: int  # c: requests running at once when the KV cache is full
    service_s: float  # S: how long a request holds its slot
    mean_blocks_held: float
    mean_output_tokens: float

    @property
    def saturation_rps(self) -> float:
        return self.slots / self.service_s

    @property
    def ttft_budget_s(self) -> float:
        return TTFT_SLO_S - step_s(self.slots)  # the prefill step itself

    def calibration(self) -> dict[str, Any]:
        return {"kv_blocks_per_pod": KV_BLOCKS_PER_POD, "block_size": BLOCK_SIZE, "decode_tok_s_measured":
                {str(b): t for b, t in MEASURED_DECODE}, "mean_output_tokens": round(self.mean_output_tokens, 1),
                "mean_blocks_held": round(self.mean_blocks_held, 2), "slots_per_pod": self.slots,
                "tpot_ms_at_saturation": round(step_s(self.slots) * 1000, 1), "service_s": round(self.service_s, 1),
                "pod_saturation_rps": round(self.saturation_rps, 4), "ttft_slo_ms": TTFT_SLO_S * 1000,
                "tpot_slo_ms": TPOT_SLO_S * 1000, "max_waiting_per_pod": MAX_WAITING_PER_POD}


def block_steps(num_tokens: int) -> int:
    """Blocks summed over the first num_tokens positions of a sequence: sum of ceil(t / BLOCK_SIZE), t <= n."""
    full, rest = divmod(num_tokens, BLOCK_SIZE)
    return BLOCK_SIZE * full * (full + 1) // 2 + rest * (full + 1)


def calibrate(seed: int, num_samples: int = 20_000) -> Pod:
    specs = sharegpt_like(num_samples, seed=seed)
    decode_steps = sum(s.output_len for s in specs)
    held = sum(block_steps(s.prompt_len + s.output_len) - block_steps(s.prompt_len) for s in specs)
    blocks_held = held / decode_steps  # time-weighted: long requests hold more, for longer
    slots = min(MAX_NUM_SEQS, int(KV_BLOCKS_PER_POD * (1 - WATERMARK) / blocks_held))
    mean_output = decode_steps / len(specs)
    assert step_s(slots) <= TPOT_SLO_S, "TPOT binds: this model only accounts for TTFT"
    return Pod(slots, mean_output * step_s(slots), blocks_held, mean_output)


def erlang_c(c: int, a: float) -> float:
    """P(an arrival waits) in M/M/c at offered load a < c (Erlang B by recursion, then C)."""
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    return b / (1 - a / c * (1 - b))


def share_in_time(backlog: float, slope: float, threshold: float, dt: float) -> float:
    """Share of an interval during which a linear backlog (backlog + slope * t, floored at 0) stays within
    what drains in the TTFT budget."""
    if (backlog <= threshold and slope <= 0) or (backlog > threshold and slope >= 0):
        return float(backlog <= threshold)
    cross = (threshold - backlog) / slope / dt
    return min(1.0, cross) if slope > 0 else max(0.0, 1.0 - cross)


@dataclass
class Fleet:
    """One policy's pods and queues through the day (module docstring)."""

    pod: Pod
    startup_s: float
    created: list[float]  # each replica's creation time, oldest first
    backlog: float = 0.0
    in_flight: float = 0.0
    started: deque[tuple[float, float]] = field(default_factory=deque)  # (started, good) per interval

    def serve(self, ready: int, arrivals: int, dt: float) -> tuple[float, float]:
        """One interval: returns (good, waiting) and advances the backlog and the requests in flight."""
        pod, rate = self.pod, arrivals / dt
        decay = math.exp(-dt / pod.service_s)
        spread = pod.service_s / dt * (1 - decay)  # share of the interval's admissions still running at its end
        queue = 0.0
        if ready == 0:  # a Service without endpoints refuses everything
            self.backlog, started, good = 0.0, 0.0, 0.0
        else:
            slots, capacity = ready * pod.slots, ready * pod.saturation_rps
            room = max(0.0, (slots - self.in_flight * decay) / spread)  # free slots and those freed meanwhile
            started = min(self.backlog + arrivals, room)
            left = self.backlog + arrivals - started
            refused = max(0.0, left - ready * MAX_WAITING_PER_POD)
            ahead = self.backlog - max(0.0, room - capacity * dt)  # free slots take the backlog at once
            in_time = share_in_time(ahead, rate - capacity, capacity * pod.ttft_budget_s, dt)
            a, c = rate / ready * pod.service_s, pod.slots
            wait = erlang_c(c, a) if a < c else 1.0
            p_fast = 1 - wait * math.exp(-(c - a) * pod.ttft_budget_s / pod.service_s) if a < c else 0.0
            good = min(arrivals * in_time * p_fast, arrivals - refused)
            queue = ready * wait * a / (c - a) if a < c else 0.0
            self.backlog = left - refused
        self.in_flight = self.in_flight * decay + started * spread
        self.started.append((started, good))
        return good, self.backlog + queue

    def ready(self, now: float) -> int:
        return sum(1 for created in self.created if created + self.startup_s <= now)

    def scale(self, wanted: int, now: float) -> None:
        """The newest pods go first (a starting one before a serving one); requests on a removed pod finish
        there and leave the count."""
        before = self.ready(now)
        self.created = self.created[:wanted] + [now] * (wanted - len(self.created))
        self.in_flight *= self.ready(now) / before if before else 0.0

    def observe(self, now: float, ready: int, waiting: float, dt: float) -> Observation:
        lag = round(self.pod.service_s / dt)  # requests finish S after they start
        window = max(1, round(REPORT_WINDOW_S / dt))
        while len(self.started) > lag + window:
            self.started.popleft()
        done = list(self.started)[: max(0, len(self.started) - lag)][-window:]
        total = ready * KV_BLOCKS_PER_POD
        used = min(total, round(self.in_flight * self.pod.mean_blocks_held))
        span = window * dt
        return Observation(time=now, num_pods=ready, num_scraped=ready, used_blocks=used, total_blocks=total,
                           max_pod_pressure=used / total if total else 0.0,
                           goodput_rps=sum(g for _, g in done) / span, finished_rps=sum(s for s, _ in done) / span,
                           waiting_requests=round(waiting), preemptions_per_s=0.0)


class Scaler(Protocol):
    def scale(self, observation: Observation, replicas: int) -> int: ...


@dataclass
class Ours:
    """The operator's loop: a window of observations, `decide()`, the time of the last change."""

    policy: ScalingPolicy
    min_replicas: int
    max_replicas: int
    interval_s: float
    window: deque[Observation] = field(default_factory=deque)
    last_scale_time: float | None = None

    def scale(self, observation: Observation, replicas: int) -> int:
        self.window.append(observation)
        while self.window[0].time < observation.time - self.policy.history_s - self.interval_s:
            self.window.popleft()
        decision = decide(list(self.window), replicas, self.min_replicas, self.max_replicas, self.policy,
                          observation.time, self.last_scale_time)
        if decision.replicas != replicas:
            self.last_scale_time = observation.time
        return decision.replicas


@dataclass
class Hpa:
    """HPA's algorithm on one metric summed over the ready pods (pods still starting count as 0)."""

    metric_sum: Callable[[Observation], float]
    target_per_pod: float
    min_replicas: int
    max_replicas: int
    history: deque[tuple[float, int]] = field(default_factory=deque)  # (time, recommendation)

    def scale(self, observation: Observation, replicas: int) -> int:
        if not observation.complete:
            return min(max(replicas, self.min_replicas), self.max_replicas)
        total = self.metric_sum(observation)
        ratio = total / (observation.num_pods * self.target_per_pod)
        recommendation = replicas if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(total / self.target_per_pod)
        self.history.append((observation.time, recommendation))
        while self.history[0][0] < observation.time - HPA_DOWN_WINDOW_S:
            self.history.popleft()
        if recommendation > replicas:
            desired = min(recommendation, max(2 * replicas, replicas + 4))
        else:
            desired = min(replicas, max(r for _, r in self.history))
        return min(max(desired, self.min_replicas), self.max_replicas)


@dataclass
class Static:
    replicas: int

    def scale(self, observation: Observation, replicas: int) -> int:
        return self.replicas


@dataclass
class Run:
    attainment: float
    replica_hours: float
    num_scale_events: int
    replicas: list[int]  # per interval
    good: list[float]


def day_arrivals(args: argparse.Namespace, peak_rps: float) -> tuple[list[float], list[int], list[float]]:
    """(rate, Poisson arrivals) per interval, and the bursts' start times."""
    day_s, dt = args.hours * 3600, args.interval_s
    times = [k * dt for k in range(int(day_s / dt))]
    rng = random.Random(args.seed)
    burst_s = args.burst_minutes * 60
    bursts = sorted(rng.uniform(0, day_s - burst_s) for _ in range(args.bursts))
    rates = [peak_rps * (0.55 - 0.45 * math.cos(2 * math.pi * t / day_s)) for t in times]
    rates = [args.burst_factor * peak_rps if any(b <= t < b + burst_s for b in bursts) else r
             for t, r in zip(times, rates, strict=True)]
    arrivals = np.random.default_rng(args.seed).poisson(np.array(rates) * dt).tolist()
    return rates, arrivals, bursts


def plot(path: Path, rates: list[float], pod: Pod, runs: dict[str, Run], arrivals: list[int],
         args: argparse.Namespace) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state; a PNG renders through Agg

    dt = args.interval_s
    hours = [k * dt / 3600 for k in range(len(rates))]
    fig = Figure(figsize=(11, 8), layout="tight")
    ax_pods, ax_slo = fig.subplots(2, 1, sharex=True)
    ax_pods.plot(hours, [r / pod.saturation_rps for r in rates], color="0.6", lw=0.8,
                 label="load (pods at saturation)")
    for name, run in runs.items():
        thin = name == "queue only"  # it flaps: drawn faint so that the others stay readable
        ax_pods.step(hours, run.replicas, where="post", lw=0.5 if thin else 1.2, alpha=0.4 if thin else 1.0,
                     label=f"{name} replicas")
    ax_pods.set(ylabel="pods", title="replicas over the day")
    ax_pods.legend(fontsize=8)
    bucket = max(1, round(900 / dt))  # 15 minutes
    for name, run in runs.items():
        starts = range(0, len(arrivals), bucket)
        shares = [sum(run.good[i:i + bucket]) / max(1, sum(arrivals[i:i + bucket])) for i in starts]
        ax_slo.plot([hours[i] for i in starts], shares, lw=1.0, label=name)
    ax_slo.set(xlabel="hour", ylabel="SLO attainment (15 min)", ylim=(0, 1.02), title="SLO attainment")
    ax_slo.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def simulate(scaler: Scaler, pod: Pod, arrivals: list[int], initial: int, args: argparse.Namespace) -> Run:
    dt = args.interval_s
    fleet = Fleet(pod, args.startup_s, [-args.startup_s] * initial)  # warm at the start
    replicas, good_series, events = [], [], 0
    for k, count in enumerate(arrivals):
        ready = fleet.ready(k * dt)
        good, waiting = fleet.serve(ready, count, dt)
        replicas.append(len(fleet.created))
        good_series.append(good)
        now = (k + 1) * dt
        wanted = scaler.scale(fleet.observe(now, ready, waiting, dt), len(fleet.created))
        events += wanted != len(fleet.created)
        fleet.scale(wanted, now)
    return Run(sum(good_series) / max(1, sum(arrivals)), sum(replicas) * dt / 3600, events, replicas, good_series)


def smallest_static(pod: Pod, arrivals: list[int], attainment: float, args: argparse.Namespace) -> Run:
    """The fewest fixed replicas whose attainment reaches `attainment` (with as many pods as the autoscaler's
    most, every interval does at least as well, so the search ends)."""
    replicas = 1
    while (run := simulate(Static(replicas), pod, arrivals, replicas, args)).attainment < attainment:
        replicas += 1
    return run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--plot", type=Path, default=Path(tempfile.gettempdir()) / "pagedserve-autoscale.png",
                        help="replicas, load and attainment over the day (PNG)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hours", type=float, default=24.0, help="length of the simulated day (one load cycle)")
    parser.add_argument("--interval-s", type=float, default=15.0, help="the operator's scrape interval")
    parser.add_argument("--startup-s", type=float, default=60.0, help="a new pod's model load time")
    parser.add_argument("--peak-pods", type=float, default=8.0, help="the peak rate in pods' saturation rates")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--burst-factor", type=float, default=1.5, help="a burst's rate over the peak")
    parser.add_argument("--burst-minutes", type=float, default=5.0)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=20)


def run(args: argparse.Namespace) -> dict[str, Any]:
    pod, policy = calibrate(args.seed), ScalingPolicy()
    peak_rps = args.peak_pods * pod.saturation_rps
    rates, arrivals, bursts = day_arrivals(args, peak_rps)
    initial = max(args.min_replicas, math.ceil(rates[0] / pod.saturation_rps / policy.target_block_pressure))
    bounds = (args.min_replicas, args.max_replicas)
    ours = simulate(Ours(policy, *bounds, args.interval_s), pod, arrivals, initial, args)
    pressure = simulate(Hpa(lambda o: o.load_pods, policy.target_block_pressure, *bounds), pod, arrivals,
                        initial, args)
    queue = simulate(Hpa(lambda o: o.waiting_requests, QUEUE_TARGET_PER_POD, *bounds), pod, arrivals, initial, args)
    static = smallest_static(pod, arrivals, ours.attainment, args)
    runs = {"queue only": queue, "static": static, "KV usage only": pressure, "ours": ours}  # ours drawn on top
    plot(args.plot, rates, pod, runs, arrivals, args)
    recovery_s = args.burst_minutes * 60 + RECOVERY_S
    calm = [not any(b <= k * args.interval_s < b + recovery_s for b in bursts) for k in range(len(arrivals))]
    return {
        "slo_attainment": round(ours.attainment, 4),
        "slo_attainment_outside_bursts": round(sum(itertools.compress(ours.good, calm))
                                               / max(1, sum(itertools.compress(arrivals, calm))), 4),
        "replica_hours": round(ours.replica_hours, 1),
        "replica_hours_vs_static": round(ours.replica_hours / static.replica_hours, 3),
        "num_scale_events": ours.num_scale_events,
        "max_replicas_used": max(ours.replicas),
        "static_replicas": static.replicas[0],
        "slo_attainment_static": round(static.attainment, 4),
        "replica_hours_static": round(static.replica_hours, 1),
        "slo_attainment_pressure_only": round(pressure.attainment, 4),
        "replica_hours_pressure_only": round(pressure.replica_hours, 1),
        "num_scale_events_pressure_only": pressure.num_scale_events,
        "slo_attainment_queue_only": round(queue.attainment, 4),
        "replica_hours_queue_only": round(queue.replica_hours, 1),
        "num_scale_events_queue_only": queue.num_scale_events,
        "startup_s": args.startup_s,
        "interval_s": args.interval_s,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "policy": dataclasses.asdict(policy),
        "calibration": pod.calibration(),
        "trace": {"hours": args.hours, "peak_rps": round(peak_rps, 3), "peak_pods": args.peak_pods,
                  "num_requests": sum(arrivals), "bursts_start_h": [round(b / 3600, 2) for b in bursts],
                  "burst_factor": args.burst_factor, "burst_minutes": args.burst_minutes, "seed": args.seed},
        "plot": str(args.plot),
    }


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
