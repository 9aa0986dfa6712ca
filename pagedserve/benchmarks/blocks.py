"""`pagedserve bench blocks`: KV utilization of paged vs reserved allocation, preemptions, and step bookkeeping cost.

Utilization: a ShareGPT-shaped trace (every request queued at once) runs to completion under a fixed block
budget through the real engine, scheduler and block manager, in process, in front of the executor stand-in
(benchmarks/standin_executor.py, no hold: a step of fixed cost, so steps stand for time). Admission and preemption
are the scheduler's own (docs/scheduler.md); each request ends at its trace length on a stop token, its
`max_tokens` the rest of the context (or its length, `--exact-max-tokens`). Averaged over the engine's steps: the
share of slots in used blocks holding a token (`kv_utilization_paged`) and the share of the cache's blocks in use
(`kv_occupancy_paged`); with them the preemptions by recompute per request, and the tokens the executor computed
over the trace's (prompt and output: 1.0 when nothing is computed twice). The reserved baseline reserves the
maximum length per sequence at admission, as serving systems did before PagedAttention.

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
from ..services.common.cache_identity import CacheIdentity
from ..services.executor.step_types import SampledToken, StepInput
from ..services.frontend.engine import Engine, EngineLimits
from ..services.frontend.ports import LocalBlockManager, LocalExecutor
from ..services.frontend.public_options import positive_int
from ..services.frontend.request import GenerationParams
from ..services.frontend.scheduler import Scheduler, SchedulerConfig
from .report import emit
from .standin_executor import StandInRunner, Timeline
from .workloads import RequestSpec, sharegpt_like

NAMESPACE = b"bench-namespace!"
VOCAB_SIZE = 49152  # SmolLM2's: the stand-in's token ids stay in it


class CountingRunner(StandInRunner):
    """The stand-in, counting the tokens computed (every row's, prefills and recomputations included)."""

    computed = 0

    def execute(self, step: StepInput) -> list[SampledToken]:
        self.computed += sum(len(row[1]) for row in step.sequences)
        return super().execute(step)


def replay_paged(specs: list[RequestSpec], num_blocks: int, block_size: int, max_len: int, seed: int,
                 config: SchedulerConfig, exact_max_tokens: bool = False) -> dict[str, float]:
    """The trace through the real engine, scheduler and block manager (module docstring): each request ends on
    the stop token the stand-in samples at its output length; its `max_tokens` is the rest of the context (a
    client that sets no limit), or exactly its output length with `exact_max_tokens`."""
    if max_len >= VOCAB_SIZE - 1:  # past it the stand-in's tokens repeat, and a stop token could end a sequence early
        raise ValueError(f"--max-len must be below {VOCAB_SIZE - 1}, got {max_len}")
    manager = BlockManager(num_blocks, block_size)
    timeline = Timeline()
    runner = CountingRunner(0.0, VOCAB_SIZE, timeline, block_size)
    executor = LocalExecutor(runner)  # type: ignore[arg-type]  # it calls only execute() and block_size
    limits = EngineLimits(VOCAB_SIZE, max_len, num_blocks, block_size, frozenset())
    engine = Engine(Scheduler(config, LocalBlockManager(manager)), executor, limits,
                    CacheIdentity("bench-blocks", "", "", "float32", block_size))
    rng = random.Random(seed)
    requests = []
    for i, spec in enumerate(specs):
        prompt = [rng.randrange(1, VOCAB_SIZE) for _ in range(spec.prompt_len)]
        stop = runner.token_at(spec.prompt_len + spec.output_len - 1)
        max_tokens = spec.output_len if exact_max_tokens else max_len - spec.prompt_len
        params = GenerationParams(max_tokens=max_tokens, stop_token_ids=(stop,))
        requests.append(engine.add_request(f"r{i}", prompt, params, final_only=True))
    util_sum = occupancy_sum = 0.0
    samples, max_running, scheduler = 0, 0, engine.scheduler
    try:
        while engine.has_work:
            engine.step()
            stats = manager.stats()
            util_sum += stats.kv_utilization
            occupancy_sum += stats.num_used_blocks / num_blocks
            samples += 1
            max_running = max(max_running, len(scheduler.running))
    finally:
        executor.thread.shutdown()
    manager.check_integrity()
    for request, spec in zip(requests, specs, strict=True):  # each ended where its trace entry says
        if len(request.seqs[0].output_token_ids) != spec.output_len:
            raise RuntimeError(f"{request.request_id}: {len(request.seqs[0].output_token_ids)} output tokens,"
                               f" not the trace's {spec.output_len}")
    trace_tokens = sum(s.prompt_len + s.output_len for s in specs)
    return {"kv_utilization": util_sum / samples, "kv_occupancy": occupancy_sum / samples,
            "max_concurrent": max_running, "steps": len(timeline.steps),
            "preemptions": scheduler.num_preemptions["recompute"],
            "computed_over_trace": runner.computed / trace_tokens}


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
    parser.add_argument("--num-requests", type=positive_int, default=1000)
    parser.add_argument("--num-blocks", type=positive_int, default=2048, help="KV budget in blocks for the trace")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--max-len", type=positive_int, default=2048, help="prompt + output cap; the reserved size")
    parser.add_argument("--max-num-seqs", type=positive_int, default=256, help="the scheduler's cap on running"
                        " sequences (high: the KV budget, not the cap, bounds the batch)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                        help="the scheduler's token budget per step")
    parser.add_argument("--no-reserve-growth", dest="reserve_growth", action="store_false",
                        help="admission leaves no room for the running sequences' growth (to compare)")
    parser.add_argument("--exact-max-tokens", action="store_true",
                        help="each request's max_tokens is its output length (default: the rest of the context)")
    parser.add_argument("--decode-seqs", type=int, default=256, help="running sequences in the step-cost test")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps")
    parser.add_argument("--no-rpc", action="store_true", help="skip the gRPC step-cost measurement")


def run(args: argparse.Namespace) -> dict[str, Any]:
    specs = sharegpt_like(args.num_requests, seed=args.seed, max_total=args.max_len)
    config = SchedulerConfig(args.block_size, args.max_len, args.max_num_seqs, args.max_num_batched_tokens,
                             reserve_growth=args.reserve_growth)
    paged = replay_paged(specs, args.num_blocks, args.block_size, args.max_len, args.seed, config,
                         args.exact_max_tokens)
    reserved = simulate_reserved(specs, args.num_blocks, args.block_size, args.max_len)
    inproc = step_cost_inprocess(args.decode_seqs, args.steps, 128, args.block_size)
    result: dict[str, Any] = {
        "kv_utilization_paged": round(paged["kv_utilization"], 4),
        "kv_utilization_reserved": round(reserved["kv_utilization"], 4),
        "utilization_ratio": round(paged["kv_utilization"] / reserved["kv_utilization"], 2),
        "max_concurrent_paged": paged["max_concurrent"],
        "max_concurrent_reserved": reserved["max_concurrent"],
        "num_preemptions_paged": paged["preemptions"],
        "preemptions_per_request": round(paged["preemptions"] / len(specs), 4),
        "kv_occupancy_paged": round(paged["kv_occupancy"], 4),
        "computed_tokens_over_trace_paged": round(paged["computed_over_trace"], 4),
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
            "max_tokens": "output length" if args.exact_max_tokens else "rest of the context",
        },
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "reserve_growth": args.reserve_growth},
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
