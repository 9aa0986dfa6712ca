"""The scaling policy: examples that pin reasons and numbers, then properties over drawn windows and a
closed loop (constant load, decisions applied) that must settle without reversing direction."""

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.operator.policy import Decision, Observation, ScalingPolicy, decide

NOW = 10_000.0
POLICY = ScalingPolicy(target_block_pressure=0.7, scale_up_max_step=2, cooldown_s=60.0)


def obs(time: float = NOW, pods: int = 2, pressure: float = 0.5, scraped: int | None = None, waiting: int = 0,
        goodput: float = 10.0, finished: float = 10.0, hottest: float | None = None) -> Observation:
    scraped = pods if scraped is None else scraped
    total = 1000 * scraped
    used = round(pressure * total)
    return Observation(time=time, num_pods=pods, num_scraped=scraped, used_blocks=used, total_blocks=total,
                       max_pod_pressure=pressure if hottest is None else hottest, goodput_rps=goodput,
                       finished_rps=finished, waiting_requests=waiting, preemptions_per_s=0.0)


def steady(pods: int, pressure: float, span: float = 300.0, step: float = 15.0) -> list[Observation]:
    """Observations every `step` seconds covering the last `span` seconds up to NOW."""
    return [obs(NOW - span + i * step, pods, pressure) for i in range(int(span / step) + 1)]


def run(window: list[Observation], replicas: int, policy: ScalingPolicy = POLICY, lo: int = 1, hi: int = 10,
        last: float | None = None) -> Decision:
    return decide(window, replicas, lo, hi, policy, NOW, last)


# ---- examples -----------------------------------------------------------------------------------------


def test_from_spec_reads_camel_case_and_defaults_the_rest() -> None:
    assert ScalingPolicy.from_spec({}) == ScalingPolicy()
    spec = {"targetBlockPressure": 0.6, "targetSloAttainment": 0.99, "metricsWindowSeconds": 30, "tolerance": 0.2,
            "scaleUp": {"maxStep": 3, "stabilizationWindowSeconds": 45},
            "scaleDown": {"maxPercent": 25, "stabilizationWindowSeconds": 600}, "cooldownSeconds": 90}
    assert ScalingPolicy.from_spec(spec) == ScalingPolicy(0.6, 0.99, 30.0, 0.2, 3, 45.0, 25.0, 600.0, 90.0)
    assert ScalingPolicy.from_spec({"scaleUp": {"maxStep": 5}}).scale_up_max_step == 5
    assert ScalingPolicy.from_spec({"tolerance": None, "scaleUp": None}) == ScalingPolicy()
    with pytest.raises(ValueError, match="target_block_pressure"):
        ScalingPolicy.from_spec({"targetBlockPressure": 1.5})
    with pytest.raises(ValueError, match="scale_up_max_step"):
        ScalingPolicy(scale_up_max_step=0)
    assert ScalingPolicy().history_s == 300.0


def test_pressure_over_the_band_scales_up_to_the_target() -> None:
    decision = run([obs(pods=2, pressure=0.91)], 2)
    assert decision == Decision(3, "block pressure 0.91 > target 0.70 (x1.1): 2 -> 3", True, False)


def test_pressure_inside_the_band_holds() -> None:
    decision = run(steady(2, 0.76), 2)
    assert decision.replicas == 2 and not decision.limited
    assert decision.reason == ("block pressure 0.76 on 2 pods within target 0.70 (x1.1); not down: block pressure "
                               "0.76 on 2 pods would exceed 0.70 on one fewer: holding 2")


def test_the_step_bound_and_max_hold_back_a_big_ask() -> None:
    decision = run([obs(pods=4, pressure=1.0)], 4)  # wants ceil(4 / 0.7) = 6, step 2
    assert (decision.replicas, decision.limited) == (6, False)
    decision = run([obs(pods=6, pressure=1.0)], 6)  # wants 9, step 2 -> 8
    assert decision == Decision(8, "block pressure 1.00 > target 0.70 (x1.1): 6 -> 8 (step bound, 9 wanted)",
                                True, True)
    decision = run([obs(pods=9, pressure=1.0)], 9)  # wants 13, step 11, max 10
    assert decision.replicas == 10 and decision.limited
    assert decision.reason.endswith("9 -> 10 (step bound, 13 wanted; bounds [1, 10])")


