"""`bench fleet`'s real run: N `pagedserve serve` pods on this machine, a router per arm, the workload replayed
through each, and the router's overhead.

The pods share one cache-salt secret and a small KV budget each (fleet_arms.py's `Shape`); every tenant's requests carry
its API key, so the pods salt its prefix and the router, given the same secret, predicts it. The overhead: one short
request sent in turn through a kv-aware router, straight to the pod that router picked, and through
passthrough_proxy.py before that pod (a hop that forwards bytes and does nothing else: the floor of any router
written on grpc.aio), the three in rotating order. Each request's time is taken outside the pod's engine: the
client's end-to-end time less the engine's own (`Usage.e2e_ms`, arrival at the engine to the end). The engine's step
varies by milliseconds from one request to the next (the model on a shared CPU), a hop costs about one: subtracted,
the difference's spread falls from ~10 ms to ~1 (the end-to-end differences are kept beside it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ..protos import inference_pb2 as pb
from ..protos import inference_pb2_grpc as pb_grpc
from ..services.common.processes import ServiceProcess, await_listening, start_service, stop_service, wait_serving
from ..services.router.servicer import POD_HEADER, PODS_HEADER
from .fleet_arms import Shape, arm_keys, arm_order, progress, workload_for
from .fleet_sim import ArmOutcome
from .fleet_workload import FleetRequest, FleetWorkload
from .serve_passes import PASSAGE, run_at
from .stack import free_port


@dataclass
class Pod:
    proc: subprocess.Popen[str]
    address: str
    log: Any


def start_pod(args: argparse.Namespace, shape: Shape, secret: Path, log: Any) -> Pod:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--model", args.model, "--port", str(port), "--device", "cpu",
           "--num-blocks", str(shape.num_blocks), "--block-size", str(shape.block_size), "--max-num-seqs",
           str(shape.max_num_seqs), "--threads", str(args.threads), "--cache-salt-secret-file", str(secret),
           "--status-interval", "5", "--max-streams-per-tenant", "1000000"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    pod = Pod(proc, f"127.0.0.1:{port}", log)
    try:
        wait_serving(pod.address, 900, proc)
    except BaseException:
        stop_pod(pod)
        raise
    return pod


def stop_pod(pod: Pod) -> None:
    stop_service(ServiceProcess(pod.proc, pod.address), grace=60)


@dataclass
class Sent:
    ttft_s: float
    end: float
    start: float
    tokens: int
    prompt_tokens: int
    cached_tokens: int
    pod: str
    engine_s: float  # the pod's own time for it (Usage.e2e_ms): arrival at its engine to the end


def generate(stub: pb_grpc.InferenceStub, token_ids: Sequence[int], max_tokens: int, key: str, pod: str = "") -> Sent:
    """One streamed request; `pod` is where it went when the stub is a pod's own (else the router's header)."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(token_ids)),
                                 params=pb.GenerationParameters(max_tokens=max_tokens, ignore_eos=True))
    start = time.monotonic()
    first, tokens, usage = 0.0, 0, pb.Usage()
    call = stub.Generate(request, timeout=600, metadata=[("x-api-key", key)])
    for chunk in call:
        if chunk.token_ids:
            first = first or time.monotonic()
            tokens += len(chunk.token_ids)
        if chunk.HasField("usage"):
            usage = chunk.usage
    end = time.monotonic()
    if tokens != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {tokens}")
    pod = pod or dict(call.trailing_metadata()).get(POD_HEADER, "")
    return Sent(first - start, end, start, tokens, usage.prompt_tokens, usage.cached_prompt_tokens, pod,
                usage.e2e_ms / 1000)


def wait_idle(stubs: dict[str, pb_grpc.InferenceStub], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for address, stub in stubs.items():
        while (status := stub.Status(pb.StatusRequest(), timeout=30)).num_running or status.num_waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} is still busy after {timeout}s")
            time.sleep(0.05)


def start_router(args: argparse.Namespace, pods: Sequence[Pod], policy: str, secret: Path) -> ServiceProcess:
    router = start_service(["router", "--endpoints", ",".join(p.address for p in pods), "--policy", policy,
                            "--model", args.model, "--cache-salt-secret-file", str(secret)], timeout=300)
    deadline = time.monotonic() + 120
    with grpc.insecure_channel(router.address) as channel:  # every pod in sync, not only the first
        stub = pb_grpc.InferenceStub(channel)
        while True:
            _, call = stub.Status.with_call(pb.StatusRequest(), timeout=10)
            views = json.loads(dict(call.trailing_metadata())[PODS_HEADER])
            if len(views) == len(pods) and all(view["phase"] == "in sync" for view in views):
                return router
            if time.monotonic() > deadline:
                stop_service(router)
                raise TimeoutError(f"the router's pods are not all in sync after 120 s: {views}")
            time.sleep(0.1)


