"""`pagedserve bench host-step`: the host CPU of a steady decode step on each side, in one process, no gRPC.

The real scheduler and engine (overlapped steps), the real block manager behind its servicer, and the real
executor servicer's parsing (held tables and sampling parameters) in front of an executor stand-in that samples
at once (benchmarks/standin_executor.py, no hold). Every message is built, serialized, parsed and answered as
on the wire; only the transport is left out. Each side's share is its thread CPU time:

- frontend: planning, applying the answer, recording the tokens, and its two messages built and their answers read;
- block manager: its Step message read, applied and answered (and how many steps call it at all);
- executor host: its message read and accepted (`ExecutorServicer.accept`), the stand-in's sampling, the answer.

Prompt lengths differ by up to a block, so the sequences cross block boundaries on different steps as in real
traffic. The window is the steps in which every sequence decodes (EDGE_STEPS dropped at each end), the median
of `--repeats` runs. `bench overhead` runs the same code as three processes over gRPC: its CPU per step minus
these is what the transport and the cores' contention cost. Being one process on one thread, this is the
quiet measure to compare two versions of the per-step code with.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..protos import block_manager_pb2 as bm_pb
from ..protos import executor_pb2 as ex_pb
from ..services.block_manager import codec as bm_codec
from ..services.block_manager.contract import BlockStats, Op, StepAnswer
from ..services.block_manager.manager import BlockManager
from ..services.block_manager.server import BlockManagerServicer
from ..services.common.cache_identity import CacheIdentity
from ..services.common.grpc_server import GC_THRESHOLDS
from ..services.executor import codec as ex_codec
from ..services.executor.held_inputs import SentInputs
from ..services.executor.options import ExecutorConfig
from ..services.executor.server import ExecutorServicer
from ..services.executor.step_types import SampledToken, StepInput
from ..services.frontend.engine import Engine, EngineLimits
from ..services.frontend.public_options import non_negative_int, positive_int
from ..services.frontend.request import FinishReason, GenerationParams, Request
from ..services.frontend.scheduler import Scheduler, SchedulerConfig
from .report import emit
from .standin_executor import StandInRunner, Timeline

EDGE_STEPS = 5
BLOCK_SIZE = 16
PROMPT_LEN = 10
VOCAB_SIZE = 49152  # SmolLM2's: the stand-in's token ids stay in it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--seqs", default="1,64,256", help="comma-separated numbers of running sequences")
    parser.add_argument("--tokens", type=positive_int, default=200, help="new tokens per request")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs per number of sequences (medians reported)")
    parser.add_argument("--no-local-decodes", dest="local_decodes", action="store_false",
                        help="every decode through the block manager, none placed by the scheduler (to compare)")
    parser.add_argument("--spare-lookahead", type=non_negative_int, default=SchedulerConfig.spare_lookahead,
                        help="the scheduler's spare lookahead in slots (0: no spare blocks, to compare)")
    parser.add_argument("--no-repeat-batches", dest="repeat_batches", action="store_false",
                        help="the scheduler names every step's sequences, the steady one too (to compare)")


class _Clock:
    """The thread CPU time spent on the block manager's side and on the executor's, in seconds; the calls."""

    def __init__(self) -> None:
        self.block_manager = self.executor = 0.0
        self.block_manager_calls = 0


class _Answered:
    def __init__(self, response: bytes) -> None:
        self.response = response

    def result(self) -> StepAnswer:
        return bm_codec.answer_from_proto(bm_pb.StepResponse.FromString(self.response))


class WireBlockManager:
    """The block manager's port as the frontend's gRPC client has it, the servicer's side timed apart."""

    def __init__(self, manager: BlockManager, clock: _Clock) -> None:
        self.manager, self.servicer, self.clock = manager, BlockManagerServicer(manager), clock

    def send(self, ops: Sequence[Op]) -> _Answered:
        request = bm_codec.step_to_proto(ops).SerializeToString()
        start = time.thread_time()
        response = self.servicer._step(bm_pb.StepRequest.FromString(request)).SerializeToString()
        self.clock.block_manager += time.thread_time() - start
        self.clock.block_manager_calls += 1
        return _Answered(response)

    def step(self, ops: Sequence[Op]) -> StepAnswer:
        return self.send(ops).result()

    def stats(self) -> BlockStats:
        return self.manager.stats()

    def reset(self) -> BlockStats:
        self.manager.reset()
        return self.manager.stats()


class _Ran:
    def __init__(self, response: bytes) -> None:
        self.response = response

    def result(self) -> list[SampledToken]:
        return ex_codec.tokens_from_proto(ex_pb.ExecuteResponse.FromString(self.response))


class WireExecutor:
    """The executor's port as the frontend's gRPC client has it (held inputs included); the servicer's accepting
    and the stand-in's sampling timed apart. Records how many sequences each step decoded."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.held = clock, SentInputs()
        self.servicer = ExecutorServicer(ExecutorConfig(model="stand-in"))
        self.servicer.runner = StandInRunner(0.0, VOCAB_SIZE, Timeline())  # type: ignore[assignment]
        self.servicer.info = ex_pb.InfoResponse(block_size=BLOCK_SIZE)
        self.decodes: list[int] = []  # per step: its sequences if every one decoded one token, else 0
        self.unnamed: list[bool] = []  # per step: whether the scheduler sent it as the last batch again, no rows

    def submit(self, step: StepInput) -> _Ran:
        self.unnamed.append(step.same_batch and not step.sequences)
        request = ex_codec.step_to_proto(step, 0, self.held).SerializeToString()
        start = time.thread_time()
        accepted = self.servicer.accept(ex_pb.ExecuteRequest.FromString(request))
        assert self.servicer.runner is not None
        response = ex_codec.tokens_to_proto(self.servicer.runner.execute(accepted)).SerializeToString()
        self.clock.executor += time.thread_time() - start
        seqs = accepted.sequences
        self.decodes.append(len(seqs) if all(len(s.token_ids) == 1 for s in seqs) else 0)
        return _Ran(response)


def expected_token(position: int) -> int:
    """The stand-in's token for a position (StandInRunner.execute)."""
    return 1 + position * 7919 % (VOCAB_SIZE - 1)


