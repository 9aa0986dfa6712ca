"""Sidecar faults under load, through real processes: the frontend rides out an executor or block manager that
is killed (-9) or stopped (SIGSTOP past the step deadline) and comes back, and refuses one that comes back
with another cache. Clients see latency, not errors; streamed tokens are never repeated or skipped; greedy
outputs equal a run without the fault; the block manager checks every invariant after each call
(`--check-integrity`) and holds no block once the streams are done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families
from stack_testing import PROMPTS

from pagedserve.protos import block_manager_pb2 as bm_pb
from pagedserve.protos import block_manager_pb2_grpc as bm_grpc
from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.services.common.processes import ServiceProcess, start_service, stop_service

NUM_BLOCKS = 256
MAX_TOKENS = 200
STEP_TIMEOUT_S = 2.0


class Pod:
    """The three components started one by one, so that a test can kill and restart each on its socket."""

    def __init__(self, model: Path, run_dir: Path) -> None:
        self.executor_args = ["executor", "--model", str(model), "--device", "cpu", "--block-size", "4",
                              "--num-blocks", str(NUM_BLOCKS), "--threads", "1"]
        self.executor_listen = f"unix:{run_dir}/executor.sock"
        self.block_manager_args = ["block-manager", "--num-blocks", str(NUM_BLOCKS), "--block-size", "4",
                                   "--check-integrity"]
        self.block_manager_listen = f"unix:{run_dir}/block-manager.sock"
        self.metrics_address = f"127.0.0.1:{free_port()}"
        self.executor = start_service(self.executor_args, self.executor_listen)
        self.block_manager = start_service(self.block_manager_args, self.block_manager_listen)
        self.frontend_args = [
            "frontend", "--executor", self.executor.address, "--block-manager", self.block_manager.address,
            "--model", str(model), "--step-timeout", str(STEP_TIMEOUT_S), "--recovery-timeout", "60",
            "--metrics-listen", self.metrics_address]
        self.frontend_listen = f"127.0.0.1:{free_port()}"
        self.frontend = start_service(self.frontend_args, self.frontend_listen)
        self.channel = grpc.insecure_channel(self.frontend.address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.chunks = 0  # streamed chunks so far, over every stream
        self.lock = threading.Lock()

    def restart(self, name: str, *extra: str) -> None:
        """Kills the component (-9) if it still runs, and starts it again on its socket."""
        old: ServiceProcess = getattr(self, name)
        old.proc.kill()
        old.proc.wait()
        args, listen = getattr(self, f"{name}_args"), getattr(self, f"{name}_listen")
        setattr(self, name, start_service([*args, *extra], listen))

    def stream(self, prompt: str) -> list[int]:
        """One streaming request's tokens, checking that each chunk carries one new token."""
        request = pb.GenerateRequest(text=prompt, params=pb.GenerationParameters(max_tokens=MAX_TOKENS,
                                                                                   ignore_eos=True))
        tokens: list[int] = []
        for chunk in self.stub.Generate(request, timeout=300):
            tokens += chunk.token_ids
            with self.lock:
                self.chunks += 1
        return tokens

    def streams(self, pool: ThreadPoolExecutor) -> list[Future[list[int]]]:
        return [pool.submit(self.stream, p) for p in PROMPTS]

    def wait_chunks(self, more_than: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.chunks <= more_than:
            assert time.monotonic() < deadline, f"no progress past {more_than} chunks"
            time.sleep(0.005)

    def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status

    def wait_health(self, status: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != status:
            assert time.monotonic() < deadline, f"health never became {status}"
            time.sleep(0.02)

    def used_blocks(self) -> int:
        with grpc.insecure_channel(self.block_manager.address) as channel:
            return bm_grpc.BlockManagerStub(channel).Stats(bm_pb.StatsRequest(), timeout=10).stats.num_used_blocks

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as reply:
            families = text_string_to_metric_families(reply.read().decode())
        return next(s.value for f in families for s in f.samples if s.name == name)

    def status(self) -> pb.StatusResponse:
        return self.stub.Status(pb.StatusRequest(), timeout=10)

    def stop(self) -> None:
        self.channel.close()
        for service in (self.frontend, self.block_manager, self.executor):
            stop_service(service)


@pytest.fixture(scope="module")
def pod(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    pod = Pod(tiny_chat_model_dir, tmp_path_factory.mktemp("pod"))
    yield pod
    pod.stop()


@pytest.fixture(scope="module")
def expected(pod: Pod) -> list[list[int]]:
    """Every prompt's greedy tokens, streamed without a fault (all at once, as under the faults)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return [f.result() for f in pod.streams(pool)]


def assert_idle_and_whole(pod: Pod) -> None:
    """Nothing held: the block manager (which checked its invariants after every call) and the frontend agree."""
    status = pod.status()
    assert status.num_running == status.num_waiting == 0
    assert pod.used_blocks() == 0 and status.num_used_blocks == 0
    assert pod.health() == health_pb2.HealthCheckResponse.SERVING


def under_faults(pod: Pod, fault: Callable[[], None], times: int) -> list[list[int]]:
    """The prompts streamed at once while `fault` strikes `times` times, each after some progress."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = pod.streams(pool)
        for _ in range(times):
            pod.wait_chunks(pod.chunks + len(PROMPTS))  # mid-stream: every stream is under way
            fault()
        return [f.result() for f in futures]


@pytest.mark.parametrize("component", ["executor", "block_manager"])
def test_a_sidecar_killed_mid_stream_three_times_costs_latency_not_tokens(
    pod: Pod, expected: list[list[int]], component: str
) -> None:
    assert all(len(tokens) == MAX_TOKENS for tokens in expected)
    recoveries = pod.metric("pagedserve_sidecar_recoveries_total")
    results = under_faults(pod, lambda: pod.restart(component), times=3)
    assert results == expected  # not one token repeated, skipped or different
    assert_idle_and_whole(pod)
    assert pod.metric("pagedserve_sidecar_recoveries_total") == recoveries + 3  # each kill was noticed, mid-stream


def test_a_block_manager_restarted_between_two_steps_is_noticed_and_recovered(
    pod: Pod, expected: list[list[int]]
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
    assert_idle_and_whole(pod)
    assert pod.metric("pagedserve_sidecar_recoveries_total") == recoveries + 1


@pytest.mark.parametrize("component", ["executor", "block_manager"])
def test_a_sidecar_restarted_while_idle_is_recovered_once(pod: Pod, expected: list[list[int]], component: str) -> None:
    """The idle frontend's probe notices the restart and re-synchronises; the next request then runs on a new
    step stream, not on the one that led to the process that is gone (which would fail it: a second loss)."""
    recoveries = pod.metric("pagedserve_sidecar_recoveries_total")
    pod.restart(component)
    deadline = time.monotonic() + 60
    while pod.metric("pagedserve_sidecar_recoveries_total") == recoveries:
        assert time.monotonic() < deadline, "the restart was never noticed"
        time.sleep(0.05)
    pod.wait_health(health_pb2.HealthCheckResponse.SERVING)
    assert pod.stream(PROMPTS[0]) == expected[0]
    assert pod.metric("pagedserve_sidecar_recoveries_total") == recoveries + 1
    assert_idle_and_whole(pod)


def test_an_executor_stopped_past_the_step_deadline_is_waited_for(pod: Pod, expected: list[list[int]]) -> None:
    def stop_then_continue() -> None:
        os.kill(pod.executor.proc.pid, signal.SIGSTOP)
        try:
            pod.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING, timeout=STEP_TIMEOUT_S * 10)
        finally:
            os.kill(pod.executor.proc.pid, signal.SIGCONT)
        pod.wait_health(health_pb2.HealthCheckResponse.SERVING)

    assert under_faults(pod, stop_then_continue, times=1) == expected
    assert_idle_and_whole(pod)


def test_an_executor_back_with_another_cache_is_refused_until_the_right_one_returns(
    pod: Pod, expected: list[list[int]]
) -> None:
    pod.restart("executor", "--num-blocks", str(NUM_BLOCKS // 2))  # argparse: the last --num-blocks wins
    pod.wait_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(grpc.RpcError) as refused:
        pod.stream(PROMPTS[0])
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "num_blocks 256 -> 128" in (refused.value.details() or ""), refused.value.details()
    pod.restart("executor")
    pod.wait_health(health_pb2.HealthCheckResponse.SERVING)
    assert pod.stream(PROMPTS[0]) == expected[0]
    assert_idle_and_whole(pod)


def test_a_frontend_killed_mid_stream_fails_its_streams_fast_and_restarts_clean(
    pod: Pod, expected: list[list[int]]
) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = pod.streams(pool)
        pod.wait_chunks(pod.chunks + len(PROMPTS))
        pod.restart("frontend")  # the sidecars keep running: the new frontend resets them (a new epoch)
        for future in futures:
            with pytest.raises(grpc.RpcError) as lost:
                future.result()
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    assert pod.stream(PROMPTS[1]) == expected[1]
    assert_idle_and_whole(pod)


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