def run_real_arm(arm: str, workload: FleetWorkload, pods: Sequence[Pod], router: ServiceProcess | None,
                 tag: str, seed: int) -> ArmOutcome:
    if router is None:  # pinned: each connection to a pod drawn at random, as kube-proxy does
        rng = random.Random(seed)
        targets = [rng.choice(pods).address for _ in range(workload.num_clients)]
    else:
        targets = [router.address] * workload.num_clients
    channels = [grpc.insecure_channel(target) for target in targets]
    try:
        stubs = [pb_grpc.InferenceStub(channel) for channel in channels]

        def job(request: FleetRequest) -> Callable[[], Sent]:
            pod = targets[request.client] if router is None else ""
            return lambda: generate(stubs[request.client], request.token_ids, request.output_len,
                                    f"{tag}-tenant-{request.tenant}", pod)

        first = workload.requests[0].arrival_s
        sent = run_at([(r.arrival_s - first, job(r)) for r in workload.requests])
    finally:
        for channel in channels:
            channel.close()
    return ArmOutcome([s.ttft_s for s in sent], sum(s.tokens for s in sent), sum(s.prompt_tokens for s in sent),
                      sum(s.cached_tokens for s in sent), max(s.end for s in sent) - min(s.start for s in sent),
                      [s.pod for s in sent])


def calibrate(stub: pb_grpc.InferenceStub, shape: Shape, vocabulary: Sequence[int], tag: str) -> dict[str, float]:
    """Prefill and decode rates of one pod alone: a cold prompt of the workload's length, 16 tokens out."""
    rng = random.Random(1)
    prompt = rng.choices(list(vocabulary), k=shape.system_tokens + shape.question_tokens)
    sent = generate(stub, prompt, 16, f"{tag}-calibration")
    decode_s = (sent.end - sent.start - sent.ttft_s) / 15
    return {"prefill_tok_s": round(len(prompt) / max(sent.ttft_s - decode_s, 1e-6), 1),
            "decode_step_ms": round(decode_s * 1000, 2)}


def overhead(router: ServiceProcess, stubs: dict[str, pb_grpc.InferenceStub], vocabulary: Sequence[int],
             rounds: int, tag: str) -> dict[str, Any]:
    """The same short request through the router (over one pod), straight to that pod, and through the
    pass-through proxy before it, in rotating order `rounds` times: the routed and the proxied requests'
    differences from the direct ones (`routed`, `floor`)."""
    prompt = random.Random(2).choices(list(vocabulary), k=48)
    key = f"{tag}-overhead"
    with grpc.insecure_channel(router.address) as routed_channel:
        routed = pb_grpc.InferenceStub(routed_channel)
        pod = generate(routed, prompt, 1, key).pod  # warm: the prompt cached where the router sends it
        with passthrough_proxy(pod) as address, grpc.insecure_channel(address) as proxied_channel:
            proxied = pb_grpc.InferenceStub(proxied_channel)
            ways = [lambda: generate(routed, prompt, 1, key), lambda: generate(stubs[pod], prompt, 1, key, pod),
                    lambda: generate(proxied, prompt, 1, key, pod)]
            for send in ways:
                send()
            sent: list[list[Sent]] = [[], [], []]
            for i in range(rounds):
                for way in [(i + k) % 3 for k in range(3)]:
                    sent[way].append(ways[way]())
    if any(s.pod != pod for s in sent[0]):
        raise RuntimeError(f"the router sent the overhead's prompt off {pod}: the pairs would not be the same pod")
    return {"routed": paired_differences(list(zip(sent[0], sent[1], strict=True))),
            "floor": paired_differences(list(zip(sent[2], sent[1], strict=True)))}


def paired_differences(pairs: Sequence[tuple[Sent, Sent]]) -> dict[str, Any]:
    """The p50 of (via - direct) times outside the pod's engine with its distribution-free 95 % interval (order
    statistics of the sorted differences), in ms; the same of the end-to-end times (`e2e_`)."""
    def outside(sent: Sent) -> float:
        return sent.end - sent.start - sent.engine_s

    differences = sorted(outside(a) - outside(b) for a, b in pairs)
    e2e = sorted((a.end - a.start) - (b.end - b.start) for a, b in pairs)
    return {**_median_and_interval(differences, ""), **_median_and_interval(e2e, "e2e_"), "pairs": len(pairs),
            "via_ms_p50": round(statistics.median(a.end - a.start for a, _ in pairs) * 1000, 3),
            "direct_ms_p50": round(statistics.median(b.end - b.start for _, b in pairs) * 1000, 3)}


