"""One pod as the router follows it: its identity (ListModels), then its KV events (SubscribeKvEvents), for good.

Each session identifies the pod first, every time (a pod restarted at the same address may serve another model),
then subscribes: the stream's first message is a snapshot, the rest numbered batches and heartbeats, each with the
pod's load (kv_events.py's rules). Whatever ends a session is recorded in the fleet and the watcher starts another:
- a gap (a lost batch, another epoch): subscribed again at once, for a new snapshot, on the same connection;
- a failed call, an ended stream, or a stream silent for `STALE_AFTER_S` (a live publisher sends a heartbeat every
  `HEARTBEAT_S`): the pod is `down` (fleet.py: no request goes there), and the next session starts after a backoff
  that doubles from `MIN_BACKOFF_S` to `MAX_BACKOFF_S` and starts over at the next snapshot;
- a refused identity: asked again after `MAX_BACKOFF_S` (the pod may be replaced by one of the fleet's model).
So a pod that comes back, or a new one, takes requests within `MAX_BACKOFF_S` plus a round trip of its being up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc
import grpc.aio

from ...protos import inference_pb2 as pb
from ...protos import inference_pb2_grpc as pb_grpc
from ...protos import kv_events_pb2
from ..common.kv_events import STALE_AFTER_S, KvSnapshot
from ..common.kv_events_codec import cache_identity_from_proto, kv_message_from_proto
from .fleet import Fleet, PodPhase
from .load import LoadReport

MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0
CALL_TIMEOUT_S = 5.0  # ListModels: a pod that cannot list its model in this long is not one to route to

log = logging.getLogger(__name__)


class PodWatcher:
    """`on_model(address, model)`: called with each accepted pod's ModelInfo (the server learns its tokenizer)."""

    def __init__(self, fleet: Fleet, address: str, stub: pb_grpc.InferenceStub,
                 metadata: Sequence[tuple[str, str]] = (),
                 on_model: Callable[[str, pb.ModelInfo], None] | None = None,
                 silence_s: float = STALE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet, self.address, self.stub = fleet, address, stub
        self.metadata = tuple(metadata)
        self.on_model = on_model
        self.silence_s, self.clock = silence_s, clock
        self._backoff = MIN_BACKOFF_S
        self._reported = ""  # the last phase and reason logged, so that a retry loop logs a change once

    async def run(self) -> None:
        """Follows the pod until cancelled."""
        while True:
            try:
                accepted = await self._identify()
                while accepted and await self._follow():
                    pass  # a gap: subscribe again at once
            except grpc.aio.AioRpcError as exc:
                self.fleet.down(self.address, f"{exc.code().name}: {exc.details()}")
            except TimeoutError:
                self.fleet.down(self.address, f"no KV event for {self.silence_s:g} s")
            except ValueError as exc:  # a message that breaks the contract: a publisher of another version?
                self.fleet.down(self.address, f"a malformed KV event message ({exc})")
            except EndOfStream:
                self.fleet.down(self.address, "its KV event stream ended")
            self._log_change()
            refused = self.fleet.pods[self.address].phase == PodPhase.REFUSED
            await asyncio.sleep(MAX_BACKOFF_S if refused else self._backoff)
            self._backoff = min(2 * self._backoff, MAX_BACKOFF_S)

    async def _identify(self) -> bool:
        answer = await self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata, timeout=CALL_TIMEOUT_S)
        if not answer.models:
            self.fleet.down(self.address, "its ListModels lists no model")
            return False
        model = answer.models[0]
        identity = cache_identity_from_proto(model.cache_identity) if model.HasField("cache_identity") else None
        if self.fleet.identify(self.address, model.name, identity):
            return False
        if self.on_model is not None:
            self.on_model(self.address, model)
        return True

    async def _follow(self) -> bool:
        """One subscription: True when a gap calls for another; raises when the pod fails or falls silent."""
        call = self.stub.SubscribeKvEvents(kv_events_pb2.SubscribeKvEventsRequest(), metadata=self.metadata)
        try:
            while True:
                message = await asyncio.wait_for(call.read(), self.silence_s)
                if message is grpc.aio.EOF:
                    raise EndOfStream
                assert isinstance(message, kv_events_pb2.KvEventMessage)
                now = self.clock()
                load = _load_report(message, now)
                kv_message = kv_message_from_proto(message)
                if not self.fleet.apply(self.address, kv_message, load, now):
                    self._log_change()
                    return True
                if isinstance(kv_message, KvSnapshot):
                    self._backoff = MIN_BACKOFF_S
                    self._log_change()
        finally:
            call.cancel()

    def _log_change(self) -> None:
        record = self.fleet.pods[self.address]
        state = f"{record.phase.value}" + (f": {record.reason}" if record.reason else "")
        if state == self._reported:
            return
        self._reported = state
        level = logging.INFO if record.phase in (PodPhase.IN_SYNC, PodPhase.RESYNCING) else logging.WARNING
        log.log(level, "pod %s %s", self.address, state)


class EndOfStream(Exception):
    """The pod ended its event stream (it never does while it serves)."""


def _load_report(message: kv_events_pb2.KvEventMessage, now: float) -> LoadReport | None:
    if not message.HasField("load"):
        return None
    load = message.load
    return LoadReport(load.num_running, load.num_waiting, load.num_used_blocks, load.num_total_blocks, now)