def measure(num_seqs: int, tokens: int, local_decodes: bool = True,
            spare_lookahead: int = SchedulerConfig.spare_lookahead, repeat_batches: bool = True) -> dict[str, float]:
    """One run: `num_seqs` requests at once, to the end; ms of CPU per step in the steady window, per side."""
    clock = _Clock()
    max_len = PROMPT_LEN + BLOCK_SIZE + tokens
    num_blocks = num_seqs * -(-max_len // BLOCK_SIZE) + 8
    manager = BlockManager(num_blocks, BLOCK_SIZE)
    config = SchedulerConfig(BLOCK_SIZE, 2048, max_num_seqs=num_seqs,
                             max_num_batched_tokens=max(512, num_seqs * (PROMPT_LEN + BLOCK_SIZE)),
                             local_decodes=local_decodes, spare_lookahead=spare_lookahead,
                             repeat_batches=repeat_batches)
    executor = WireExecutor(clock)
    limits = EngineLimits(VOCAB_SIZE, 2048, num_blocks, BLOCK_SIZE, frozenset({0}))
    engine = Engine(Scheduler(config, WireBlockManager(manager, clock)), executor, limits,
                    CacheIdentity("bench-host-step", "", "", "float32", BLOCK_SIZE))
    params = GenerationParams(max_tokens=tokens, ignore_eos=True)
    requests: list[Request] = []
    for i in range(num_seqs):
        prompt = [1 + (i * 31 + j) % 1000 for j in range(PROMPT_LEN + i % BLOCK_SIZE)]
        requests.append(engine.enqueue(f"r{i}", prompt, params, final_only=True))
    steady: list[tuple[float, float, float, int, bool]] = []  # the steps that sent a step decoding every sequence
    while engine.has_work:
        start, bm0, ex0, sent = time.thread_time(), clock.block_manager, clock.executor, len(executor.decodes)
        calls = clock.block_manager_calls
        engine.step()
        bm, ex = clock.block_manager - bm0, clock.executor - ex0
        if executor.decodes[sent:] == [num_seqs]:
            steady.append((time.thread_time() - start - bm - ex, bm, ex, clock.block_manager_calls - calls,
                           executor.unnamed[-1]))
    for request in requests:  # every token arrived once, in order: what the stand-in sampled
        (seq,) = request.seqs
        prompt_len = len(request.prompt_token_ids)
        wanted = [expected_token(p) for p in range(prompt_len, prompt_len + tokens)]
        if seq.token_ids[prompt_len:] != wanted or seq.finish_reason is not FinishReason.LENGTH:
            raise RuntimeError(f"request {request.request_id}: not the stand-in's {tokens} tokens")
    window = steady[EDGE_STEPS:-EDGE_STEPS] if len(steady) > 2 * EDGE_STEPS + 1 else steady
    if not window:
        raise RuntimeError(f"no step decoded all {num_seqs} sequences: raise --tokens")
    fe, bm, ex = (statistics.fmean(step[side] for step in window) * 1e3 for side in range(3))
    return {"frontend": fe, "block_manager": bm, "executor_host": ex, "total": fe + bm + ex,
            "steps": float(len(window)), "calls": statistics.fmean(step[3] for step in window),
            "unnamed": statistics.fmean(step[4] for step in window)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(n) for n in args.seqs.split(",")]
    result: dict[str, Any] = {
        "what": "host CPU of a steady decode step per side, ms, one process and thread, no gRPC (module docstring)",
        "tokens": args.tokens, "repeats": args.repeats, "local_decodes": args.local_decodes,
        "spare_lookahead": args.spare_lookahead, "repeat_batches": args.repeat_batches,
    }
    frozen, thresholds = gc.get_freeze_count(), gc.get_threshold()
    gc.collect()
    gc.freeze()  # the collector as the services set it (services/common/grpc_server.py)
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        # discarded: the first run in a process pays for its cold code paths
        measure(min(counts), args.tokens, args.local_decodes, args.spare_lookahead, args.repeat_batches)
        for n in counts:
            runs = [measure(n, args.tokens, args.local_decodes, args.spare_lookahead, args.repeat_batches)
                    for _ in range(args.repeats)]
            for side in ("frontend", "block_manager", "executor_host", "total"):
                result[f"{side}_ms_per_step_{n}"] = round(statistics.median(r[side] for r in runs), 4)
            result[f"steps_{n}"] = int(min(r["steps"] for r in runs))
            result[f"block_manager_calls_per_step_{n}"] = round(statistics.median(r["calls"] for r in runs), 3)
            # the steady steps the scheduler sent as the last batch again, without rows (SchedulerConfig.repeat_batches)
            result[f"unnamed_steps_frac_{n}"] = round(statistics.median(r["unnamed"] for r in runs), 3)
    finally:
        gc.set_threshold(*thresholds)
        if not frozen:
            gc.unfreeze()
    if len(counts) > 1:  # what one more running sequence costs, all sides together
        low, high = min(counts), max(counts)
        extra = result[f"total_ms_per_step_{high}"] - result[f"total_ms_per_step_{low}"]
        result["total_us_per_extra_seq"] = round(1e3 * extra / (high - low), 3)
    return result


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
