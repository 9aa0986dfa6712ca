"""The pod's KV events on its public port: the block manager's stream, relayed with the pod's load.

The block manager stays on its unix socket; a router subscribes here, under the public port's TLS and API keys.
Each downstream subscriber gets its own upstream subscription: the block manager then gives each its own
snapshot and its own bounded queue, so the relay keeps no copy of the index, a slow router holds back only its
own stream (gRPC flow control reaches the block manager, which ends that one subscription), and a handful of
router replicas cost a handful of streams. Every message gets the pod's load at the time it is sent (running and
waiting sequences, blocks in use and in all), so a router's load view is at most a heartbeat old.

When the upstream stream ends, for any reason (the block manager was lost, restarted or stopped, or ended a slow
subscription), the downstream stream ends UNAVAILABLE: the router subscribes again and meets the new epoch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio

from ...protos import block_manager_pb2_grpc
from ...protos import kv_events_pb2 as pb
from ..common.errors import NotReady
from ..common.grpc_server import CHANNEL_OPTIONS

LoadSource = Callable[[], pb.LoadReport]


class KvEventRelay:
    def __init__(self, block_manager: str) -> None:
        self.block_manager = block_manager
        self._channel: grpc.aio.Channel | None = None  # opened on the event loop, at the first subscriber
        self._closed = asyncio.Event()

    def close(self) -> None:
        """Ends every relayed stream (the frontend is stopping): each ends UNAVAILABLE at once."""
        self._closed.set()

    async def relay(self, load: LoadSource) -> AsyncIterator[pb.KvEventMessage]:
        if self._closed.is_set():
            raise NotReady("the frontend is stopping")
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.block_manager, options=CHANNEL_OPTIONS)
        call = block_manager_pb2_grpc.BlockManagerStub(self._channel).SubscribeKvEvents(pb.SubscribeKvEventsRequest())
        upstream = call.__aiter__()
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            while True:
                reading = asyncio.ensure_future(upstream.__anext__())
                await asyncio.wait({reading, closed}, return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    reading.cancel()
                    raise NotReady("the frontend is stopping")
                try:
                    message = reading.result()
                except StopAsyncIteration:
                    raise NotReady("the block manager ended its KV events: subscribe again") from None
                except grpc.aio.AioRpcError as exc:
                    raise NotReady(f"the block manager's KV events ended ({exc.code().name}: {exc.details()}):"
                                   " subscribe again") from None
                message.load.CopyFrom(load())
                yield message
        finally:
            closed.cancel()
            call.cancel()
