"""`pagedserve bench fleet`: routing policies compared on a fleet of real pods, or at fleet scale in simulation.

Real (the default): N `pagedserve serve` pods on this machine (a small KV budget each, sized so that the tenants'
prefixes together need more than one pod holds, one shared cache-salt secret), the multi-tenant workload of
fleet_workload.py, and one arm per policy: a `pagedserve router --policy P` in front of the pods for each router
policy, and `pinned`, what a ClusterIP Service gives gRPC clients: each client connection (a tenant's user) talks
straight to one pod drawn at random. Every tenant's requests carry its API key, so the pods salt its prefix (and the
router, given the same secret, predicts it).

Every arm starts cold without restarting the pods: each arm's tenants have keys of their own (a tag per arm), so
their namespaces differ from every earlier arm's and nothing earlier can hit; what earlier arms left cached is free
and evicted like any free block. The pods are warmed once before the first arm (a request each), and the arms run
in a seeded shuffled order, printed in `arm_order`, so that no policy always runs first or last on a machine whose
load drifts.

Keys per arm: `ttft_p50_s`, `ttft_p90_s` (client-side), `tok_s` (output tokens / first send to last token),
`prefix_hit_rate` (cached prompt tokens / prompt tokens, from the pods' `Usage`), `max_over_mean_requests` (requests
per pod, the busiest over the mean). Then the ratios against round-robin, `kv_aware_hit_rate`, `oracle_hit_rate`
(fleet_workload.oracle_hit_rate: an upper bound) and `router_overhead_ms_p50`: one short request sent in turn
through a router and straight to the pod that router picked (alternating which goes first), the p50 of the pairs'
differences in end-to-end time.

`--simulate`: fleet_sim.py, the router's own choice code against simulated pods (each the real BlockManager with
its KV events), step costs from `--calibration` (a real run's JSON), the flags, or this machine's defaults below.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ..protos import inference_pb2 as pb
from ..protos import inference_pb2_grpc as pb_grpc
from ..services.common.processes import ServiceProcess, start_service, stop_service, wait_serving
from ..services.router.choice import POLICIES
from ..services.router.servicer import POD_HEADER, PODS_HEADER
from .fleet_sim import ArmOutcome, StepCosts, simulate
from .fleet_workload import (
    FleetRequest,
    FleetWorkload,
    max_over_mean,
    multi_tenant,
    oracle_hit_rate,
    prefixes_fit,
    requests_per_pod,
)
from .report import emit
from .serve_passes import PASSAGE, run_at

ARMS = (*POLICIES, "pinned")
# step costs for --simulate without --calibration: smollm2-135m, one executor thread, measured by a real run here
DEFAULT_PREFILL_TOK_S = 460.9
DEFAULT_DECODE_STEP_MS = 65.08
TARGETS = {  # issue 49, item 7
    "kv_aware_ttft_p90_vs_round_robin": "<= 0.33",
    "kv_aware_tok_s_vs_round_robin": ">= 1.3",
    "kv_aware_hit_rate_vs_oracle": "within 0.05",
    "max_over_mean_requests": "<= 1.5 for every arm but pinned",
    "router_overhead_ms_p50": "<= 2",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--model", default="smollm2-135m", help="registered name, HF directory or .gguf file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--tiny", action="store_true",
                        help="a run of seconds for tests: 3 pods, 3 tenants of 2 users, 12 requests, short prompts")
    parser.add_argument("--simulate", action="store_true", help="simulated pods (fleet_sim.py) instead of real ones")
    parser.add_argument("--pods", type=int, default=3)
    workload = parser.add_argument_group("the workload (with --simulate, the defaults grow with --pods / 3)")
    workload.add_argument("--tenants", type=int, help="tenants, each with its own system prompt (default 8)")
    workload.add_argument("--users-per-tenant", type=int, default=4, help="client connections per tenant")
    workload.add_argument("--requests", type=int, help="requests per arm (default 120)")
    workload.add_argument("--request-rate", type=float,
                          help="Poisson arrivals, requests/s (default 5: past what round-robin's 3 pods serve on 2 "
                               "cores, where throughput separates the policies; simulated, 1.5 a 3 pods)")
    workload.add_argument("--system-tokens", type=int, default=384, help="each tenant's shared system prompt")
    workload.add_argument("--question-tokens", type=int, default=32, help="each request's own question")
    workload.add_argument("--output-tokens", type=int, default=4)
    pods = parser.add_argument_group("each pod")
    pods.add_argument("--num-blocks", type=int,
                      help="KV blocks per pod (default: the prefixes of 1.5 x tenants / pods, plus the running "
                           "sequences' blocks: together the prefixes need more than one pod holds)")
    pods.add_argument("--block-size", type=int, default=16)
    pods.add_argument("--max-num-seqs", type=int, default=16)
    pods.add_argument("--threads", type=int, default=1, help="each executor's torch threads")
    sim = parser.add_argument_group("--simulate's step costs (default: --calibration's, else this machine's)")
    sim.add_argument("--calibration", type=Path, help="a real run's JSON: its measured prefill and decode rates")
    sim.add_argument("--prefill-tok-s", type=float)
    sim.add_argument("--decode-step-ms", type=float)
    parser.add_argument("--overhead-pairs", type=int, default=40, help="request pairs for router_overhead_ms_p50")


# ---- the shape of a run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    pods: int
    tenants: int
    users_per_tenant: int
    requests: int
    request_rate: float
    system_tokens: int
    question_tokens: int
    output_tokens: int
    block_size: int
    num_blocks: int
    max_num_seqs: int

    @property
    def prefix_blocks(self) -> int:
        return self.system_tokens // self.block_size

    @property
    def working_blocks(self) -> int:
        """Blocks the running sequences hold beyond their prefix: each one's question and output, and a spare."""
        return self.max_num_seqs * (math.ceil((self.question_tokens + self.output_tokens) / self.block_size) + 1)