def test_missed_slo_with_a_queue_adds_a_pod_even_at_low_pressure() -> None:
    window = [obs(NOW - 15, 4, 0.4, goodput=9.0, finished=10.0, waiting=3),
              obs(NOW, 4, 0.4, goodput=7.0, finished=10.0, waiting=3)]
    decision = run(window, 4)
    assert decision == Decision(5, "SLO attainment 0.80 < target 0.95 with 3 requests waiting: 4 -> 5", True, False)
    assert run([obs(pods=4, pressure=0.4, goodput=7.0, waiting=0)], 4).replicas == 4  # nobody waits: no pod


def test_a_hot_pod_with_a_queue_adds_a_pod() -> None:
    decision = run([obs(pods=4, pressure=0.5, hottest=0.95, waiting=2)], 4)
    assert decision.replicas == 5
    assert decision.reason == ("hottest pod's block pressure 0.95 > target 0.70 (x1.1) with 2 requests waiting: "
                               "4 -> 5")


def test_pods_still_starting_are_not_asked_for_twice() -> None:
    decision = run([obs(pods=2, pressure=0.95)], 3)  # 2 measured want ceil(2 * 0.95 / 0.7) = 3: on their way
    assert decision.replicas == 3 and decision.metrics_available
    assert "3 replicas (ready or starting) cover it" in decision.reason


def test_comfortable_window_scales_down_by_at_most_the_max_percent() -> None:
    decision = run(steady(10, 0.2), 10)  # demand 2 pods -> ceil(2 / 0.7) = 3; at most 50 % a step
    assert decision == Decision(
        5, "comfortable for 300s, peak demand 2.00 pods (pressure 0.20 on 10) fits 3 at target 0.70: 10 -> 5 "
        "(step bound, 3 wanted)", True, True)
    assert run(steady(5, 0.4), 5).replicas == 3  # demand 2 pods -> 3
    assert run(steady(5, 0.4), 5, lo=4).replicas == 4
    varied = steady(10, 0.2)
    varied[2] = obs(varied[2].time, 10, 0.35)  # demand 3.5 pods once: down to ceil(3.5 / 0.7) = 5, not 3
    assert run(varied, 10, ScalingPolicy(target_block_pressure=0.7, scale_down_max_percent=100)).replicas == 5


def test_scale_down_needs_the_whole_window_comfortable_and_covered() -> None:
    assert run(steady(10, 0.2), 10).replicas < 10
    hot_once = steady(10, 0.2)
    hot_once[1] = obs(hot_once[1].time, 10, 0.66)  # under the band, but 0.73 on 9 pods
    decision = run(hot_once, 10)
    assert decision.replicas == 10 and "pressure 0.66 on 10 pods would exceed 0.70 on one fewer" in decision.reason
    short = steady(10, 0.2, span=200)
    decision = run(short, 10)
    assert decision.replicas == 10 and "not covered" in decision.reason
    gappy = [o for o in steady(10, 0.2) if not NOW - 200 < o.time < NOW - 120]
    assert run(gappy, 10).replicas == 10
    queued = steady(10, 0.2)
    queued[-2] = obs(queued[-2].time, 10, 0.2, waiting=1)
    assert "1 requests waiting" in run(queued, 10).reason
    missed = steady(10, 0.2)
    missed[5] = obs(missed[5].time, 10, 0.2, goodput=8.0)
    assert run(missed, 10).replicas == 10
    partial = steady(10, 0.2)
    partial[4] = obs(partial[4].time, 10, 0.2, scraped=9)
    assert run(partial, 10).replicas == 10


def test_missing_stale_or_incomplete_metrics_hold_the_size() -> None:
    assert run([], 3) == Decision(3, "no metrics yet: holding 3", False, False)
    assert run([obs(NOW - 60, 3, 0.1)], 3) == Decision(
        3, "stale metrics (latest 60s old > 45s): holding 3", False, False)
    assert run([obs(NOW, 3, 0.99, scraped=2)], 3) == Decision(
        3, "incomplete metrics (2 of 3 pods scraped): holding 3", False, False)
    assert run([], 12) == Decision(10, "no metrics yet: holding 10; clamped to [1, 10]: 12 -> 10", False, False)


