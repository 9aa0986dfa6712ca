"""A pod's KV events through real processes: SubscribeKvEvents on the frontend's public port, relaying the block
manager's stream with the pod's load.

What a router relies on, each checked here: a snapshot first; the keys a request's prompt stores are exactly those
the router computes (prompt_blocks.chained_block_hashes from ListModels' cache identity and the tenant's salt,
derived from the fleet's shared secret file); batches numbered one apart; heartbeats while idle; the load on every
message; a later subscriber's snapshot holding the keys; evictions of a small cache as `removed`; a restarted
block manager ends the stream UNAVAILABLE, and the next subscription is in a new epoch. (Unauthenticated calls:
test_security.py, with every other method.)"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from polling import free_port, wait_for

from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.protos import kv_events_pb2 as kv_pb
from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.common.cache_salt import load_secret, tenant_salt
from pagedserve.services.common.kv_events import HEARTBEAT_S, BlocksRemoved, BlocksStored, KvEventBatch, KvSnapshot
from pagedserve.services.common.kv_events_codec import cache_identity_from_proto, kv_message_from_proto
from pagedserve.services.common.processes import start_service, stop_service
from pagedserve.services.router.prompt_blocks import chained_block_hashes

NUM_BLOCKS = 40
BLOCK_SIZE = 4
PROMPT_TOKENS = 5 * BLOCK_SIZE + 1  # five full blocks; with 2 new tokens the sixth never fills
VOCAB = 200  # token ids drawn below every tiny model's vocabulary


class Pod:
    """The three components started one by one (so that the block manager can be restarted on its socket)."""

    def __init__(self, model: Path, run_dir: Path, secret_file: Path) -> None:
        self.executor = start_service(["executor", "--model", str(model), "--device", "cpu", "--block-size",
                                       str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--threads", "1"],
                                      f"unix:{run_dir}/executor.sock")
        self.block_manager_args = ["block-manager", "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                                   "--check-integrity"]
        self.block_manager_listen = f"unix:{run_dir}/block-manager.sock"
        self.block_manager = start_service(self.block_manager_args, self.block_manager_listen)
        self.frontend = start_service(
            ["frontend", "--executor", self.executor.address, "--block-manager", self.block_manager.address,
             "--model", str(model), "--step-timeout", "5", "--recovery-timeout", "60",
             "--cache-salt-secret-file", str(secret_file)], f"127.0.0.1:{free_port()}")
        self.channel = grpc.insecure_channel(self.frontend.address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.identity = cache_identity_from_proto(
            self.stub.ListModels(pb.ListModelsRequest(), timeout=30).models[0].cache_identity)

    def generate(self, token_ids: list[int], metadata: list[tuple[str, str]], max_tokens: int = 2) -> pb.Usage:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=token_ids),
                                     params=pb.GenerationParameters(max_tokens=max_tokens, ignore_eos=True))
        return self.stub.Complete(request, timeout=60, metadata=metadata).usage

    def restart_block_manager(self) -> None:
        self.block_manager.proc.kill()
        self.block_manager.proc.wait()
        self.block_manager = start_service(self.block_manager_args, self.block_manager_listen)

    def stop(self) -> None:
        self.channel.close()
        for service in (self.frontend, self.block_manager, self.executor):
            stop_service(service)


class Subscription:
    """One SubscribeKvEvents stream read on a thread; checks the numbering of every message as it comes."""

    def __init__(self, stub: pb_grpc.InferenceStub, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.call = stub.SubscribeKvEvents(kv_pb.SubscribeKvEventsRequest(), metadata=list(metadata), timeout=120)
        self.messages: queue.Queue[tuple[float, kv_pb.KvEventMessage] | grpc.RpcError] = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.snapshot = self.next()
        assert isinstance(kv_message_from_proto(self.snapshot), KvSnapshot)
        self.epoch, self.sequence = self.snapshot.epoch, self.snapshot.sequence

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.put((time.monotonic(), message))
        except grpc.RpcError as exc:
            self.messages.put(exc)

    def next(self, timeout: float = 10.0) -> kv_pb.KvEventMessage:
        item = self.messages.get(timeout=timeout)
        if isinstance(item, grpc.RpcError):
            self.error = item
            raise item
        return item[1]

    def batch(self, timeout: float = 10.0) -> tuple[KvEventBatch, kv_pb.LoadReport]:
        """The next batch, after checking it follows the last: same epoch, sequence + 1 with events, the same
        sequence without (a heartbeat); with the pod's load."""
        message = self.next(timeout)
        batch = kv_message_from_proto(message)
        assert isinstance(batch, KvEventBatch) and batch.epoch == self.epoch
        assert batch.sequence == self.sequence + (1 if batch.events else 0), (self.sequence, batch)
        assert message.HasField("load") and message.load.num_total_blocks == NUM_BLOCKS
        self.sequence = batch.sequence
        return batch, message.load

    def stored_until(self, count: int, timeout: float = 30.0) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) keys, in order, until `count` keys were stored."""
        stored: list[bytes] = []
        removed: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(stored) < count:
            batch, _ = self.batch(max(0.1, deadline - time.monotonic()))
            for event in batch.events:
                if isinstance(event, BlocksStored):
                    stored += event.block_hashes
                elif isinstance(event, BlocksRemoved):
                    removed += event.block_hashes
        return stored, removed

    def close(self) -> None:
        self.call.cancel()


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "cache-salt-secret"
    path.write_bytes(bytes(random.Random(7).randrange(256) for _ in range(48)))
    return path


@pytest.fixture(scope="module")
def pod(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, secret_file: Path) -> Iterator[Pod]:
    pod = Pod(tiny_chat_model_dir, tmp_path_factory.mktemp("pod"), secret_file)
    yield pod
    pod.stop()


def prompt(seed: int) -> list[int]:
    draw = random.Random(seed)
    return [draw.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)]


def test_list_models_carries_the_cache_identity(pod: Pod) -> None:
    identity = pod.identity
    assert isinstance(identity, CacheIdentity) and identity.block_size == BLOCK_SIZE
    assert identity.model_digest and identity.tokenizer and identity.kv_dtype == "float32"


@pytest.mark.parametrize("tenant", ["", "alpha"])
def test_a_prompt_stores_the_keys_the_router_computes(pod: Pod, secret_file: Path, tenant: str) -> None:
    """Anonymous (no key: salt b""), and a tenant (without a keys file its key is its name), whose salt a router
    derives from the same secret file as the pod."""
    subscription = Subscription(pod.stub)
    try:
        snapshot = kv_message_from_proto(subscription.snapshot)
        assert isinstance(snapshot, KvSnapshot) and snapshot.epoch
        assert subscription.snapshot.load.num_total_blocks == NUM_BLOCKS
        tokens = prompt(seed=len(tenant) + 1)
        salt = tenant_salt(load_secret(str(secret_file)), tenant, "")
        assert bool(salt) == bool(tenant)
        metadata = [("x-api-key", tenant)] if tenant else []
        assert pod.generate(tokens, metadata).cached_prompt_tokens == 0
        stored, _ = subscription.stored_until(5)
        expected = chained_block_hashes(tokens, pod.identity.namespace(salt), BLOCK_SIZE, 5)
        assert stored == expected
        assert not set(expected) & snapshot.block_hashes
        # the prediction is the pod's: the same prompt again hits exactly those blocks
        assert pod.generate(tokens, metadata).cached_prompt_tokens == 5 * BLOCK_SIZE
        assert pod.generate(tokens, [("x-api-key", "other")]).cached_prompt_tokens == 0  # another namespace
        stored, _ = subscription.stored_until(5)
        assert not set(stored) & set(expected)
    finally:
        subscription.close()


def test_heartbeats_and_load_flow_and_a_later_snapshot_holds_the_keys(pod: Pod) -> None:
    first = Subscription(pod.stub)
    try:
        tokens = prompt(seed=11)
        busy: list[kv_pb.LoadReport] = []
        running = threading.Thread(target=lambda: pod.generate(tokens, [], max_tokens=60))
        running.start()
        stored: list[bytes] = []
        while len(stored) < 5 + 60 // BLOCK_SIZE - 1:  # the prompt's full blocks, then the output's
            batch, load = first.batch(timeout=30)
            stored += [h for e in batch.events if isinstance(e, BlocksStored) for h in e.block_hashes]
            if batch.events:
                busy.append(load)
        running.join(timeout=60)
        assert any(load.num_running == 1 and load.num_used_blocks > 0 for load in busy), busy
        assert stored[:5] == chained_block_hashes(tokens, pod.identity.namespace(b""), BLOCK_SIZE, 5)
        # idle: heartbeats (no events, the same sequence) at least every HEARTBEAT_S, with the load at rest
        wait_for(lambda: pod.stub.Status(pb.StatusRequest(), timeout=10).num_running == 0, "the pod is idle")
        heard = []
        start = time.monotonic()
        while time.monotonic() - start < 3 * HEARTBEAT_S:
            batch, load = first.batch(timeout=2 * HEARTBEAT_S)
            heard.append((batch, load))
        heartbeats = [(b, load) for b, load in heard if not b.events]
        assert len(heartbeats) >= 2 and heartbeats[-1][1].num_running == 0 and heartbeats[-1][1].num_used_blocks == 0
        assert {b.sequence for b, _ in heartbeats} == {first.sequence}
        second = Subscription(pod.stub)
        try:
            snapshot = kv_message_from_proto(second.snapshot)
            assert isinstance(snapshot, KvSnapshot) and snapshot.epoch == first.epoch
            assert snapshot.sequence == first.sequence and set(stored) <= snapshot.block_hashes
        finally:
            second.close()
    finally:
        first.close()


def test_a_small_cache_evicts_and_says_so(pod: Pod) -> None:
    """NUM_BLOCKS blocks hold a few prompts' prefixes: new prompts evict the oldest cached blocks, as `removed`."""
    subscription = Subscription(pod.stub)
    try:
        cached = set(kv_message_from_proto(subscription.snapshot).block_hashes)  # type: ignore[union-attr]
        removed: list[bytes] = []
        for seed in range(100, 100 + NUM_BLOCKS // 5 + 2):  # more prompts than the cache holds
            pod.generate(prompt(seed), [])
            stored, gone = subscription.stored_until(5)
            cached |= set(stored)
            removed += gone
        assert removed and set(removed) <= cached
        third = Subscription(pod.stub)
        try:
            snapshot = kv_message_from_proto(third.snapshot)
            assert not set(removed) & snapshot.block_hashes  # type: ignore[union-attr]
        finally:
            third.close()
    finally:
        subscription.close()


def test_a_restarted_block_manager_ends_the_stream_and_starts_a_new_epoch(pod: Pod) -> None:
    subscription = Subscription(pod.stub)
    try:
        epoch = subscription.epoch
        pod.restart_block_manager()
        with pytest.raises(grpc.RpcError) as info:
            while True:
                subscription.batch(timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    finally:
        subscription.close()

    def resubscribed() -> Subscription | None:
        try:
            return Subscription(pod.stub)
        except grpc.RpcError:
            return None

    again = wait_for(resubscribed, "a new subscription", timeout=60, poll_s=0.5)
    try:
        assert again.epoch != epoch
        wait_for(lambda: pod.stub.Status(pb.StatusRequest(), timeout=10).num_total_blocks == NUM_BLOCKS,
                 "the frontend recovered")
        tokens = prompt(seed=999)
        pod.generate(tokens, [])
        stored, _ = again.stored_until(5)
        assert stored[-5:] == chained_block_hashes(tokens, pod.identity.namespace(b""), BLOCK_SIZE, 5)
    finally:
        again.close()
