"""`pagedserve executor`: the model behind gRPC. Loads weights, sizes the KV cache, warms up, then serves.

Health stays NOT_SERVING until the weights are loaded and a warm-up step has run. Steps run one at a time
on a dedicated thread, so the event loop keeps answering health checks during a forward pass. Steps carry
the epoch of the frontend's last `Reset`: one of an older epoch (sent before the frontend lost this
executor or its block manager) is refused, or skipped if it was queued already, and never touches the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate, chain

import grpc.aio

from ...protos import executor_pb2 as pb
from ...protos import executor_pb2_grpc as pb_grpc
from ..common.addresses import add_allow_remote_argument, check_sidecar_listen
from ..common.errors import InvalidRequest, NotReady
from ..common.grpc_server import GrpcService, run, serve_until_signalled
from .engine_config import build_runner
from .options import ExecutorConfig, add_executor_arguments
from .runner import ModelRunner
from .step_types import LAST_SAMPLED, HeldTables, SampledToken, SamplingParams, SequenceInput, StepInput

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
ORDER_WAIT_S = 2.0  # how long a step waits for the step it follows (see ExecutorServicer._after_predecessor)


def step_from_proto(r: pb.ExecuteRequest) -> StepInput:
    """Splits the packed arrays into sequences; InvalidRequest when their lengths disagree."""
    num_seqs = len(r.seq_ids)
    for name in ("num_tokens", "start_positions", "block_table_lens", "sample"):
        if len(getattr(r, name)) != num_seqs:
            raise InvalidRequest(f"{name}: {len(getattr(r, name))} entries for {num_seqs} sequences")
    num_tokens, table_lens = list(r.num_tokens), list(r.block_table_lens)
    if r.table_held:
        if len(r.table_held) != num_seqs:
            raise InvalidRequest(f"table_held: {len(r.table_held)} entries for {num_seqs} sequences (or none)")
        bad = next((i for i, (held, n) in enumerate(zip(r.table_held, table_lens, strict=True)) if held and n), None)
        if bad is not None:
            raise InvalidRequest(f"block_table_lens[{bad}]: {table_lens[bad]} blocks for a table the executor holds"
                                 " (table_held): must be 0")
    for name, wanted in (("token_ids", sum(num_tokens)), ("slot_mapping", sum(num_tokens)),
                         ("block_tables", sum(table_lens))):
        if len(getattr(r, name)) != wanted:
            raise InvalidRequest(f"{name}: {len(getattr(r, name))} entries, the sequences' lengths add up to {wanted}")
    flags = list(r.sample)
    num_sampled = sum(flags)
    for name in ("temperature", "top_k", "top_p", "seed", "num_top_logprobs"):
        if len(getattr(r, name)) != num_sampled:
            raise InvalidRequest(f"{name}: {len(getattr(r, name))} entries for {num_sampled} sequences that sample")
    top_p = list(r.top_p)
    if top_p and min(top_p) <= 0:  # unset: off
        top_p = [p if p > 0 else 1.0 for p in top_p]
    sampled = list(map(SamplingParams, r.temperature, r.top_k, top_p, r.seed, r.num_top_logprobs))
    params: Sequence[SamplingParams | None] = sampled
    if len(sampled) < num_seqs:  # some sequences do not sample (prefill chunks)
        each = iter(sampled)
        params = [next(each) if sample else None for sample in flags]
    tokens, slots, tables = list(r.token_ids), list(r.slot_mapping), list(r.block_tables)
    if num_tokens.count(1) == num_seqs:  # decodes: one token each
        token_lists, slot_lists = [[t] for t in tokens], [[s] for s in slots]
    else:
        ends = list(accumulate(num_tokens))
        token_lists = [tokens[end - n : end] for n, end in zip(num_tokens, ends, strict=True)]
        slot_lists = [slots[end - n : end] for n, end in zip(num_tokens, ends, strict=True)]
    table_lists = [tables[end - n : end] for n, end in zip(table_lens, accumulate(table_lens), strict=True)]
    # columns to rows in C (map over the columns), not one Python pass per sequence
    sequences = list(map(SequenceInput, r.seq_ids, token_lists, r.start_positions, table_lists, slot_lists, params))
    return StepInput(
        sequences,
        swap_out=[(c.src, c.dst) for c in r.swap_out],
        swap_in=[(c.src, c.dst) for c in r.swap_in],
        copies=[(c.src, c.dst) for c in r.copies],
        step_id=r.step_id,
        released_seq_ids=list(r.released_seq_ids),
    )


def tokens_to_proto(tokens: list[SampledToken]) -> pb.ExecuteResponse:
    if not tokens:
        return pb.ExecuteResponse()
    seq_ids, token_ids, logprobs, top_ids, top_values = zip(*tokens, strict=True)  # columns, in C
    response = pb.ExecuteResponse(seq_ids=seq_ids, token_ids=token_ids, logprobs=logprobs)
    if any(top_ids):
        response.num_top.extend(map(len, top_ids))
        response.top_token_ids.extend(chain.from_iterable(top_ids))
        response.top_logprobs.extend(chain.from_iterable(top_values))
    return response


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.runner: ModelRunner | None = None
        self.info: pb.InfoResponse | None = None
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")
        self.last_arrived = 0  # the newest numbered step of this epoch queued for the step thread, or refused
        self.order = asyncio.Condition()
        self.epoch = 0
        self.tables = HeldTables()  # the block tables of the sequences running here (table_held)

    async def load(self) -> None:
        """Loads the model and runs the warm-up step on the step thread, off the event loop."""
        loop = asyncio.get_running_loop()
        runner, info = await loop.run_in_executor(self.thread, build_runner, self.config)
        self.info = pb.InfoResponse(**{**vars(info), "eos_token_ids": list(info.eos_token_ids)})
        self.runner = runner

    async def Execute(self, request: pb.ExecuteRequest, context: grpc.aio.ServicerContext) -> pb.ExecuteResponse:
        runner = self.runner
        if runner is None:
            raise NotReady("the model is still loading")
        try:
            step = step_from_proto(request)
            if request.epoch != self.epoch:  # UNAVAILABLE: to its sender this executor is lost (restarted, or reset)
                raise NotReady(f"epoch: the step is of epoch {request.epoch}, the executor's is {self.epoch}")
            if step.step_id and any(seq.token_ids[:1] == [LAST_SAMPLED] for seq in step.sequences):
                await self._after_predecessor(step.step_id, request.epoch)
            running = asyncio.get_running_loop().run_in_executor(self.thread, self._run_step, runner, step,
                                                                 list(request.table_held), request.epoch)
        finally:  # queued or refused, this step has arrived: the next may go
            if request.step_id and request.epoch == self.epoch:
                async with self.order:
                    self.last_arrived = max(self.last_arrived, request.step_id)
                    self.order.notify_all()
        return tokens_to_proto(await running)

    async def _after_predecessor(self, step_id: int, epoch: int) -> None:
        """Step N asks for what step N-1 samples, and the step thread runs steps in the order they are queued:
        N waits until N-1 has arrived (queued, or refused). Both are in flight at once, and N-1 may even be read
        after N (two calls on one connection: a larger message takes longer to read). One that never comes (a
        broken client) lets N go after ORDER_WAIT_S, to fail on its LAST_SAMPLED inputs."""
        async with self.order:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.order.wait_for(
                    lambda: self.last_arrived >= step_id - 1 or self.epoch != epoch), ORDER_WAIT_S)

    def _run_step(self, runner: ModelRunner, step: StepInput, held: list[bool], epoch: int) -> list[SampledToken]:
        """On the step thread, in step order: a step queued before a Reset is void; held tables are those of
        the steps run before it."""
        if epoch != self.epoch:
            raise NotReady(f"epoch: the step is of epoch {epoch}, the executor moved on to {self.epoch}")
        step = self.tables.resolve(step, held)
        tokens = runner.execute(step)
        self.tables.commit(step)
        return tokens

    def _reset(self, runner: ModelRunner) -> None:
        runner.reset()
        self.tables.clear()

    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        runner = self.runner
        if runner is None or self.info is None:
            raise NotReady("the model is still loading")
        self.epoch = request.epoch
        # the step thread runs in order: once this has run, every step queued before has run or been skipped
        await asyncio.get_running_loop().run_in_executor(self.thread, self._reset, runner)
        async with self.order:  # steps waiting for a predecessor of the old epoch go, to be refused
            self.last_arrived = 0
            self.order.notify_all()
        return await self.Info(pb.InfoRequest(), context)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        if self.info is None:
            raise NotReady("the model is still loading")
        info = pb.InfoResponse()
        info.CopyFrom(self.info)
        info.epoch = self.epoch
        return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50062", help="unix:PATH or a loopback HOST:PORT")
    add_allow_remote_argument(parser)
    add_executor_arguments(parser)


async def serve(args: argparse.Namespace) -> None:
    servicer = ExecutorServicer(ExecutorConfig.from_args(args))
    service = GrpcService(args.listen, [SERVICE_NAME])
    pb_grpc.add_ExecutorServicer_to_server(servicer, service.server)
    await serve_until_signalled(service, warm_up=servicer.load)


def main(args: argparse.Namespace) -> None:
    check_sidecar_listen("executor", args.listen, args.allow_remote)
    run(serve(args), "executor")
