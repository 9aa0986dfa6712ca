"""`pagedserve executor`: the model behind gRPC. Loads weights, sizes the KV cache, warms up, then serves.

Health stays NOT_SERVING until the weights are loaded and a warm-up step has run. Steps run one at a time
on a dedicated thread, so the event loop keeps answering health checks during a forward pass.
"""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc.aio

from ...protos import executor_pb2 as pb
from ...protos import executor_pb2_grpc as pb_grpc
from ..common.errors import NotReady
from ..common.grpc_server import GrpcService, run, serve_until_signalled
from .engine_config import build_runner
from .options import ExecutorConfig, add_executor_arguments
from .runner import ModelRunner
from .step_types import LAST_SAMPLED, SamplingParams, SequenceInput, StepInput

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name


def step_from_proto(request: pb.ExecuteRequest) -> StepInput:
    sequences = []
    for seq in request.sequences:
        sampling = None
        if seq.sample:
            s = seq.sampling
            sampling = SamplingParams(
                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if s.top_p > 0 else 1.0,
                seed=s.seed, num_top_logprobs=s.num_top_logprobs,
            )
        sequences.append(SequenceInput(
            seq.seq_id, list(seq.token_ids), seq.start_position, list(seq.block_table), list(seq.slot_mapping),
            sampling,
        ))
    return StepInput(
        sequences,
        swap_out=[(c.src, c.dst) for c in request.swap_out],
        swap_in=[(c.src, c.dst) for c in request.swap_in],
        copies=[(c.src, c.dst) for c in request.copies],
        step_id=request.step_id,
    )


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.runner: ModelRunner | None = None
        self.info: pb.InfoResponse | None = None
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")
        self.last_queued = 0  # the last numbered step handed to the step thread
        self.num_outstanding = 0  # steps handed to the step thread, not ended
        self.order = asyncio.Condition()

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
        step = step_from_proto(request)
        if step.step_id and any(seq.token_ids[:1] == [LAST_SAMPLED] for seq in step.sequences):
            # step N+1 is sent before step N answers: it must not be queued for the step thread (which runs
            # steps in the order they are queued) before step N, while step N may still come
            async with self.order:
                await self.order.wait_for(lambda: self.last_queued >= step.step_id - 1 or not self.num_outstanding)
        running = asyncio.get_running_loop().run_in_executor(self.thread, runner.execute, step)
        self.num_outstanding += 1
        async with self.order:
            self.last_queued = step.step_id or self.last_queued
            self.order.notify_all()
        try:
            tokens = await running
        finally:
            self.num_outstanding -= 1
            async with self.order:
                self.order.notify_all()
        return pb.ExecuteResponse(tokens=[
            pb.SampledToken(seq_id=t.seq_id, token_id=t.token_id, logprob=t.logprob,
                            top_token_ids=t.top_token_ids, top_logprobs=t.top_logprobs)
            for t in tokens
        ])

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        if self.info is None:
            raise NotReady("the model is still loading")
        return self.info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50062", help="unix:PATH or HOST:PORT")
    add_executor_arguments(parser)


async def serve(args: argparse.Namespace) -> None:
    servicer = ExecutorServicer(ExecutorConfig.from_args(args))
    service = GrpcService(args.listen, [SERVICE_NAME])
    pb_grpc.add_ExecutorServicer_to_server(servicer, service.server)
    await serve_until_signalled(service, warm_up=servicer.load)


def main(args: argparse.Namespace) -> None:
    run(serve(args), "executor")
