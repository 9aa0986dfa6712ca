"""`pagedserve bench overhead`: how much of the accelerator's time the frontend and the block manager cost.

The real frontend and the real block manager, each its own process talking gRPC as in a pod (the sidecar links on
unix sockets, the callers on TCP loopback), drive an executor stand-in (benchmarks/standin_executor.py) that holds
every step for a fixed time instead of running a model: it stands in for an accelerator that is busy that long, so
whatever else the wall time holds is the serving stack's own overhead. For each of 64 and 256 running sequences and
10 ms and 2 ms steps, that many unary requests (short prompts, EOS ignored; `--stream`: streaming ones, every chunk
read) run together, with overlapped steps (the default) and serial ones. Over the steps in which every sequence
decodes (the edges dropped), the overhead is 1 - (time the stand-in held steps) / (wall time from the first step's
start to the last's end). `gap_ms` is the mean gap between two steps, and `gap_waiting_for_frontend_ms` the part of
it before the next step had even arrived; the rest is the executor's own time between two steps. Keys:
`overhead_frac_<seqs>_<ms>ms` (overlapped) and `serial_overhead_frac_<seqs>_<ms>ms`; with them the CPU time the
frontend, the block manager and the stand-in spent per step (from /proc), and
`cpu_floor_overhead_frac_<seqs>_<ms>ms`: the least overhead the machine's `cores` allow that CPU, 1 - (time the
stand-in held steps) / (the three processes' CPU over the window / cores). Where the overhead is near its floor,
the machine's cores, not the design's waits, are the limit. A run's window is short (~0.2 s at 256 x 2 ms) and a
shared machine's hiccups move it: each case runs `--repeats` times (3 by default) and the run with the median overhead
is reported (every key of that one run), with every run's overhead, sorted, in `overhead_frac_<seqs>_<ms>ms_rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy

from ..protos import inference_pb2 as pb
from ..protos import inference_pb2_grpc as pb_grpc
from ..services.common.processes import ServiceProcess, start_service, stop_service, wait_serving
from ..services.frontend.public_options import non_negative_int, positive_int
from ..services.frontend.scheduler import SchedulerConfig
from .report import emit

PROMPT = "Count the waves: one, two, three,"
EDGE_STEPS = 5  # dropped at each end of the full-batch window: admission and the first finishes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--model", default="smollm2-135m", help="whose tokenizer the frontend loads")
    parser.add_argument("--seqs", default="64,256", help="comma-separated numbers of running sequences")
    parser.add_argument("--step-ms", default="10,2", help="comma-separated stand-in step times")
    parser.add_argument("--tokens", type=positive_int, default=160, help="new tokens per request")
    parser.add_argument("--modes", default="overlap,serial", help="overlap, serial or both")
    parser.add_argument("--stream", action="store_true", help="streaming callers (Generate, every chunk read by one"
                        " asyncio client) instead of unary ones; the keys end in _stream")
    parser.add_argument("--stream-interval", type=positive_int, default=1,
                        help="the frontend's --stream-interval (steps per chunk after the first)")
    parser.add_argument("--spare-lookahead", type=non_negative_int, default=SchedulerConfig.spare_lookahead,
                        help="the frontend's --spare-lookahead (0: no spare blocks, to compare)")
    parser.add_argument("--device", default="", help="run the real executor on this device (cuda) instead of the"
                        " stand-in; --step-ms is then ignored and the keys end in _real")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs of each case; the one with the median overhead is reported, every run's in _rounds")


def _start_stand_in(listen: str, args: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "pagedserve.benchmarks.standin_executor", "--listen", listen, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:  # the servers print "listening on ADDRESS" once bound
        if line.startswith("listening on"):
            wait_serving(listen, 120, proc)
            return proc
    raise RuntimeError(f"the executor stand-in exited with {proc.wait()}")


def measure(model: str, num_seqs: int, step_ms: float, tokens: int, overlap: bool, device: str = "",
            stream: bool = False, stream_interval: int = 1,
            spare_lookahead: int = SchedulerConfig.spare_lookahead) -> dict[str, Any]:
    """One run: the three processes, num_seqs requests at once, the stand-in's timeline read back."""
    num_blocks = num_seqs * (-(-(tokens + 32) // 16)) + 64
    with tempfile.TemporaryDirectory() as tmp:
        timeline_file = Path(tmp) / "timeline.json"
        # the sidecar links on unix sockets, as in a pod and under `pagedserve serve`
        executor_address, block_manager_address = f"unix:{tmp}/executor.sock", f"unix:{tmp}/block-manager.sock"
        stand_in = _start_stand_in(executor_address, [
            "--model", model, "--num-blocks", str(num_blocks), "--step-ms", str(step_ms),
            "--timeline", str(timeline_file), *(["--device", device] if device else [])])
        services: list[ServiceProcess] = []
        try:
            services.append(start_service(["block-manager", "--geometry-from", executor_address],
                                          listen=block_manager_address))
            frontend_args = ["frontend", "--block-manager", block_manager_address, "--executor", executor_address,
                             "--model", model, "--max-num-seqs", str(num_seqs),
                             "--max-num-batched-tokens", str(max(2048, num_seqs * 32)),
                             "--max-waiting-requests", str(num_seqs + 1), "--max-streams-per-tenant", str(num_seqs)]
            frontend_args += ["--stream-interval", str(stream_interval), "--spare-lookahead", str(spare_lookahead),
                              *([] if overlap else ["--no-overlap"])]
            services.append(start_service(frontend_args))
            params = pb.GenerationParameters(max_tokens=tokens, ignore_eos=True)
            request = pb.GenerateRequest(text=PROMPT, params=params)
            with CpuSampler([*(service.proc.pid for service in services), stand_in.pid]) as cpu:
                texts = (asyncio.run(_streamed(services[1].address, request, num_seqs)) if stream
                         else _unary(services[1].address, request, num_seqs))
        finally:
            for service in reversed(services):
                stop_service(service)
            stand_in.terminate()
            stand_in.wait(timeout=30)
        timeline = json.loads(timeline_file.read_text())
    full = [(start, end, arrived) for start, end, seqs, arrived in timeline if seqs == num_seqs][EDGE_STEPS:-EDGE_STEPS]
    if len(full) < 10:
        raise RuntimeError(f"only {len(full)} steps ran all {num_seqs} sequences: raise --tokens")
    busy = sum(end - start for start, end, _ in full)
    wall = full[-1][1] - full[0][0]
    # each gap between two steps: the part before the next step had arrived (the executor waited for the
    # frontend), and the rest (the executor's own time between two steps: its step thread and event loop)
    waiting = sum(max(0.0, min(start, arrived) - before[1]) for before, (start, _, arrived) in pairwise(full))
    block_manager_cpu, frontend_cpu, executor_cpu = cpu.between(full[0][0], full[-1][1])
    # the processes' CPU over the window cannot take less wall time than it does spread over every core
    cpu_wall = (block_manager_cpu + frontend_cpu + executor_cpu) / len(os.sched_getaffinity(0))
    return {"overhead_frac": round(1 - busy / wall, 4), "steps": len(full), "texts": sorted(texts),
            "cpu_floor_overhead_frac": round(max(0.0, 1 - busy / max(busy, cpu_wall)), 4),
            "gap_ms_mean": round((wall - busy) / (len(full) - 1) * 1000, 3),
            "gap_waiting_ms_mean": round(waiting / (len(full) - 1) * 1000, 3),
            "frontend_cpu_ms_per_step": round(frontend_cpu / (len(full) - 1) * 1000, 3),
            "block_manager_cpu_ms_per_step": round(block_manager_cpu / (len(full) - 1) * 1000, 3),
            "executor_cpu_ms_per_step": round(executor_cpu / (len(full) - 1) * 1000, 3)}


def _unary(address: str, request: pb.GenerateRequest, num_seqs: int) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        futures = [pb_grpc.InferenceStub(channel).Complete.future(request, timeout=600) for _ in range(num_seqs)]
        return {f.result().choices[0].text for f in futures}


async def _streamed(address: str, request: pb.GenerateRequest, num_seqs: int) -> set[str]:
    """Every request streamed, every chunk read (by one asyncio client, on one core of the machine measured)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one() -> str:
            return "".join([chunk.text async for chunk in stub.Generate(request, timeout=600)])

        return set(await asyncio.gather(*(one() for _ in range(num_seqs))))


class CpuSampler:
    """Samples processes' CPU time (user + system, all threads, from /proc) every 20 ms on a thread, so that
    the CPU spent within a window of the stand-in's timeline (same monotonic clock) can be read afterwards."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.samples = pids, [(time.perf_counter(), [_cpu_seconds(p) for p in pids])]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.samples.append((time.perf_counter(), [_cpu_seconds(p) for p in self.pids]))

    def between(self, start: float, end: float) -> list[float]:
        """CPU seconds of each process from start to end (linear between the samples around them)."""
        times = [t for t, _ in self.samples]
        return [float(numpy.interp(end, times, [c[i] for _, c in self.samples])
                      - numpy.interp(start, times, [c[i] for _, c in self.samples])) for i in range(len(self.pids))]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "executor": f"the real executor on {args.device}, each step timed" if args.device else
                    "a stand-in that holds each step for a fixed time (no model runs): it stands in for the"
                    " accelerator; the frontend and block manager are the real processes over gRPC",
        "tokens_per_request": args.tokens,
        "stream_interval": args.stream_interval,
        "spare_lookahead": args.spare_lookahead,
        "cores": len(os.sched_getaffinity(0)),
        "repeats": args.repeats,
    }
    texts: set[str] = set()
    step_times = [0.0] if args.device else [float(s) for s in args.step_ms.split(",")]
    for num_seqs in (int(s) for s in args.seqs.split(",")):
        for step_ms in step_times:
            for mode in args.modes.split(","):
                runs = sorted((measure(args.model, num_seqs, step_ms, args.tokens, mode == "overlap", args.device,
                                       args.stream, args.stream_interval, args.spare_lookahead)
                               for _ in range(args.repeats)), key=lambda r: r["overhead_frac"])
                run_ = runs[(len(runs) - 1) // 2]  # the median run (the lower one of an even count)
                name = (f"{num_seqs}_real" if args.device else f"{num_seqs}_{step_ms:g}ms") + ("_stream" if args.stream
                                                                                              else "")
                prefix = "" if mode == "overlap" else "serial_"
                result[f"{prefix}overhead_frac_{name}"] = run_["overhead_frac"]
                if args.repeats > 1:
                    result[f"{prefix}overhead_frac_{name}_rounds"] = [r["overhead_frac"] for r in runs]
                result[f"{prefix}cpu_floor_overhead_frac_{name}"] = run_["cpu_floor_overhead_frac"]
                result[f"{prefix}gap_ms_{name}"] = run_["gap_ms_mean"]
                result[f"{prefix}gap_waiting_for_frontend_ms_{name}"] = run_["gap_waiting_ms_mean"]
                result[f"{prefix}steps_{name}"] = run_["steps"]
                result[f"{prefix}frontend_cpu_ms_per_step_{name}"] = run_["frontend_cpu_ms_per_step"]
                result[f"{prefix}block_manager_cpu_ms_per_step_{name}"] = run_["block_manager_cpu_ms_per_step"]
                result[f"{prefix}executor_cpu_ms_per_step_{name}"] = run_["executor_cpu_ms_per_step"]
                texts.update(*(r["texts"] for r in runs))
    # the stand-in's token depends only on its position, a real model's greedy one on the (one) prompt: every
    # request of every run must read the same
    result["one_text_for_all_runs"] = len(texts) == 1
    return result


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
