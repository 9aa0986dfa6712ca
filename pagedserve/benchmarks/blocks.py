"""`pagedserve bench blocks`: KV utilization of paged vs reserved allocation, and step bookkeeping cost.

Utilization: a ShareGPT-shaped trace runs to completion under a fixed block budget with continuous
admission (FCFS; on a block shortage the newest sequence is preempted by recompute). Each step every
running sequence decodes one token; the share of allocated KV slots holding a token is averaged over
steps. The reserved baseline reserves the maximum length per sequence at admission, as serving systems
did before PagedAttention.

Step cost: one decode step (the Decode op: commit, append one token, reserve its slot) for N running
sequences, in process and over gRPC to a real block-manager process on loopback, request building and
response parsing included.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from ..services.block_manager.contract import DecodeOp
from ..services.block_manager.manager import BlockManager
from ..services.block_manager.step import apply_step
from .report import emit
from .workloads import RequestSpec, sharegpt_like

NAMESPACE = b"bench-namespace!"


def simulate_paged(specs: list[RequestSpec], num_blocks: int, block_size: int, seed: int) -> dict[str, float]:
    manager = BlockManager(num_blocks, block_size)
    rng = random.Random(seed)
    prompts = [[rng.randrange(50_000) for _ in range(s.prompt_len)] for s in specs]
    generated = [0] * len(specs)
    waiting = deque(range(len(specs)))
    running: list[int] = []  # admission order: the newest is preempted first
    util_sum, steps, max_running, preemptions = 0.0, 0, 0, 0
    while waiting or running:
        decoding = list(running)
        while waiting:  # admit (prefill the prompt plus anything generated before a preemption)
            i = waiting[0]
            tokens = prompts[i] + [1] * generated[i]
            if not manager.can_admit(len(tokens)):
                break
            cached = manager.create(i, tokens, NAMESPACE).num_cached_tokens  # a preempted prefix may survive
            if not manager.reserve(i, len(tokens) - cached, admission=True).granted:
                manager.free(i)
                break
            manager.commit(i, len(tokens))
            running.append(waiting.popleft())
        for i in decoding:
            if i not in manager.seqs:
                continue  # preempted earlier in this step
            while not manager.reserve(i, 1, [1]).granted:
                victim = running.pop()
                manager.free(victim)
                waiting.appendleft(victim)
                preemptions += 1
                if victim == i:
                    break
            else:
                generated[i] += 1
        if not running:
            raise RuntimeError("a single request does not fit the block budget")
        max_running = max(max_running, len(running))
        util_sum += manager.stats().kv_utilization
        steps += 1
        for i in [i for i in running if generated[i] >= specs[i].output_len]:
            running.remove(i)
            manager.free(i)
    manager.check_integrity()
    return {"kv_utilization": util_sum / steps, "max_concurrent": max_running, "steps": steps,
            "preemptions": preemptions}


def simulate_reserved(specs: list[RequestSpec], num_blocks: int, block_size: int, max_len: int) -> dict[str, float]:
    per_seq = -(-max_len // block_size)
    lengths: dict[int, int] = {}
    generated = [0] * len(specs)
    waiting = deque(range(len(specs)))
    util_sum, steps, max_running = 0.0, 0, 0
    while waiting or lengths:
        decoding = list(lengths)
        while waiting and (len(lengths) + 1) * per_seq <= num_blocks:
            i = waiting.popleft()
            lengths[i] = specs[i].prompt_len
        for i in decoding:
            lengths[i] += 1
            generated[i] += 1
        max_running = max(max_running, len(lengths))
        util_sum += sum(lengths.values()) / (len(lengths) * per_seq * block_size)
        steps += 1
        for i in [i for i in lengths if generated[i] >= specs[i].output_len]:
            del lengths[i]
    return {"kv_utilization": util_sum / steps, "max_concurrent": max_running, "steps": steps}


def _running_batch(manager: BlockManager, num_seqs: int, prompt_len: int) -> None:
    for seq_id in range(num_seqs):
        manager.create(seq_id, [seq_id % 1000 + 1] * prompt_len, NAMESPACE)
        manager.reserve(seq_id, prompt_len)


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    cuts = statistics.quantiles([s / 1000 for s in samples_ns], n=100)
    return cuts[49], cuts[98]


def step_cost_inprocess(num_seqs: int, steps: int, prompt_len: int, block_size: int) -> tuple[float, float]:
    manager = BlockManager(num_seqs * (-(-(prompt_len + steps + 20) // block_size)), block_size)
    _running_batch(manager, num_seqs, prompt_len)
    seq_ids = list(range(num_seqs))
    samples = []
    for step in range(steps + 20):
        start = time.perf_counter_ns()
        outcome = apply_step(manager, [DecodeOp(seq_ids, [7 + step % 3] * num_seqs)])[0]
        samples.append(time.perf_counter_ns() - start)
        assert len(outcome.slot_mapping) == num_seqs
    return _percentiles(samples[20:])


def step_cost_rpc(num_seqs: int, steps: int, prompt_len: int, block_size: int) -> tuple[tuple[float, float], ...]:
    """The Decode step over gRPC as the frontend sends it (one stream for every step; request build and parse
    included), and an empty unary Stats call alternated with it: a call's floor between two Python processes."""
    from ..services.block_manager.client import RemoteBlockManager
    from ..services.block_manager.contract import AdmitOp, DecodeOp
    from ..services.common.processes import running_service

    num_blocks = num_seqs * (-(-(prompt_len + steps + 20) // block_size))
    args = ["block-manager", "--num-blocks", str(num_blocks), "--block-size", str(block_size)]
    with running_service(args) as service:
        client = RemoteBlockManager(service.address)
        try:
            client.step([AdmitOp(seq_id, [1] * prompt_len, NAMESPACE, prompt_len) for seq_id in range(num_seqs)])
            seq_ids = list(range(num_seqs))
            samples, floor = [], []
            for step in range(steps + 20):
                start = time.perf_counter_ns()
                answer = client.step([DecodeOp(seq_ids, [7 + step % 3] * num_seqs)])
                samples.append(time.perf_counter_ns() - start)
                assert len(answer.outcomes[0].slot_mapping) == num_seqs
                start = time.perf_counter_ns()
                client.stats()
                floor.append(time.perf_counter_ns() - start)
        finally:
            client.close()
    return _percentiles(samples[20:]), _percentiles(floor[20:])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV budget in blocks for the trace")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=2048, help="prompt + output cap; the reserved size")
    parser.add_argument("--decode-seqs", type=int, default=256, help="running sequences in the step-cost test")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps")
    parser.add_argument("--no-rpc", action="store_true", help="skip the gRPC step-cost measurement")


def run(args: argparse.Namespace) -> dict[str, Any]:
    specs = sharegpt_like(args.num_requests, seed=args.seed, max_total=args.max_len)
    paged = simulate_paged(specs, args.num_blocks, args.block_size, args.seed)
    reserved = simulate_reserved(specs, args.num_blocks, args.block_size, args.max_len)
    inproc = step_cost_inprocess(args.decode_seqs, args.steps, 128, args.block_size)
    result: dict[str, Any] = {
        "kv_utilization_paged": round(paged["kv_utilization"], 4),
        "kv_utilization_reserved": round(reserved["kv_utilization"], 4),
        "utilization_ratio": round(paged["kv_utilization"] / reserved["kv_utilization"], 2),
        "max_concurrent_paged": paged["max_concurrent"],
        "max_concurrent_reserved": reserved["max_concurrent"],
        "num_preemptions_paged": paged["preemptions"],
        "steps_paged": paged["steps"],
        "steps_reserved": reserved["steps"],
        "trace": {
            "num_requests": len(specs),
            "seed": args.seed,
            "input_mean": round(statistics.mean(s.prompt_len for s in specs), 1),
            "output_mean": round(statistics.mean(s.output_len for s in specs), 1),
            "max_total": max(s.prompt_len + s.output_len for s in specs),
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
        },
        "decode_seqs": args.decode_seqs,
        "step_us_inprocess_p50": round(inproc[0], 1),
        "step_us_inprocess_p99": round(inproc[1], 1),
    }
    if not args.no_rpc:
        rpc, floor = step_cost_rpc(args.decode_seqs, args.steps, 128, args.block_size)
        result["step_rpc_us_p50"] = round(rpc[0], 1)
        result["step_rpc_us_p99"] = round(rpc[1], 1)
        result["empty_rpc_us_p50"] = round(floor[0], 1)
    return result


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
