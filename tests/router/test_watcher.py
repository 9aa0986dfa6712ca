"""A pod's watcher against a scripted pod: what each end of a session does to the fleet (gaps, failures, silence,
refusals), and that a session always starts over. The stub plays the pod's two RPCs as grpc.aio's stubs do
(awaitable ListModels, SubscribeKvEvents with `read()` and `cancel()`); the real pods' side is in
tests/integration/test_router.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import grpc.aio

from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import kv_events_pb2 as kv
from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.common.kv_events_codec import cache_identity_to_proto
from pagedserve.services.router import watcher as watcher_module
from pagedserve.services.router.choice import Chooser
from pagedserve.services.router.fleet import Fleet, PodPhase
from pagedserve.services.router.watcher import PodWatcher

POD = "127.0.0.1:7001"
IDENTITY = CacheIdentity("sha256:m", "tok", "", "float32", 4)
KEY_A, KEY_B = b"a" * 16, b"b" * 16
HANG = "hang"  # a stream that stays open and says nothing


def failure(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def model(identity: CacheIdentity | None = IDENTITY) -> pb.ModelInfo:
    info = pb.ModelInfo(name="m", block_size=4)
    if identity is not None:
        info.cache_identity.CopyFrom(cache_identity_to_proto(identity))
    return info


def snapshot(epoch: str, sequence: int, *keys: bytes) -> kv.KvEventMessage:
    return kv.KvEventMessage(epoch=epoch, sequence=sequence, snapshot=kv.BlockHashes(block_hashes=keys),
                             load=kv.LoadReport(num_running=1, num_total_blocks=64))


def stored(epoch: str, sequence: int, *keys: bytes) -> kv.KvEventMessage:
    event = kv.KvEvent(stored=kv.BlockHashes(block_hashes=keys))
    return kv.KvEventMessage(epoch=epoch, sequence=sequence, batch=kv.KvEventBatch(events=[event]))


class Call:
    def __init__(self, script: list[Any]) -> None:
        self.script, self.cancelled = list(script), False

    async def read(self) -> Any:
        if not self.script:
            return grpc.aio.EOF
        item = self.script.pop(0)
        if item == HANG:
            await asyncio.sleep(3600)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class ScriptedPod:
    """ListModels answers from `models` (the last one again when they run out); each subscription plays the next
    script of `streams` (then streams that hang)."""

    def __init__(self, models: list[pb.ModelInfo | Exception], streams: list[list[Any]]) -> None:
        self.models, self.streams = models, streams
        self.listed = 0
        self.calls: list[Call] = []
        self.metadata: list[Any] = []

    async def ListModels(self, request: pb.ListModelsRequest, metadata: Any = (), timeout: float = 0) -> Any:
        answer = self.models[min(self.listed, len(self.models) - 1)]
        self.listed += 1
        self.metadata.append(metadata)
        if isinstance(answer, Exception):
            raise answer
        return pb.ListModelsResponse(models=[answer])

    def SubscribeKvEvents(self, request: kv.SubscribeKvEventsRequest, metadata: Any = ()) -> Call:
        call = Call(self.streams[len(self.calls)] if len(self.calls) < len(self.streams) else [HANG])
        self.calls.append(call)
        return call


def watch(pod: ScriptedPod, until: Callable[[Fleet], bool], fleet: Fleet | None = None, **options: Any
          ) -> tuple[Fleet, list[str]]:
    """Runs a watcher until `until(fleet)` holds (or fails after 5 s); returns the fleet and the models seen."""
    fleet = fleet or Fleet([POD], Chooser())
    seen: list[str] = []

    async def run() -> None:
        watcher = PodWatcher(fleet, POD, pod, (("authorization", "Bearer router-key"),),  # type: ignore[arg-type]
                             on_model=lambda address, info: seen.append(info.name), **options)
        task = asyncio.ensure_future(watcher.run())
        try:
            for _ in range(500):
                if until(fleet):
                    return
                assert not task.done(), task
                await asyncio.sleep(0.01)
            raise AssertionError(f"never happened: {fleet.pods[POD]}")
        finally:
            task.cancel()

    _run(run())
    return fleet, seen


def _run(coroutine: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coroutine)


def test_a_gap_resubscribes_for_a_snapshot_on_the_same_session() -> None:
    pod = ScriptedPod([model()], [
        [snapshot("e1", 3, KEY_A), stored("e1", 4, KEY_B), stored("e1", 6, b"c" * 16)],  # 5 was lost
        [snapshot("e1", 6, KEY_B), HANG],
    ])
    fleet, seen = watch(pod, lambda f: len(pod.calls) == 2 and f.pods[POD].phase == PodPhase.IN_SYNC)
    assert pod.listed == 1 and seen == ["m"]  # no new identification for a gap
    assert pod.calls[0].cancelled  # the broken subscription is given up
    assert fleet.index.longest_prefix(POD, [KEY_B]) == 1 and fleet.index.longest_prefix(POD, [KEY_A]) == 0
    load = fleet.pods[POD].load
    assert load is not None and load.num_running == 1
    assert pod.metadata == [(("authorization", "Bearer router-key"),)]


def test_a_failed_stream_takes_the_pod_down_until_it_answers_again(monkeypatch: Any) -> None:
    monkeypatch.setattr(watcher_module, "MIN_BACKOFF_S", 0.01)
    pod = ScriptedPod([model(), failure(grpc.StatusCode.UNAVAILABLE, "Connection refused"), model()], [
        [snapshot("e1", 0, KEY_A), failure(grpc.StatusCode.UNAVAILABLE, "Socket closed")],
        [snapshot("e2", 0), HANG],
    ])
    downs: list[str] = []

    def until(fleet: Fleet) -> bool:
        record = fleet.pods[POD]
        if record.phase == PodPhase.DOWN and record.reason not in downs:
            downs.append(record.reason)
        return len(pod.calls) == 2 and record.phase == PodPhase.IN_SYNC

    fleet, _ = watch(pod, until)
    assert downs == ["UNAVAILABLE: Socket closed", "UNAVAILABLE: Connection refused"]
    assert pod.listed == 3 and fleet.index.num_cached_blocks(POD) == 0  # the new epoch's (empty) snapshot


def test_a_silent_stream_or_an_ended_one_is_a_down_pod() -> None:
    silent = ScriptedPod([model()], [[snapshot("e1", 0), HANG]])
    fleet, _ = watch(silent, lambda f: f.pods[POD].phase == PodPhase.DOWN, silence_s=0.1)
    assert fleet.pods[POD].reason == "no KV event for 0.1 s" and not fleet.available
    ended = ScriptedPod([model()], [[snapshot("e1", 0)]])
    fleet, _ = watch(ended, lambda f: f.pods[POD].phase == PodPhase.DOWN)
    assert fleet.pods[POD].reason == "its KV event stream ended"
    garbled = ScriptedPod([model()], [[kv.KvEventMessage(epoch="e1", sequence=0)]])
    fleet, _ = watch(garbled, lambda f: f.pods[POD].phase == PodPhase.DOWN)
    assert fleet.pods[POD].reason.startswith("a malformed KV event message (")


def test_a_pod_of_another_model_is_refused_and_never_subscribed() -> None:
    fleet = Fleet([POD, "127.0.0.1:7002"], Chooser())
    fleet.identify("127.0.0.1:7002", "m", IDENTITY)  # the fleet's identity comes from another pod
    other = CacheIdentity("sha256:other", "tok", "", "float32", 8)
    pod = ScriptedPod([model(other)], [])
    fleet, seen = watch(pod, lambda f: f.pods[POD].phase == PodPhase.REFUSED, fleet=fleet)
    assert "model_digest: 'sha256:m' here, 'sha256:other' there; block_size: 4 here, 8 there" in \
        fleet.pods[POD].reason
    assert pod.calls == [] and seen == []