def test_cooldown_holds_changes_but_not_clamping() -> None:
    decision = run([obs(pods=2, pressure=0.91)], 2, last=NOW - 30)
    assert decision.replicas == 2 and decision.limited
    assert decision.reason == ("block pressure 0.91 > target 0.70 (x1.1), but in cooldown (30s since the last "
                               "change < 60s): holding 2")
    assert run([obs(pods=2, pressure=0.91)], 2, last=NOW - 60).replicas == 3
    assert run([obs(pods=2, pressure=0.91)], 2, lo=4, last=NOW - 1).replicas == 4


def test_up_stabilization_takes_the_lowest_ask_of_its_window() -> None:
    policy = ScalingPolicy(target_block_pressure=0.5, scale_up_stabilization_s=60.0, scale_up_max_step=10)
    window = [obs(NOW - 45, 4, 0.3), obs(NOW - 30, 4, 0.7), obs(NOW - 15, 4, 0.9), obs(NOW, 4, 1.0)]
    assert run(window, 4, policy).replicas == 4  # one quiet scrape within 60 s: no scale-up yet
    decision = run(window[1:], 4, policy)  # asks 6, 8, 8
    assert decision.replicas == 6 and "lowest ask over 60s: 6" in decision.reason


def test_bounds_must_make_sense() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        run([], 3, lo=5, hi=4)


# ---- properties ---------------------------------------------------------------------------------------

policies = st.builds(
    ScalingPolicy,
    target_block_pressure=st.floats(0.1, 1.0),
    target_slo_attainment=st.floats(0.5, 1.0),
    metrics_window_s=st.sampled_from([0.0, 30.0, 60.0]),
    tolerance=st.floats(0.0, 0.5),
    scale_up_max_step=st.integers(1, 10),
    scale_up_stabilization_s=st.sampled_from([0.0, 30.0, 60.0]),
    scale_down_max_percent=st.floats(1.0, 100.0),
    scale_down_stabilization_s=st.sampled_from([0.0, 60.0, 300.0]),
    cooldown_s=st.sampled_from([0.0, 15.0, 60.0]),
)


@st.composite
def observations(draw: st.DrawFn, time: float) -> Observation:
    pods = draw(st.integers(0, 12))
    scraped = draw(st.one_of(st.just(pods), st.integers(0, pods)))
    total = scraped * draw(st.integers(1, 1000))
    used = draw(st.integers(0, total))
    finished = draw(st.floats(0.0, 50.0))
    return Observation(time=time, num_pods=pods, num_scraped=scraped, used_blocks=used, total_blocks=total,
                       max_pod_pressure=draw(st.floats(used / total, 1.0)) if total else 0.0,
                       goodput_rps=draw(st.floats(0.0, finished)), finished_rps=finished,
                       waiting_requests=draw(st.one_of(st.just(0), st.integers(0, 20))), preemptions_per_s=0.0)


@st.composite
def windows(draw: st.DrawFn) -> list[Observation]:
    """Oldest first, ending `age` seconds before NOW, scrapes 1 to 60 s apart."""
    time = NOW - draw(st.floats(0.0, 90.0))
    window = []
    for gap in draw(st.lists(st.floats(1.0, 60.0), max_size=25)):
        window.append(draw(observations(time)))
        time -= gap
    return window[::-1]


@st.composite
def situations(draw: st.DrawFn) -> dict:
    lo = draw(st.integers(0, 10))
    return {"window": draw(windows()), "replicas": draw(st.integers(0, 30)), "min_replicas": lo,
            "max_replicas": draw(st.integers(lo, 30)), "policy": draw(policies), "now": NOW,
            "last_scale_time": draw(st.one_of(st.none(), st.floats(NOW - 200, NOW)))}


def clamp(situation: dict) -> int:
    return min(max(situation["replicas"], situation["min_replicas"]), situation["max_replicas"])


@given(situations())
def test_the_answer_is_always_within_bounds(situation: dict) -> None:
    decision = decide(**situation)
    assert situation["min_replicas"] <= decision.replicas <= situation["max_replicas"]
    assert decision.reason


