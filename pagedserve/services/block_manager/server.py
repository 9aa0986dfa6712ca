"""The block-manager sidecar: the pure core behind gRPC. One Step message per scheduler step, on a stream.

The core is synchronous and each step runs to completion without awaiting, so it is atomic with respect to
every other call on the event loop. After each Step and Reset, the prefix index's changes go out as one batch
of KV events to the subscribers of `SubscribeKvEvents` (kv_publisher.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator

import grpc.aio

from ...protos import block_manager_pb2 as pb
from ...protos import block_manager_pb2_grpc as pb_grpc
from ...protos import executor_pb2, executor_pb2_grpc, kv_events_pb2
from ..common.addresses import add_allow_remote_argument, check_sidecar_listen
from ..common.grpc_server import GrpcService, run, serve_until_signalled
from ..common.processes import wait_serving
from ..common.tracing import message_span
from .codec import SERVICE_NAME, STEP_METHOD, answer_to_proto, op_from_proto, stats_to_proto
from .kv_publisher import KvEventPublisher
from .manager import BlockManager
from .step import apply_step

log = logging.getLogger(__name__)


class BlockManagerServicer(pb_grpc.BlockManagerServicer):
    def __init__(self, manager: BlockManager, check_integrity: bool = False) -> None:
        self.manager = manager
        self.check_integrity = check_integrity  # every invariant recomputed after each change (tests, soak)
        self.events = KvEventPublisher(manager)

    async def Step(self, requests: AsyncIterator[pb.StepRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResponse]:
        async for request in requests:
            with message_span(STEP_METHOD, request.traceparent):
                response = self._step(request)
            yield response

    def _step(self, request: pb.StepRequest) -> pb.StepResponse:
        ops = [op_from_proto(i, op) for i, op in enumerate(request.ops)]
        try:
            outcomes = apply_step(self.manager, ops)
        finally:
            self.events.publish()
        if self.check_integrity:
            self.manager.check_integrity()  # an AssertionError: INTERNAL, and the frontend fails its requests
        return answer_to_proto(outcomes, self.manager.stats())

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(stats=stats_to_proto(self.manager.stats()))

    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.ResetResponse:
        self.manager.reset()
        self.events.publish()
        if self.check_integrity:
            self.manager.check_integrity()
        return pb.ResetResponse(stats=stats_to_proto(self.manager.stats()))

    async def SubscribeKvEvents(self, request: kv_events_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[kv_events_pb2.KvEventMessage]:
        async for message in self.events.subscribe():
            yield message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50061", help="unix:PATH or a loopback HOST:PORT")
    add_allow_remote_argument(parser)
    geometry = parser.add_mutually_exclusive_group(required=True)
    geometry.add_argument("--num-blocks", type=int, help="device KV blocks")
    geometry.add_argument("--geometry-from", metavar="ADDRESS",
                          help="take blocks, block size and CPU blocks from the executor at ADDRESS (in a pod)")
    parser.add_argument("--geometry-timeout", type=float, default=1800.0,
                        help="seconds to wait for the executor to load its model (with --geometry-from)")
    parser.add_argument("--block-size", type=int, default=16, help="token slots per block")
    parser.add_argument("--cpu-blocks", type=int, default=0, help="CPU swap pool size in blocks")
    parser.add_argument("--watermark", type=float, default=0.01, help="share of blocks kept for running sequences")
    parser.add_argument("--check-integrity", action="store_true",
                        help="recompute every invariant after each Step and Reset (slow: for tests and soak runs)")


def executor_geometry(address: str, timeout: float) -> tuple[int, int, int]:
    """(num_blocks, block_size, cpu_blocks) of the executor's cache, once it serves. In a pod the containers
    start together: the executor sizes the cache from the memory it finds, and the block manager follows."""
    wait_serving(address, timeout)
    with grpc.insecure_channel(address) as channel:
        info = executor_pb2_grpc.ExecutorStub(channel).Info(executor_pb2.InfoRequest(), timeout=30)
    return info.num_blocks, info.block_size, info.num_cpu_blocks


async def serve(args: argparse.Namespace) -> None:
    if args.geometry_from:
        log.info("waiting for the executor at %s", args.geometry_from)
        args.num_blocks, args.block_size, args.cpu_blocks = await asyncio.to_thread(
            executor_geometry, args.geometry_from, args.geometry_timeout)
        log.info("cache geometry from the executor: %d blocks of %d slots, %d CPU blocks", args.num_blocks,
                 args.block_size, args.cpu_blocks)
    manager = BlockManager(args.num_blocks, args.block_size, args.cpu_blocks, args.watermark)
    service = GrpcService(args.listen, [SERVICE_NAME])
    servicer = BlockManagerServicer(manager, args.check_integrity)
    pb_grpc.add_BlockManagerServicer_to_server(servicer, service.handlers)
    service.on_stop.append(servicer.events.close)  # subscriptions never end by themselves
    await serve_until_signalled(service)


def main(args: argparse.Namespace) -> None:
    check_sidecar_listen("block manager", args.listen, args.allow_remote)
    run(serve(args), "block-manager")
