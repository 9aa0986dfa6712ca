"""The block manager's KV-event publisher in process: what each subscriber is sent, a slow one ended instead of
holding the steps back, and every stream ended at a stop (the gRPC path: tests/integration/test_kv_events.py)."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.services.block_manager.kv_publisher import MAX_QUEUED_BATCHES, KvEventPublisher
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.block_manager.prefix_hash import block_hash
from pagedserve.services.common.errors import NotReady, OutOfCapacity
from pagedserve.services.common.kv_events import BlocksStored, KvEventBatch, KvSnapshot
from pagedserve.services.common.kv_events_codec import kv_message_from_proto

NS = b"n" * 16


def store(manager: BlockManager, seq_id: int, publisher: KvEventPublisher) -> bytes:
    """One sequence's full block computed and registered, then its step's batch published; returns its key."""
    tokens = [seq_id, seq_id, 7, 7]
    manager.create(seq_id, [*tokens, 1], NS)
    manager.reserve(seq_id, 4)
    manager.commit(seq_id, 4)
    manager.free(seq_id)
    publisher.publish()
    return block_hash(NS, tokens)


def test_a_subscriber_gets_the_snapshot_then_each_batch_then_heartbeats() -> None:
    async def scenario() -> None:
        manager = BlockManager(num_blocks=4096, block_size=4)
        publisher = KvEventPublisher(manager)
        first = store(manager, 1, publisher)
        stream = publisher.subscribe()
        snapshot = kv_message_from_proto(await anext(stream))
        assert snapshot == KvSnapshot(manager.instance_id, 1, frozenset({first}))
        assert publisher.num_subscribers == 1
        second = store(manager, 2, publisher)
        publisher.publish()  # a step that changed nothing: no batch
        batch = kv_message_from_proto(await anext(stream))
        assert batch == KvEventBatch(manager.instance_id, 2, (BlocksStored((second,)),))
        heartbeat = kv_message_from_proto(await asyncio.wait_for(anext(stream), timeout=2.0))
        assert heartbeat == KvEventBatch(manager.instance_id, 2)
        await stream.aclose()
        assert publisher.num_subscribers == 0

    asyncio.run(scenario())


def test_a_slow_subscriber_is_ended_and_the_others_go_on() -> None:
    async def scenario() -> None:
        manager = BlockManager(num_blocks=4096, block_size=4)
        publisher = KvEventPublisher(manager)
        slow, keeping_up = publisher.subscribe(), publisher.subscribe()
        await anext(slow)
        await anext(keeping_up)
        sequences = []
        for seq_id in range(MAX_QUEUED_BATCHES + 1):  # never blocks, however far behind `slow` is
            store(manager, seq_id, publisher)
            sequences.append(kv_message_from_proto(await anext(keeping_up)).sequence)
        assert publisher.num_subscribers == 1  # `slow` overflowed and was dropped
        with pytest.raises(OutOfCapacity, match="fell 1024 batches behind"):
            await anext(slow)
        assert sequences == list(range(1, MAX_QUEUED_BATCHES + 2))

    asyncio.run(scenario())


def test_close_ends_every_stream() -> None:
    async def scenario() -> None:
        publisher = KvEventPublisher(BlockManager(num_blocks=8, block_size=4))
        stream = publisher.subscribe()
        await anext(stream)
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)
        publisher.close()
        with pytest.raises(NotReady):
            await asyncio.wait_for(waiting, timeout=1.0)

    asyncio.run(scenario())
