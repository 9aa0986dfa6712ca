"""`pagedserve executor`: the model behind gRPC. Loads weights, sizes the KV cache, warms up, then serves.

Health stays NOT_SERVING until the weights are loaded and a warm-up step has run. A frontend's steps come on
one stream, in the order they run: one at a time on a dedicated thread, so the event loop keeps reading the
next step and answering health checks during a forward pass. Steps carry
the epoch of the frontend's last `Reset`: one of an older epoch (sent before the frontend lost this
executor or its block manager) is refused, or skipped if it was queued already, and never touches the cache.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc.aio

from ...protos import executor_pb2 as pb
from ...protos import executor_pb2_grpc as pb_grpc
from ..common.addresses import add_allow_remote_argument, check_sidecar_listen
from ..common.errors import InvalidRequest, NotReady
from ..common.grpc_server import GrpcService, run, serve_until_signalled
from ..common.tracing import message_span
from .codec import EXECUTE_METHOD, SERVICE_NAME, info_to_proto, step_from_proto, tokens_to_proto
from .engine_config import build_runner
from .held_inputs import HeldInputs
from .options import ExecutorConfig, add_executor_arguments
from .runner import ModelRunner
from .step_types import SampledToken, StepInput


class _Stream:
    """One Execute call's state, as the step thread sees it."""

    failed = False


def _failed(exc: Exception) -> asyncio.Future[list[SampledToken]]:
    future: asyncio.Future[list[SampledToken]] = asyncio.get_running_loop().create_future()
    future.set_exception(exc)
    return future


class ExecutorServicer(pb_grpc.ExecutorServicer):
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.runner: ModelRunner | None = None
        self.info: pb.InfoResponse | None = None
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")
        self.epoch = 0
        self.tables = HeldInputs()  # the block tables and sampling parameters of the sequences running here

    async def load(self) -> None:
        """Loads the model and runs the warm-up step on the step thread, off the event loop."""
        loop = asyncio.get_running_loop()
        runner, info = await loop.run_in_executor(self.thread, build_runner, self.config)
        self.info = info_to_proto(info)
        self.runner = runner

    async def Execute(self, requests: AsyncIterator[pb.ExecuteRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExecuteResponse]:
        """Steps are queued for the step thread as they arrive (N+1 waits behind N there, not here) and answered
        in that order. The first that fails ends the stream with its status; none queued after it runs."""
        queued: asyncio.Queue[tuple[str, asyncio.Future[list[SampledToken]], StepInput | None] | None] = (
            asyncio.Queue())
        stream = _Stream()

        async def arrive() -> None:
            try:
                async for request in requests:
                    running, step = self._queue(request, stream)
                    queued.put_nowait((request.traceparent, running, step))
                    if running.done():  # refused before it was queued: nothing after it is
                        break
            except Exception as exc:  # a message that does not parse, or a stopping service: answered in turn
                queued.put_nowait(("", _failed(exc), None))
            finally:
                queued.put_nowait(None)

        arriving = asyncio.ensure_future(arrive())
        try:
            while (item := await queued.get()) is not None:
                # The step's input is held here until its answer is sent, so that it is freed on this thread,
                # not on the step thread between two steps (thousands of objects at 256 sequences: ~0.3 ms
                # the accelerator would wait).
                traceparent, running, _input = item
                with message_span(EXECUTE_METHOD, traceparent):
                    response = tokens_to_proto(await running)
                yield response
                del item, _input
        finally:
            arriving.cancel()

    def accept(self, request: pb.ExecuteRequest) -> StepInput:
        """The step a request asks for, with the held tables and sampling parameters filled in, its own recorded
        as held; or the error that refuses it (nothing recorded). Held inputs are those of the steps that
        arrived before it (a step behind a failed one never runs)."""
        if self.runner is None:
            raise NotReady("the model is still loading")
        if request.epoch != self.epoch:  # UNAVAILABLE: to its sender this executor is lost (restarted, or reset);
            # checked first: its held inputs are another epoch's, unknown here
            raise NotReady(f"epoch: the step is of epoch {request.epoch}, the executor's is {self.epoch}")
        assert self.info is not None  # loaded with the runner
        step = step_from_proto(request, self.tables, self.info.block_size)
        if step.same_batch:
            self.tables.commit_repeated(step)
        else:
            self.tables.commit(step, samplings_sent=len(request.temperature) > 0)
        return step

    def _queue(self, request: pb.ExecuteRequest,
               stream: _Stream) -> tuple[asyncio.Future[list[SampledToken]], StepInput | None]:
        """The step, queued for the step thread, and its input; or its error, to be answered in its turn. It is
        accepted here, while the step before runs, not between two steps on the step thread."""
        runner = self.runner
        try:
            step = self.accept(request)
        except Exception as exc:
            return _failed(exc), None
        assert runner is not None  # else accept refused it
        return asyncio.get_running_loop().run_in_executor(self.thread, self._run_step, runner, step, request.epoch,
                                                          stream), step

    def _run_step(self, runner: ModelRunner, step: StepInput, epoch: int, stream: _Stream) -> list[SampledToken]:
        """On the step thread, in step order: a step queued before a Reset, or behind a failed step of its
        stream, is void."""
        if epoch != self.epoch:
            raise NotReady(f"epoch: the step is of epoch {epoch}, the executor moved on to {self.epoch}")
        if stream.failed:
            raise InvalidRequest("an earlier step on this stream failed: this one is void")
        try:
            return runner.execute(step)
        except Exception:
            stream.failed = True
            raise

    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        runner = self.runner
        if runner is None or self.info is None:
            raise NotReady("the model is still loading")
        self.epoch = request.epoch
        self.tables.clear()  # the steps queued before have theirs filled in already, and are void
        # the step thread runs in order: once this has run, every step queued before has run or been skipped
        await asyncio.get_running_loop().run_in_executor(self.thread, runner.reset)
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
    pb_grpc.add_ExecutorServicer_to_server(servicer, service.handlers)
    await serve_until_signalled(service, warm_up=servicer.load)


def main(args: argparse.Namespace) -> None:
    check_sidecar_listen("executor", args.listen, args.allow_remote)
    run(serve(args), "executor")