def shape_of(args: argparse.Namespace) -> Shape:
    scale = args.pods / 3 if args.simulate else 1.0
    if args.tiny:
        tenants, requests, rate = 3, 12, 4.0
        system, question, users, seqs = 64, 8, 2, 4
    else:
        # real pods share this machine's cores: at 5 requests/s round-robin's queues grow and kv-aware's do not;
        # simulated pods each have a core of their own, and 1.5 a 3 pods is light load there
        tenants, requests, rate = round(8 * scale), round(120 * scale), (1.5 * scale if args.simulate else 5.0)
        system, question, users, seqs = (args.system_tokens, args.question_tokens, args.users_per_tenant,
                                         args.max_num_seqs)
    tenants, requests, rate = args.tenants or tenants, args.requests or requests, args.request_rate or rate
    draft = Shape(args.pods, tenants, users, requests, rate, system, question, args.output_tokens, args.block_size,
                  0, seqs)
    num_blocks = args.num_blocks or draft.prefix_blocks * math.ceil(1.5 * tenants / args.pods) + draft.working_blocks
    shape = dataclasses.replace(draft, num_blocks=num_blocks)
    if shape.pods < 1 or shape.prefix_blocks < 1:
        raise SystemExit("bench fleet: --pods must be positive and --system-tokens at least one block")
    return shape


def workload_for(shape: Shape, vocabulary: Sequence[int], seed: int) -> FleetWorkload:
    return multi_tenant(shape.requests, shape.tenants, shape.users_per_tenant, shape.system_tokens,
                        shape.question_tokens, shape.output_tokens, shape.request_rate, vocabulary, seed)


