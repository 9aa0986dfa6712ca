"""The block manager's KV events to its subscribers (the pod's frontend relays them to routers).

The manager records its prefix index's changes (`BlockManager.record_kv_events`); the server takes one batch
after each applied Step or Reset and hands it to `publish`. Steps never wait on a subscriber: each has a
bounded queue, and one that falls `MAX_QUEUED_BATCHES` behind loses its subscription (its stream ends
RESOURCE_EXHAUSTED). Dropping batches silently would leave it a view it cannot know is wrong; ended, it
subscribes again and starts over from a snapshot. With no subscriber a batch costs nothing beyond taking it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ...protos import kv_events_pb2 as pb
from ..common.errors import NotReady, OutOfCapacity
from ..common.kv_events import HEARTBEAT_S, KvEventBatch
from ..common.kv_events_codec import kv_message_to_proto
from .manager import BlockManager

MAX_QUEUED_BATCHES = 1024  # a subscriber further behind than this is ended (seconds of steps at any rate)
_HEARTBEAT_WAIT_S = HEARTBEAT_S / 2  # waits this long for a batch: heartbeats well inside the promised interval


class _Subscriber:
    def __init__(self, last_sequence: int) -> None:
        self.queue: asyncio.Queue[pb.KvEventMessage] = asyncio.Queue(MAX_QUEUED_BATCHES)
        self.last_sequence = last_sequence  # of the last message it was given
        self.overflowed = False


class KvEventPublisher:
    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self.recorder = manager.record_kv_events()
        self._subscribers: set[_Subscriber] = set()
        self._closed = asyncio.Event()

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self) -> None:
        """Takes the batch of the step just applied and queues it for every subscriber (never blocks)."""
        batch = self.recorder.take_batch()
        if not batch.events or not self._subscribers:
            return
        message = kv_message_to_proto(batch)  # converted once, shared by every subscriber
        for subscriber in list(self._subscribers):
            try:
                subscriber.queue.put_nowait(message)
            except asyncio.QueueFull:
                subscriber.overflowed = True
                self._subscribers.discard(subscriber)

    def close(self) -> None:
        """Ends every subscription (the service is stopping): each stream ends UNAVAILABLE at once."""
        self._closed.set()

    async def subscribe(self) -> AsyncIterator[pb.KvEventMessage]:
        """The snapshot, then each batch as it is published, and a heartbeat whenever nothing came for a while."""
        self.publish()  # a step that failed half-way leaves its events: they precede the snapshot's state
        snapshot = self.manager.kv_snapshot()
        subscriber = _Subscriber(snapshot.sequence)
        self._subscribers.add(subscriber)
        closed: asyncio.Future[object] = asyncio.ensure_future(self._closed.wait())
        try:
            yield kv_message_to_proto(snapshot)
            while True:
                if subscriber.overflowed:
                    raise OutOfCapacity(f"KV events: this subscriber fell {MAX_QUEUED_BATCHES} batches behind;"
                                        " subscribe again")
                message = await self._next(subscriber, closed)
                subscriber.last_sequence = message.sequence
                yield message
        finally:
            closed.cancel()
            self._subscribers.discard(subscriber)

    async def _next(self, subscriber: _Subscriber, closed: asyncio.Future[object]) -> pb.KvEventMessage:
        if not subscriber.queue.empty():
            return subscriber.queue.get_nowait()
        getting: asyncio.Future[object] = asyncio.ensure_future(subscriber.queue.get())
        try:
            done, _ = await asyncio.wait({getting, closed}, timeout=_HEARTBEAT_WAIT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            getting.cancel()
        if getting in done:
            message = getting.result()
            assert isinstance(message, pb.KvEventMessage)
            return message
        if closed in done:
            raise NotReady("the block manager is stopping")
        return kv_message_to_proto(KvEventBatch(self.recorder.epoch, subscriber.last_sequence))  # a heartbeat
