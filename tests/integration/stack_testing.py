"""A pod under test: `pagedserve serve` as a real subprocess, and a client for it on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from polling import free_port

from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.services.common.processes import wait_serving

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
        wait_serving(self.address, 300, self.proc, credentials)  # type: ignore[arg-type]
        self.channel = (grpc.insecure_channel(self.address) if credentials is None
                        else grpc.secure_channel(self.address, credentials))
        self.stub = pb_grpc.InferenceStub(self.channel)

    def generate(self, prompt: str, **params: object) -> tuple[list[pb.GenerateResponse], dict[int, str]]:
        request = pb.GenerateRequest(text=prompt, params=pb.GenerationParameters(**params))  # type: ignore[arg-type]
        chunks = list(self.stub.Generate(request, timeout=120, metadata=self.metadata))
        texts: dict[int, str] = {}
        for chunk in chunks[:-1]:
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
        out, _ = self.proc.communicate(timeout=60)
        return out