@given(situations(), st.data())
def test_more_pressure_never_means_fewer_replicas(situation: dict, data: st.DataObject) -> None:
    hotter = []
    for o in situation["window"]:
        used = data.draw(st.integers(o.used_blocks, o.total_blocks))
        hottest = data.draw(st.floats(max(o.max_pod_pressure, used / o.total_blocks if o.total_blocks else 0.0), 1.0))
        hotter.append(Observation(o.time, o.num_pods, o.num_scraped, used, o.total_blocks, hottest, o.goodput_rps,
                                  o.finished_rps, o.waiting_requests, o.preemptions_per_s))
    assert decide(**{**situation, "window": hotter}).replicas >= decide(**situation).replicas


@given(situations(), st.sampled_from(["empty", "stale", "incomplete"]))
def test_without_fresh_complete_data_only_the_bounds_move_the_size(situation: dict, fault: str) -> None:
    window = situation["window"]
    if fault == "empty" or not window:
        window = []
    elif fault == "stale":
        window = [o for o in window if o.time < NOW - 45.5] or [obs(NOW - 50)]
    else:
        latest = window[-1]
        window = [*window[:-1], obs(latest.time, pods=max(1, latest.num_pods), pressure=0.0, scraped=0)]
    decision = decide(**{**situation, "window": window})
    assert decision.replicas == clamp(situation)
    assert not decision.metrics_available and not decision.limited


@given(situations(), st.floats(1.0, 300.0), st.floats(0.0, 0.999))
def test_no_change_but_clamping_inside_the_cooldown(situation: dict, cooldown_s: float, share: float) -> None:
    policy = dataclasses.replace(situation["policy"], cooldown_s=cooldown_s)
    decision = decide(**{**situation, "policy": policy, "last_scale_time": NOW - share * cooldown_s})
    assert decision.replicas == clamp(situation)


BLOCKS_PER_POD, BLOCKS_PER_REQUEST, INTERVAL_S = 1000, 100, 15.0


def closed_loop_observation(time: float, pods: int, load_blocks: float) -> Observation:
    """`load_blocks` spread evenly over `pods`; past their capacity requests wait and half miss the SLO."""
    capacity = pods * BLOCKS_PER_POD
    saturated = load_blocks > capacity
    waiting = math.ceil((load_blocks - capacity) / BLOCKS_PER_REQUEST) if saturated else 0
    used = round(min(load_blocks, capacity))
    finished = 2.0 * pods
    return Observation(time, pods, pods, used, capacity, used / capacity, finished / 2 if saturated else finished,
                       finished, waiting, 0.0)


@settings(max_examples=60, deadline=None)
@given(policies, st.floats(0.05, 30.0), st.integers(1, 5), st.integers(0, 35), st.integers(1, 40))
def test_constant_load_settles_without_reversing(policy: ScalingPolicy, load_pods: float, lo: int, extra: int,
                                                 start: int) -> None:
    hi = lo + extra
    pods, load = min(max(start, lo), hi), load_pods * BLOCKS_PER_POD
    window: list[Observation] = []
    last_change: float | None = None
    sizes = [pods]
    for step in range(500):
        now = step * INTERVAL_S
        window = [o for o in window if o.time >= now - policy.history_s - INTERVAL_S]
        window.append(closed_loop_observation(now, pods, load))
        decision = decide(window, pods, lo, hi, policy, now, last_change)
        if decision.replicas != pods:
            last_change, pods = now, decision.replicas
        sizes.append(pods)
    moves = [b - a for a, b in itertools.pairwise(sizes) if b != a]
    assert all(m > 0 for m in moves) or all(m < 0 for m in moves), f"direction reversed: {sizes}"
    assert sizes[-100:] == [pods] * 100, "not settled"
    final = closed_loop_observation(0.0, pods, load)
    band = policy.target_block_pressure * (1 + policy.tolerance)
    assert pods == hi or final.block_pressure <= band + 1e-9  # settled under the band, or capped
    assert pods == lo or load / ((pods - 1) * BLOCKS_PER_POD) > policy.target_block_pressure - 1e-9
