"""Recovery's hard paths, through real processes with no supervisor (`SplitPod`): a sidecar that stays away past
`--recovery-timeout` and returns later, the executor killed while sequences are swapped out to its CPU pool, and
a second fault while the frontend is still re-synchronising after a first. Each test has its own stack, so none
depends on another's order or leftovers; the block manager checks every invariant after each call."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from polling import wait_for
from stack_testing import PROMPTS, SplitPod

from pagedserve.protos import executor_pb2 as ex_pb
from pagedserve.protos import executor_pb2_grpc as ex_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
RECOVERIES = "pagedserve_sidecar_recoveries_total"
RECOVERY_TIMEOUT_S = 3.0
# how late past --recovery-timeout a request may end: resync attempts every 0.5 s, each bounded by the step timeout
# (2 s), plus a loaded CI machine's scheduling
GRACE_S = 15.0
MAX_TOKENS = 100


@pytest.fixture
def start_pod(tiny_chat_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., SplitPod]]:
    """Starts the test's own stack (SplitPod's options), stopped when the test ends however it ends."""
    started: list[SplitPod] = []

    def start(**options: Any) -> SplitPod:
        started.append(SplitPod(tiny_chat_model_dir, tmp_path, **options))
        return started[-1]

    yield start
    for pod in started:
        pod.stop()


def streamed_together(pod: SplitPod) -> list[list[int]]:
    """Every prompt's greedy tokens, streamed at once without a fault (what a faulted run must equal)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return [f.result() for f in pod.streams(pool, PROMPTS, MAX_TOKENS)]


def http_completion(pod: SplitPod, prompt: str) -> tuple[int, dict[str, str]]:
    """An HTTP completion's status and error object (empty when it succeeded)."""
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{pod.http}/v1/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=GRACE_S) as reply:
            return reply.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


def test_a_sidecar_that_never_comes_back_fails_requests_then_serves_when_it_returns(
    start_pod: Callable[..., SplitPod]
) -> None:
    """The executor killed for good: its requests end UNAVAILABLE past --recovery-timeout, new ones are refused at
    once naming it, and health says so on both doors; started again much later, it is taken back."""
    pod = start_pod(recovery_timeout=RECOVERY_TIMEOUT_S)
    expected = pod.stream(PROMPTS[0], MAX_TOKENS)
    recoveries = pod.metric(RECOVERIES)
    with ThreadPoolExecutor(2) as pool:
        # each call's own deadline is the bound: past it the call would end DEADLINE_EXCEEDED, not UNAVAILABLE
        in_flight = pod.streams(pool, PROMPTS[:2], 400, timeout=RECOVERY_TIMEOUT_S + GRACE_S)
        pod.wait_chunks(pod.chunks + 2)
        pod.kill("executor")
        pod.wait_health(NOT_SERVING)  # at the loss, well before the timeout
        assert pod.http_health() == 503
        for future in in_flight:
            with pytest.raises(grpc.RpcError) as lost:
                future.result()
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE, lost.value.details()
            assert f"--recovery-timeout {RECOVERY_TIMEOUT_S:g}" in (lost.value.details() or "")
    # refused at once (a request that queued would reach its 5 s deadline), saying why and which sidecar
    with pytest.raises(grpc.RpcError) as refused:
        pod.stream(PROMPTS[1], 4, timeout=5)
    reason = refused.value.details() or ""
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, reason
    assert reason.startswith("the executor has not answered for "), reason
    status, error = http_completion(pod, PROMPTS[1])
    assert status == 503 and error["message"] == reason, error
    assert pod.health() == NOT_SERVING and pod.http_health() == 503
    pod.start("executor")  # back, long after the timeout: the frontend still tries, and resumes
    pod.wait_health(SERVING)
    assert pod.http_health() == 200
    assert pod.stream(PROMPTS[0], MAX_TOKENS) == expected
    assert pod.metric(RECOVERIES) == recoveries + 1
    pod.assert_idle_and_whole()


def test_the_executor_killed_while_sequences_are_swapped_out_costs_no_tokens(
    start_pod: Callable[..., SplitPod]
) -> None:
    """Five streams of ~30 blocks each on 48 blocks: some are swapped out to the CPU pool. Their KV there dies
    with the executor; they are recomputed from their tokens like the rest."""
    pod = start_pod(num_blocks=48, executor_extra=["--cpu-swap-mib", "1"], frontend_extra=["--preemption-mode", "swap"])
    expected = streamed_together(pod)
    assert pod.status().num_preemptions_swap > 0  # the reference ran with swapping too
    recoveries = pod.metric(RECOVERIES)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = pod.streams(pool, PROMPTS, MAX_TOKENS)
        swapped = kill_the_executor_while_swapped(pod)
        pod.start("executor")
        results = [f.result() for f in futures]
    assert swapped > 0 and results == expected
    assert pod.metric(RECOVERIES) == recoveries + 1
    pod.assert_idle_and_whole()


def kill_the_executor_while_swapped(pod: SplitPod, tries: int = 20) -> int:
    """Stops the executor (SIGSTOP) at a moment the frontend reports swapped sequences, and kills it (-9) if it
    still does once stopped (else lets it go on and tries again). A stopped executor answers no step, so the
    frontend's state can move at most by a step already answered; the swapped sequences' KV is in the executor's
    CPU pool either way (a swap-in planned since is one of the steps the kill voids). Returns how many were swapped."""
    pid = pod.executor.proc.pid
    for _ in range(tries):
        wait_for(lambda: pod.status().num_swapped > 0, "a sequence is swapped out", poll_s=0.005)
        os.kill(pid, signal.SIGSTOP)
        swapped = pod.status().num_swapped
        if swapped > 0:
            pod.kill("executor")
            return swapped
        os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"no sequence stayed swapped out across {tries} stops of the executor")


def test_a_second_fault_during_a_recovery_is_recovered_too(start_pod: Callable[..., SplitPod]) -> None:
    """The block manager is killed and stays away; while the frontend re-synchronises (its executor Resets
    succeed, its block manager Resets fail), the executor is killed as well. The block manager returns first,
    then the executor: one recovery, and every stream as without a fault."""
    pod = start_pod()
    expected = streamed_together(pod)
    recoveries = pod.metric(RECOVERIES)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = pod.streams(pool, PROMPTS, MAX_TOKENS)
        pod.wait_chunks(pod.chunks + len(PROMPTS))
        pod.kill("block_manager")
        pod.wait_health(NOT_SERVING)
        wait_for(lambda: pod.status().num_waiting > 0, "the cut streams wait to be recomputed")
        epoch = executor_epoch(pod)  # the frontend's attempts reset the executor to new epochs meanwhile
        wait_for(lambda: executor_epoch(pod) != epoch, "the frontend re-synchronises (a new executor epoch)")
        pod.kill("executor")
        pod.start("block_manager")
        assert pod.health() == NOT_SERVING  # one sidecar back is not enough
        pod.start("executor")
        results = [f.result() for f in futures]
    assert results == expected
    assert pod.metric(RECOVERIES) == recoveries + 1
    pod.assert_idle_and_whole()


def executor_epoch(pod: SplitPod) -> int:
    with grpc.insecure_channel(pod.executor.address) as channel:
        return ex_grpc.ExecutorStub(channel).Info(ex_pb.InfoRequest(), timeout=10).epoch  # type: ignore[no-any-return]