def arm_keys(outcome: ArmOutcome, pods: Sequence[str]) -> dict[str, Any]:
    ttft = sorted(outcome.ttft_s)
    counts = requests_per_pod(pods, outcome.served)
    return {
        "ttft_p50_s": round(quantile(ttft, 0.5), 4),
        "ttft_p90_s": round(quantile(ttft, 0.9), 4),
        "tok_s": round(outcome.output_tokens / outcome.duration_s, 3),
        "prefix_hit_rate": round(outcome.cached_tokens / outcome.prompt_tokens, 4),
        "max_over_mean_requests": round(max_over_mean(counts), 3),
        "requests": len(outcome.served),
        "requests_per_pod_max": max(counts.values()),
        "requests_per_pod_min": min(counts.values()),
    }


def quantile(values: Sequence[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def summary(arms: dict[str, dict[str, Any]], oracle: float, overhead_ms: float | None) -> dict[str, Any]:
    result: dict[str, Any] = {}
    kv, rr = arms.get("kv-aware"), arms.get("round-robin")
    if kv is not None and rr is not None:
        result["kv_aware_ttft_p90_vs_round_robin"] = round(kv["ttft_p90_s"] / rr["ttft_p90_s"], 3)
        result["kv_aware_tok_s_vs_round_robin"] = round(kv["tok_s"] / rr["tok_s"], 3)
    if kv is not None:
        result["kv_aware_hit_rate"] = kv["prefix_hit_rate"]
    result["oracle_hit_rate"] = round(oracle, 4)
    result["router_overhead_ms_p50"] = None if overhead_ms is None else round(overhead_ms, 3)
    met: dict[str, bool | None] = {
        "kv_aware_ttft_p90_vs_round_robin": _le(result.get("kv_aware_ttft_p90_vs_round_robin"), 0.33),
        "kv_aware_tok_s_vs_round_robin": None if "kv_aware_tok_s_vs_round_robin" not in result
        else result["kv_aware_tok_s_vs_round_robin"] >= 1.3,
        "kv_aware_hit_rate_vs_oracle": None if kv is None else oracle - kv["prefix_hit_rate"] <= 0.05,
        "max_over_mean_requests": all(a["max_over_mean_requests"] <= 1.5 for n, a in arms.items() if n != "pinned"),
        "router_overhead_ms_p50": _le(result["router_overhead_ms_p50"], 2.0),
    }
    result["targets"] = TARGETS
    result["targets_met"] = met
    return result


def _le(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def arm_order(names: Sequence[str], seed: int) -> list[str]:
    order = list(names)
    random.Random(seed).shuffle(order)
    return order


def parse_arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms or len(set(arms)) != len(arms):
        raise SystemExit(f"bench fleet: --arms must name distinct arms of {', '.join(ARMS)}; got {text!r}")
    return arms


def progress(what: str, fields: dict[str, Any]) -> dict[str, Any]:
    print(f"bench fleet: {what}: {json.dumps(fields)}", file=sys.stderr, flush=True)
    return fields


# ---- simulated -----------------------------------------------------------------------------------------


def step_costs(args: argparse.Namespace, shape: Shape) -> StepCosts:
    prefill, decode_ms = DEFAULT_PREFILL_TOK_S, DEFAULT_DECODE_STEP_MS
    if args.calibration is not None:
        calibration = json.loads(args.calibration.read_text())["calibration"]
        prefill, decode_ms = calibration["prefill_tok_s"], calibration["decode_step_ms"]
    prefill = args.prefill_tok_s or prefill
    decode_ms = args.decode_step_ms or decode_ms
    return StepCosts(prefill, decode_ms / 1000, shape.max_num_seqs)


def run_simulated(args: argparse.Namespace, shape: Shape, arms: list[str]) -> dict[str, Any]:
    costs = step_costs(args, shape)
    workload = workload_for(shape, range(1000, 30000), args.seed)
    pods = [f"pod-{i:03d}" for i in range(shape.pods)]
    results = {}
    for arm in arm_order(arms, args.seed):
        results[arm] = progress(arm, arm_keys(simulate(arm, workload, shape.pods, shape.num_blocks,
                                                       shape.block_size, costs, args.seed), pods))
    return {"mode": "simulated", "arms": {arm: results[arm] for arm in arms}, "arm_order": list(results),
            **summary(results, oracle_hit_rate(workload, shape.block_size), None),
            "step_costs": {"prefill_tok_s": costs.prefill_tok_s, "decode_step_ms": costs.decode_step_s * 1000,
                           "from": str(args.calibration) if args.calibration else "flags or defaults"}}


# ---- real ------------------------------------------------------------------------------------------------


@dataclass
class Pod:
    proc: subprocess.Popen[str]
    address: str
    log: Any


def start_pod(args: argparse.Namespace, shape: Shape, secret: Path, log: Any) -> Pod:
    with socket.socket() as sock:  # a free loopback port
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
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
    return Sent(first - start, end, start, tokens, usage.prompt_tokens, usage.cached_prompt_tokens, pod)


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


def router_overhead(router: ServiceProcess, stubs: dict[str, pb_grpc.InferenceStub], vocabulary: Sequence[int],
                    pairs: int, tag: str) -> dict[str, float]:
    """The same request through the router and straight to the pod it picked, in turn (who goes first
    alternates): the p50 of the pairs' differences, in ms."""
    prompt = random.Random(2).choices(list(vocabulary), k=48)
    differences, via, direct = [], [], []
    with grpc.insecure_channel(router.address) as channel:
        routed = pb_grpc.InferenceStub(channel)
        generate(routed, prompt, 1, f"{tag}-overhead")  # warm: the prompt cached where it goes
        for i in range(pairs):
            if i % 2 == 0:
                a = generate(routed, prompt, 1, f"{tag}-overhead")
                b = generate(stubs[a.pod], prompt, 1, f"{tag}-overhead", a.pod)
            else:
                pod = generate(routed, prompt, 1, f"{tag}-overhead").pod  # where the router sends it now
                b = generate(stubs[pod], prompt, 1, f"{tag}-overhead", pod)
                a = generate(routed, prompt, 1, f"{tag}-overhead")
            via.append(a.end - a.start)
            direct.append(b.end - b.start)
            differences.append((a.end - a.start) - (b.end - b.start))
    return {"router_overhead_ms_p50": statistics.median(differences) * 1000,
            "routed_ms_p50": round(statistics.median(via) * 1000, 3),
            "direct_ms_p50": round(statistics.median(direct) * 1000, 3)}


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
        overhead: dict[str, float] = {}
        if args.overhead_pairs > 0:
            router = start_router(args, pods, "kv-aware", secret)
            try:
                overhead = progress("router overhead",
                                    router_overhead(router, stubs, vocabulary, args.overhead_pairs, run_tag))
            finally:
                stop_service(router)
    finally:
        for channel in channels.values():
            channel.close()
    return {"mode": "real", "arms": {arm: results[arm] for arm in arms}, "arm_order": list(results),
            **summary(results, oracle_hit_rate(workload, shape.block_size), overhead.get("router_overhead_ms_p50")),
            "router_overhead": overhead, "calibration": calibration,
            "phase_s": {"pods_start": round(started_s, 1), **phase_s}, "load_avg_1m_after_arm": load}


# ---- the command -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape, arms = shape_of(args), parse_arms(args.arms)
    wall_start, load_start = time.monotonic(), round(os.getloadavg()[0], 2)
    result = run_simulated(args, shape, arms) if args.simulate else run_real(args, shape, arms)
    result.update(
        model=args.model, seed=args.seed, shape=dataclasses.asdict(shape),
        prefixes_exceed_one_pod=shape.tenants * shape.prefix_blocks > shape.num_blocks,
        oracle_fits_budgets=prefixes_fit(shape.tenants, shape.prefix_blocks, shape.pods, shape.num_blocks,
                                         shape.working_blocks),
        wall_s=round(time.monotonic() - wall_start, 1),
        load_avg_1m={"start": load_start, "end": round(os.getloadavg()[0], 2)},
    )
    return result


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