def _median_and_interval(ordered: Sequence[float], prefix: str) -> dict[str, Any]:
    n, half = len(ordered), 0.98 * math.sqrt(len(ordered))  # 1.96 standard deviations of Binomial(n, 1/2)
    low, high = max(0, math.floor(n / 2 - half) - 1), min(n - 1, math.ceil(n / 2 + half))
    return {f"{prefix}p50_ms": round(statistics.median(ordered) * 1000, 3),
            f"{prefix}ci95_ms": [round(ordered[low] * 1000, 3), round(ordered[high] * 1000, 3)]}


@contextmanager
def passthrough_proxy(upstream: str) -> Iterator[str]:
    """passthrough_proxy.py before `upstream`, for the block: its address."""
    proxy = ServiceProcess(subprocess.Popen(  # its stdout only carries the "listening on" line; gRPC logs to stderr
        [sys.executable, "-m", "pagedserve.benchmarks.passthrough_proxy", upstream], stdout=subprocess.PIPE,
        text=True), "")
    try:
        yield await_listening(proxy, "127.0.0.1:0", 60)
    finally:
        stop_service(proxy)


def run_real(args: argparse.Namespace, shape: Shape, arms: list[str]) -> dict[str, Any]:
    wall_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as folder:
        secret = Path(folder) / "salt-secret"
        secret.write_bytes(os.urandom(32))
        logs = [open(Path(folder) / f"pod-{i}.log", "w+") for i in range(shape.pods)]  # noqa: SIM115
        pods: list[Pod] = []
        try:
            with ThreadPoolExecutor(shape.pods) as starting:  # the model loads overlap
                futures = [starting.submit(start_pod, args, shape, secret, log) for log in logs]
                for future in futures:
                    pods.append(future.result())
            started_s = time.monotonic() - wall_start
            progress("pods serving", {"pods": [p.address for p in pods], "start_s": round(started_s, 1)})
            return measure(args, shape, arms, pods, secret, wall_start, started_s)
        except BaseException:
            for log in logs:
                log.seek(0)
                print(f"a pod's last output:\n{log.read()[-3000:]}", file=sys.stderr)
            raise
        finally:
            for pod in pods:
                stop_pod(pod)
            for log in logs:
                log.close()


def measure(args: argparse.Namespace, shape: Shape, arms: list[str], pods: list[Pod], secret: Path,
            wall_start: float, started_s: float) -> dict[str, Any]:
    run_tag = os.urandom(4).hex()  # in every key: a rerun against the same pods starts cold too
    channels = {p.address: grpc.insecure_channel(p.address) for p in pods}
    stubs = {address: pb_grpc.InferenceStub(channel) for address, channel in channels.items()}
    try:
        first = stubs[pods[0].address]
        vocabulary = sorted(set(first.Tokenize(pb.TokenizeRequest(text=PASSAGE), timeout=60).token_ids))
        block_size = first.ListModels(pb.ListModelsRequest(), timeout=60).models[0].block_size
        assert block_size == shape.block_size, f"the pods run blocks of {block_size}, not {shape.block_size}"
        for address, stub in stubs.items():  # warm every pod: its first step is not any arm's
            generate(stub, vocabulary[:32], 2, f"{run_tag}-warm", address)
        calibration = progress("calibration", calibrate(first, shape, vocabulary, run_tag))
        workload = workload_for(shape, vocabulary, args.seed)
        results, phase_s, load = {}, {}, {}
        for arm in arm_order(arms, args.seed):
            wait_idle(stubs)
            start = time.monotonic()
            router = start_router(args, pods, arm, secret) if arm != "pinned" else None
            try:
                outcome = run_real_arm(arm, workload, pods, router, f"{run_tag}-{arm}", args.seed)
            finally:
                if router is not None:
                    stop_service(router)
            results[arm] = progress(arm, arm_keys(outcome, [p.address for p in pods]))
            phase_s[arm] = round(time.monotonic() - start, 1)
            load[arm] = round(os.getloadavg()[0], 2)  # the machine is shared: how disturbed each arm may be
        wait_idle(stubs)
        router_overhead: dict[str, Any] = {}
        if args.overhead_pairs > 0:
            router = start_router(args, pods[:1], "kv-aware", secret)
            try:
                router_overhead = progress("router overhead",
                                           overhead(router, stubs, vocabulary, args.overhead_pairs, run_tag))
            finally:
                stop_service(router)
    finally:
        for channel in channels.values():
            channel.close()
    return {"mode": "real", "results": results, "workload": workload, "router_overhead": router_overhead,
            "calibration": calibration, "phase_s": {"pods_start": round(started_s, 1), **phase_s},
            "load_avg_1m_after_arm": load}
