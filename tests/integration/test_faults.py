"""Sidecar faults under load, through real processes: the frontend rides out an executor or block manager that
is killed (-9) or stopped (SIGSTOP past the step deadline) and comes back, and refuses one that comes back
with another cache. Clients see latency, not errors; streamed tokens are never repeated or skipped; greedy
outputs equal a run without the fault; the block manager checks every invariant after each call
(`--check-integrity`) and holds no block once the streams are done. One stack serves the module; each test
starts from a whole one (checked, or replaced after a failure), in any order. The hard paths (a sidecar gone past
the recovery timeout, a kill while sequences are swapped out, a second fault during a recovery) have a stack
each, in test_recovery_hard_paths.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import wait_for
from stack_testing import PROMPTS, SplitPod

NUM_BLOCKS = 256
MAX_TOKENS = 200
STEP_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def shared_pods(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SplitPod]]:
    """The module's stack (at most one at a time), stopped at the end."""
    pods: list[SplitPod] = []
    yield pods
    for pod in pods:
        pod.stop()


def is_whole(pod: SplitPod) -> bool:
    """All three processes up, nothing held, serving: as every test here leaves the stack when it passes."""
    if any(s.proc.poll() is not None for s in (pod.executor, pod.block_manager, pod.frontend)):
        return False
    try:
        pod.assert_idle_and_whole()
    except (AssertionError, grpc.RpcError):
        return False
    return True


