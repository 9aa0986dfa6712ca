"""KV events and the cache identity on the wire (kv_events.proto, inference.proto's CacheIdentity), both ways.

One module that the publisher (the block manager), the relay (the pod's frontend) and every subscriber (the
router) import, so that a field is converted in one place: kv_events.py holds the types, this their messages.
"""

from __future__ import annotations

from ...protos import inference_pb2
from ...protos import kv_events_pb2 as pb
from .cache_identity import CacheIdentity
from .kv_events import AllCleared, BlocksRemoved, BlocksStored, KvEvent, KvEventBatch, KvSnapshot

KvMessage = KvSnapshot | KvEventBatch


def kv_event_to_proto(event: KvEvent) -> pb.KvEvent:
    match event:
        case BlocksStored():
            return pb.KvEvent(stored=pb.BlockHashes(block_hashes=event.block_hashes))
        case BlocksRemoved():
            return pb.KvEvent(removed=pb.BlockHashes(block_hashes=event.block_hashes))
        case AllCleared():
            return pb.KvEvent(cleared=pb.AllCleared())
    raise AssertionError(f"unhandled KV event {event!r}")


def kv_event_from_proto(event: pb.KvEvent) -> KvEvent:
    """ValueError for an event that sets no kind (a publisher of another version, or garbage)."""
    kind = event.WhichOneof("kind")
    if kind == "stored":
        return BlocksStored(tuple(event.stored.block_hashes))
    if kind == "removed":
        return BlocksRemoved(tuple(event.removed.block_hashes))
    if kind == "cleared":
        return AllCleared()
    raise ValueError("KV event: no kind set")


def kv_message_to_proto(message: KvMessage) -> pb.KvEventMessage:
    """The message without a load report (the block manager's; the pod's frontend adds its load)."""
    if isinstance(message, KvSnapshot):
        return pb.KvEventMessage(epoch=message.epoch, sequence=message.sequence,
                                 snapshot=pb.BlockHashes(block_hashes=message.block_hashes))  # any order: a set
    return pb.KvEventMessage(epoch=message.epoch, sequence=message.sequence,
                             batch=pb.KvEventBatch(events=[kv_event_to_proto(e) for e in message.events]))


def kv_message_from_proto(message: pb.KvEventMessage) -> KvMessage:
    """A snapshot or a batch (a heartbeat is a batch with no events); ValueError when the body is missing. The
    load report, if any, is the caller's to read (`message.load`, `HasField("load")`)."""
    body = message.WhichOneof("body")
    if body == "snapshot":
        return KvSnapshot(message.epoch, message.sequence, frozenset(message.snapshot.block_hashes))
    if body == "batch":
        return KvEventBatch(message.epoch, message.sequence,
                            tuple(kv_event_from_proto(e) for e in message.batch.events))
    raise ValueError("KV event message: neither a snapshot nor a batch")


def cache_identity_to_proto(identity: CacheIdentity) -> inference_pb2.CacheIdentity:
    return inference_pb2.CacheIdentity(
        model_digest=identity.model_digest, tokenizer=identity.tokenizer, chat_template=identity.chat_template,
        kv_dtype=identity.kv_dtype, block_size=identity.block_size, adapter=identity.adapter)


def cache_identity_from_proto(identity: inference_pb2.CacheIdentity) -> CacheIdentity:
    """ValueError for a block size of 0 (a pod that sent none)."""
    return CacheIdentity(model_digest=identity.model_digest, tokenizer=identity.tokenizer,
                         chat_template=identity.chat_template, kv_dtype=identity.kv_dtype,
                         block_size=identity.block_size, adapter=identity.adapter)
