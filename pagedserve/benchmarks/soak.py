"""`pagedserve bench soak`: `pagedserve serve` under concurrent streaming clients for N minutes, with the
cancellations and disconnects real clients make, to find what only time finds: leaked blocks, growing
memory, latency that creeps up.

Each client loops over requests drawn from a seeded mix: streams read to the end, unary calls, streams
cancelled after a few tokens, and streams whose client drops its connection mid-way (its own channel,
closed). Prompts share a few long prefixes, so the prefix cache is hit, evicted and refilled; a tenth ask
for n = 2. At the end, once the pod is idle, nothing may be held.
Keys: `requests`, `errors` (failures nobody asked for), `cancelled` / `disconnected` (asked for),
`leaked_blocks` (blocks in use once idle), `rss_growth_mib` (each process: its resident memory at the end
minus after the first window, so warm-up allocations are not counted), `p99_ttft_drift` (p99 time to first
token over the last window / over the first; 1.0 is no drift). The windows are a minute each, or a third of
a shorter run.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy

from ..protos import inference_pb2 as pb
from ..protos import inference_pb2_grpc as pb_grpc
from ..services.common.processes import stop_service
from .report import emit
from .stack import start_stack

PREFIXES = [
    "You are a careful assistant. Answer briefly and cite the rule you used. ",
    "Summarize the following notes for a busy engineer who reads on a phone. ",
    "Translate the text into plain English, keeping every number exactly as it is. ",
]
WORDS = ["paged", "attention", "blocks", "tokens", "cache", "prefix", "swap", "evict", "stream", "cancel", "latency",
         "memory", "schedule"]
KINDS = ("stream", "unary", "cancel", "disconnect")
WEIGHTS = (0.6, 0.2, 0.1, 0.1)
EXPECTED = {"cancel": grpc.StatusCode.CANCELLED, "disconnect": grpc.StatusCode.CANCELLED}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients, each one request at a time")
    parser.add_argument("--max-tokens", type=int, default=48, help="the longest answer asked for")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=32)


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # unexpected, by code
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (start, seconds) of each stream

    def done(self, kind: str, start: float, ttft: float | None, error: grpc.StatusCode | None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            if error is not None and error != EXPECTED.get(kind):
                self.errors[error.name] += 1
            if ttft is not None:
                self.ttft.append((start, ttft))


def request_for(rng: random.Random, max_tokens: int) -> tuple[str, pb.GenerateRequest]:
    kind = rng.choices(KINDS, WEIGHTS)[0]
    text = rng.choice(PREFIXES) + " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
    sampled = rng.random() < 0.5
    params = pb.GenerationParameters(
        max_tokens=rng.randint(4, max_tokens), ignore_eos=rng.random() < 0.5, n=2 if rng.random() < 0.1 else 1,
        temperature=0.8 if sampled else 0.0, seed=rng.randrange(1 << 30) if sampled else None)
    return kind, pb.GenerateRequest(text=text, params=params)


def client(address: str, seed: int, max_tokens: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    shared = grpc.insecure_channel(address)
    stub = pb_grpc.InferenceStub(shared)
    while time.monotonic() < until:
        kind, request = request_for(rng, max_tokens)
        own = grpc.insecure_channel(address) if kind == "disconnect" else None
        start, ttft, error = time.monotonic(), None, None
        try:
            if kind == "unary":
                stub.Complete(request, timeout=600)
                continue
            call = (pb_grpc.InferenceStub(own) if own else stub).Generate(request, timeout=600)
            stop_after = rng.randint(1, 4) if kind in EXPECTED else -1
            for i, chunk in enumerate(call):
                if ttft is None and chunk.token_ids:
                    ttft = time.monotonic() - start
                if i + 1 == stop_after:
                    if own is not None:
                        own.close()  # the client goes away: the server sees its stream cancelled
                    else:
                        call.cancel()
        except grpc.RpcError as exc:
            error = exc.code()
        finally:
            tally.done(kind, start, ttft, error)
            if own is not None:
                own.close()
    shared.close()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def components(stack_pid: int) -> dict[str, int]:
    """The `pagedserve serve` process's children by role (they are this benchmark's processes too)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
        except OSError:
            continue
        for role in ("executor", "block-manager", "frontend"):
            if ppid == stack_pid and role.encode() in argv:
                found[role] = int(entry)
    return found


def p99(values: list[float]) -> float:
    return float(numpy.percentile(values, 99)) if values else float("nan")


def run(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.minutes * 60
    window = min(60.0, duration / 3)
    stack_args = argparse.Namespace(model=args.model, kv_cache_mib=args.kv_cache_mib, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=512, preemption_mode=None, block_size=None, threads=None,
                                    ttft_slo_ms=None, tpot_slo_ms=None)
    tally = Tally()
    with tempfile.TemporaryFile("w+") as log:
        stack = start_stack(stack_args, log)
        try:
            pids = components(stack.proc.pid)
            start = time.monotonic()
            until = start + duration
            threads = [threading.Thread(target=client, args=(stack.address, args.seed * 1000 + i, args.max_tokens,
                                                             until, tally), daemon=True) for i in range(args.clients)]
            for thread in threads:
                thread.start()
            time.sleep(window)
            baseline = {role: rss_mib(pid) for role, pid in pids.items()}
            for thread in threads:
                thread.join()
            status = idle_status(stack.address)
            final = {role: rss_mib(pid) for role, pid in pids.items()}
            restarted = components(stack.proc.pid) != pids
        finally:
            stop_service(stack, grace=60)
    first = [t for s, t in tally.ttft if s < start + window]
    last = [t for s, t in tally.ttft if s >= until - window]
    return {
        "model": args.model, "minutes": args.minutes, "clients": args.clients,
        "requests": sum(tally.kinds.values()), "by_kind": dict(tally.kinds),
        "errors": sum(tally.errors.values()), "errors_by_code": dict(tally.errors),
        "cancelled": tally.kinds["cancel"], "disconnected": tally.kinds["disconnect"],
        "leaked_blocks": status.num_used_blocks, "components_restarted": restarted,
        "rss_growth_mib": {role: round(final[role] - baseline[role], 1) for role in pids},
        "rss_mib": {role: round(final[role], 1) for role in pids},
        "p99_ttft_ms_first": round(p99(first) * 1000, 1), "p99_ttft_ms_last": round(p99(last) * 1000, 1),
        "p99_ttft_drift": round(p99(last) / p99(first), 3) if first and last else None,
        "window_s": round(window, 1),
    }


def idle_status(address: str, timeout: float = 120) -> pb.StatusResponse:
    """The pod's Status once nothing runs or waits (cancelled streams free their blocks at once)."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        deadline = time.monotonic() + timeout
        while True:
            status = stub.Status(pb.StatusRequest(), timeout=10)
            if status.num_running == status.num_waiting == 0 or time.monotonic() > deadline:
                return status
            time.sleep(0.1)


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
