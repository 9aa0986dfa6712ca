"""A pod under test, and a client for it on loopback: `Pod` is `pagedserve serve` as a real subprocess (its
supervisor restarts what dies); `SplitPod` is the three components as separate processes with no supervisor, so
that a test can kill each, keep it away, and start it again on its socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.protos import block_manager_pb2 as bm_pb
from pagedserve.protos import block_manager_pb2_grpc as bm_grpc
from pagedserve.protos import executor_pb2 as ex_pb
from pagedserve.protos import executor_pb2_grpc as ex_grpc
from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.services.common.processes import ServiceProcess, start_service, stop_service, wait_serving

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "List three colors:", "The quick brown fox jumps over the lazy dog. " * 3]


class Pod:
    """With `credentials`, the pod's clients (and the wait for SERVING) use TLS; `metadata` goes with every
    call of `generate` and `status` (an API key)."""

    def __init__(self, model: Path, *extra: str, env: dict[str, str] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.extra = extra
        self.metadata = list(metadata)
        self.address = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "pagedserve", "serve", "--model", str(model), "--port",
               self.address.rsplit(":", 1)[1], "--device", "cpu", "--block-size", "4", "--status-interval", "0.2",
               *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        # read as it comes: `serve` echoes its children's logs, and a full pipe would stall them all
        self.output: list[str] = []
        self._reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)  # type: ignore
        self._reader.start()
        try:
            wait_serving(self.address, 300, self.proc, credentials)  # type: ignore[arg-type]
        except (RuntimeError, TimeoutError) as error:
            self.proc.kill()
            self._reader.join(timeout=10)
            raise RuntimeError(f"{error}; the pod's log:\n{''.join(self.output)}") from error
        self.channel = (grpc.insecure_channel(self.address) if credentials is None
                        else grpc.secure_channel(self.address, credentials))
        self.stub = pb_grpc.InferenceStub(self.channel)

    def generate(self, prompt: str, **params: object) -> tuple[list[pb.GenerateResponse], dict[int, str]]:
        request = pb.GenerateRequest(text=prompt, params=pb.GenerationParameters(**params))  # type: ignore[arg-type]
        chunks = list(self.stub.Generate(request, timeout=120, metadata=self.metadata))
        texts: dict[int, str] = {}
        for chunk in chunks:
            texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
        return chunks, texts

    def status(self) -> pb.StatusResponse:
        return self.stub.Status(pb.StatusRequest(), timeout=10, metadata=self.metadata)

    def wait_idle(self) -> pb.StatusResponse:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = self.status()
            if status.num_running == status.num_waiting == status.num_used_blocks == 0:
                return status
            time.sleep(0.05)
        raise AssertionError(f"the pod is not idle: {self.status()}")

    def stop(self) -> str:
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self._reader.join(timeout=10)
        return "".join(self.output)


class SplitPod:
    """The executor, the block manager (checking every invariant after each call) and the frontend (with its
    metrics and HTTP ports), started at once as a pod's containers are: the block manager takes its geometry
    from the executor, the frontend waits for both. `kill` leaves a component dead until `start` (the block
    manager then with the executor's numbers, as `serve` starts it); `restart` is both."""

    def __init__(self, model: Path, run_dir: Path, *, num_blocks: int = 256, executor_extra: Sequence[str] = (),
                 frontend_extra: Sequence[str] = (), recovery_timeout: float = 60.0, step_timeout: float = 2.0) -> None:
        self.executor_args = ["executor", "--model", str(model), "--device", "cpu", "--block-size", "4",
                              "--num-blocks", str(num_blocks), "--threads", "1", *executor_extra]
        self.executor_listen = f"unix:{run_dir}/executor.sock"
        self.block_manager_listen = f"unix:{run_dir}/block-manager.sock"
        self.metrics_address, self.http = f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        self.frontend_args = [
            "frontend", "--executor", self.executor_listen, "--block-manager", self.block_manager_listen,
            "--model", str(model), "--step-timeout", str(step_timeout), "--recovery-timeout", str(recovery_timeout),
            "--metrics-listen", self.metrics_address, "--http-listen", self.http.removeprefix("http://"),
            *frontend_extra]
        self.frontend_listen = f"127.0.0.1:{free_port()}"
        with ThreadPoolExecutor(3) as pool:
            starts = [pool.submit(start_service, self.executor_args, self.executor_listen),
                      pool.submit(start_service, ["block-manager", "--geometry-from", self.executor_listen,
                                                  "--check-integrity"], self.block_manager_listen),
                      pool.submit(start_service, self.frontend_args, self.frontend_listen)]
        started = [f.result() for f in starts if f.exception() is None]
        if len(started) < len(starts):
            for service in started:
                stop_service(service)
            next(f.result() for f in starts if f.exception() is not None)  # raises the first failure
        self.executor, self.block_manager, self.frontend = started
        with grpc.insecure_channel(self.executor.address) as channel:
            info = ex_grpc.ExecutorStub(channel).Info(ex_pb.InfoRequest(), timeout=30)
        self.block_manager_args = ["block-manager", "--num-blocks", str(info.num_blocks), "--block-size",
                                   str(info.block_size), "--cpu-blocks", str(info.num_cpu_blocks), "--check-integrity"]
        self.channel = grpc.insecure_channel(self.frontend.address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.chunks = 0  # streamed chunks so far, over every stream
        self.lock = threading.Lock()

    def kill(self, name: str) -> None:
        """Kills the component (-9) if it still runs; nothing starts it again until `start`."""
        service: ServiceProcess = getattr(self, name)
        service.proc.kill()
        service.proc.wait()

    def start(self, name: str, *extra: str) -> None:
        """Starts the component (dead: `kill`) again on its socket with its arguments and `extra`."""
        assert getattr(self, name).proc.poll() is not None, f"the {name} still runs"
        args, listen = getattr(self, f"{name}_args"), getattr(self, f"{name}_listen")
        setattr(self, name, start_service([*args, *extra], listen))

    def restart(self, name: str, *extra: str) -> None:
        self.kill(name)
        self.start(name, *extra)

    def stream(self, prompt: str, max_tokens: int, timeout: float = 300) -> list[int]:
        """One greedy streaming request's tokens, in the order its chunks carried them (a chunk may carry
        several: a client that falls behind gets the steps queued for it joined into one)."""
        request = pb.GenerateRequest(text=prompt, params=pb.GenerationParameters(max_tokens=max_tokens,
                                                                                   ignore_eos=True))
        tokens: list[int] = []
        for chunk in self.stub.Generate(request, timeout=timeout):
            tokens += chunk.token_ids
            with self.lock:
                self.chunks += 1
        return tokens

    def streams(self, pool: ThreadPoolExecutor, prompts: Sequence[str], max_tokens: int,
                timeout: float = 300) -> list[Future[list[int]]]:
        return [pool.submit(self.stream, p, max_tokens, timeout) for p in prompts]

    def wait_chunks(self, more_than: int, timeout: float = 120) -> None:
        wait_for(lambda: self.chunks > more_than, f"more than {more_than} chunks streamed", timeout, poll_s=0.005)

    def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status  # type: ignore[no-any-return]

    def wait_health(self, status: int, timeout: float = 60) -> None:
        wait_for(lambda: self.health() == status, f"health {status}", timeout, poll_s=0.02)

    def http_health(self) -> int:
        """The status code of the HTTP API's /health."""
        try:
            with urllib.request.urlopen(f"{self.http}/health", timeout=10) as reply:
                return reply.status  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            return exc.code

    def used_blocks(self) -> int:
        with grpc.insecure_channel(self.block_manager.address) as channel:
            stats = bm_grpc.BlockManagerStub(channel).Stats(bm_pb.StatsRequest(), timeout=10).stats
        return stats.num_used_blocks  # type: ignore[no-any-return]

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10) as reply:
            families = text_string_to_metric_families(reply.read().decode())
        return next(s.value for f in families for s in f.samples if s.name == name)

    def status(self) -> pb.StatusResponse:
        return self.stub.Status(pb.StatusRequest(), timeout=10)

    def assert_idle_and_whole(self) -> None:
        """Nothing held: the block manager (which checked its invariants after every call) and the frontend agree,
        and the frontend serves."""
        status = self.status()
        assert status.num_running == status.num_waiting == status.num_swapped == 0, status
        assert self.used_blocks() == 0 and status.num_used_blocks == 0
        assert self.health() == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        self.channel.close()
        for service in (self.frontend, self.block_manager, self.executor):
            stop_service(service)