@pytest.fixture
def pod(shared_pods: list[SplitPod], tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SplitPod:
    """The module's stack, checked whole before each test, so that the tests run in any order; one that a failed
    test left otherwise is replaced by a fresh one (a failure does not fail the tests after it)."""
    if shared_pods and not is_whole(shared_pods[-1]):
        shared_pods.pop().stop()
    if not shared_pods:
        shared_pods.append(SplitPod(tiny_chat_model_dir, tmp_path_factory.mktemp("pod"), num_blocks=NUM_BLOCKS,
                                    step_timeout=STEP_TIMEOUT_S))
    return shared_pods[-1]


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    return {}


@pytest.fixture
def expected(pod: SplitPod, references: dict[str, list[list[int]]]) -> list[list[int]]:
    """Every prompt's greedy tokens, streamed without a fault (all at once, as under the faults); the same for
    any stack of this module, so streamed once."""
    if "streams" not in references:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            references["streams"] = [f.result() for f in pod.streams(pool, PROMPTS, MAX_TOKENS)]
    return references["streams"]


def under_faults(pod: SplitPod, fault: Callable[[], None], times: int) -> list[list[int]]:
    """The prompts streamed at once while `fault` strikes `times` times, each after some progress."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = pod.streams(pool, PROMPTS, MAX_TOKENS)
        for _ in range(times):
            pod.wait_chunks(pod.chunks + len(PROMPTS))  # mid-stream: every stream is under way
            fault()
        return [f.result() for f in futures]


@pytest.mark.parametrize("component", ["executor", "block_manager"])
def test_a_sidecar_killed_mid_stream_three_times_costs_latency_not_tokens(
    pod: SplitPod, expected: list[list[int]], component: str
) -> None:
    assert all(len(tokens) == MAX_TOKENS for tokens in expected)
    recoveries = pod.metric("pagedserve_sidecar_recoveries_total")
    results = under_faults(pod, lambda: pod.restart(component), times=3)
    assert results == expected  # not one token repeated, skipped or different
    pod.assert_idle_and_whole()
    assert pod.metric("pagedserve_sidecar_recoveries_total") == recoveries + 3  # each kill was noticed, mid-stream


def test_a_block_manager_restarted_between_two_steps_is_noticed_and_recovered(
    pod: SplitPod, expected: list[list[int]]
) -> None:
    """The frontend is paused while its block manager restarts, so no call fails on the way: the next Step
    reaches a block manager that knows none of its sequences. Asked, it is another process: a loss."""
    recoveries = pod.metric("pagedserve_sidecar_recoveries_total")

    def restart_behind_the_frontends_back() -> None:
        os.kill(pod.frontend.proc.pid, signal.SIGSTOP)
        try:
            pod.restart("block_manager")
        finally:
            os.kill(pod.frontend.proc.pid, signal.SIGCONT)

    assert under_faults(pod, restart_behind_the_frontends_back, times=1) == expected
    pod.assert_idle_and_whole()
    assert pod.metric("pagedserve_sidecar_recoveries_total") == recoveries + 1


@pytest.mark.parametrize("component", ["executor", "block_manager"])
def test_a_sidecar_restarted_while_idle_is_recovered_once(
    pod: SplitPod, expected: list[list[int]], component: str
) -> None:
    """The idle frontend's probe notices the restart and re-synchronises; the next request then runs on a new
    step stream, not on the one that led to the process that is gone (which would fail it: a second loss)."""
    recoveries = pod.metric("pagedserve_sidecar_recoveries_total")
    pod.restart(component)
    wait_for(lambda: pod.metric("pagedserve_sidecar_recoveries_total") > recoveries, "the restart is noticed", 60)
    pod.wait_health(health_pb2.HealthCheckResponse.SERVING)
    assert pod.stream(PROMPTS[0], MAX_TOKENS) == expected[0]
    assert pod.metric("pagedserve_sidecar_recoveries_total") == recoveries + 1
    pod.assert_idle_and_whole()


def test_an_executor_stopped_past_the_step_deadline_is_waited_for(pod: SplitPod, expected: list[list[int]]) -> None:
    def stop_then_continue() -> None:
        os.kill(pod.executor.proc.pid, signal.SIGSTOP)
        try:
            pod.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING, timeout=STEP_TIMEOUT_S * 10)
        finally:
            os.kill(pod.executor.proc.pid, signal.SIGCONT)
        pod.wait_health(health_pb2.HealthCheckResponse.SERVING)

    assert under_faults(pod, stop_then_continue, times=1) == expected
    pod.assert_idle_and_whole()


def test_an_executor_back_with_another_cache_is_refused_until_the_right_one_returns(
    pod: SplitPod, expected: list[list[int]]
) -> None:
    pod.restart("executor", "--num-blocks", str(NUM_BLOCKS // 2))  # argparse: the last --num-blocks wins
    pod.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(grpc.RpcError) as refused:
        pod.stream(PROMPTS[0], MAX_TOKENS)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "num_blocks 256 -> 128" in (refused.value.details() or ""), refused.value.details()
    pod.restart("executor")
    pod.wait_health(health_pb2.HealthCheckResponse.SERVING)
    assert pod.stream(PROMPTS[0], MAX_TOKENS) == expected[0]
    pod.assert_idle_and_whole()


def test_a_frontend_killed_mid_stream_fails_its_streams_fast_and_restarts_clean(
    pod: SplitPod, expected: list[list[int]]
) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = pod.streams(pool, PROMPTS, MAX_TOKENS)
        pod.wait_chunks(pod.chunks + len(PROMPTS))
        pod.restart("frontend")  # the sidecars keep running: the new frontend resets them (a new epoch)
        for future in futures:
            with pytest.raises(grpc.RpcError) as lost:
                future.result()
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    assert pod.stream(PROMPTS[1], MAX_TOKENS) == expected[1]
    pod.assert_idle_and_whole()


# A supervisor (as `pagedserve serve` or `LLM` is) that starts a block manager, prints its PID and waits.
SUPERVISOR = """
import sys, time
from pagedserve.services.common.processes import start_service
service = start_service(["block-manager", "--num-blocks", "8"], listen=sys.argv[1])
print(service.proc.pid, flush=True)
time.sleep(3600)
"""


def _gone(pid: int) -> bool:
    """The process has exited: no longer listed, or a zombie its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_service_whose_supervisor_is_killed_stops_by_itself(tmp_path: Path) -> None:
    listen = f"unix:{tmp_path}/block-manager.sock"
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, listen], stdout=subprocess.PIPE, text=True)
    assert supervisor.stdout is not None
    child = int(supervisor.stdout.readline())
    try:
        time.sleep(2.5)  # past a few of the child's 1 s looks at its parent: while it lives, the child serves
        with grpc.insecure_channel(listen) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        supervisor.kill()  # -9: no finalizer, no atexit, nothing stops the child on the supervisor's side
        supervisor.wait()
        wait_for(lambda: _gone(child), "the orphaned block manager stops", timeout=30)
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)  # our own grandchild, by its PID
