"""Hypothesis fuzzing of every RPC of the three services, over real gRPC against real processes, and of the
OpenAI-compatible HTTP API (any JSON, plausible requests, raw bytes: never a 500): arbitrary and
adversarial messages (wrong and unknown ids, huge counts, huge repeated fields, out-of-range blocks, ops out
of order, empty messages, random bytes). Every answer is a status code a client can act on (OK,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE where the contract says so), never UNKNOWN or INTERNAL (an
unhandled exception); every process stays up and SERVING; the block managers recompute every invariant after
each Step and Reset (`--check-integrity`: a broken one answers INTERNAL); the pod holds no block afterwards.
The messages come from fuzz_strategies.py."""

from __future__ import annotations

import functools
import http.client
import itertools
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fuzz_strategies import (
    BLOCK_SIZE,
    CALLS,
    CHAT_VOCAB,
    CHATS,
    EPOCH,
    EXECUTOR_BLOCKS,
    GENERATE_REQUESTS,
    NAMESPACE,
    RAW,
    TEXTS,
    TINY_VOCAB,
    UINT32,
    UINT64,
    Call,
    Sequences,
    execute_requests,
    raw_payload,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from polling import free_port, wait_for

from pagedserve.protos import block_manager_pb2 as bm
from pagedserve.protos import block_manager_pb2_grpc as bm_grpc
from pagedserve.protos import executor_pb2 as ex
from pagedserve.protos import executor_pb2_grpc as ex_grpc
from pagedserve.protos import inference_pb2 as pb
from pagedserve.protos import inference_pb2_grpc as pb_grpc
from pagedserve.protos import kv_events_pb2 as kv_pb
from pagedserve.services.common.kv_events import BlocksRemoved, BlocksStored, KvEventBatch, KvSnapshot
from pagedserve.services.common.kv_events_codec import kv_message_from_proto
from pagedserve.services.common.processes import ServiceProcess, start_service, stop_service

Code = grpc.StatusCode
OK, INVALID, EXHAUSTED, UNAVAILABLE = Code.OK, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE
STACK_BLOCKS, BM_BLOCKS = 64, 8


def fuzz(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def block_manager() -> Iterator[ServiceProcess]:
    service = start_service(["block-manager", "--num-blocks", str(BM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                             "--cpu-blocks", "4", "--check-integrity"])
    yield service
    assert stop_service(service) == 0, "".join(service.output[-40:])


@pytest.fixture(scope="module")
def executor(tiny_llama_dir: Path) -> Iterator[ServiceProcess]:
    service = start_service(["executor", "--model", str(tiny_llama_dir), "--num-blocks", str(EXECUTOR_BLOCKS),
                             "--block-size", str(BLOCK_SIZE), "--device", "cpu", "--cpu-swap-mib", "1"])
    yield service
    assert stop_service(service) == 0, "".join(service.output[-40:])


class Stack:
    """A pod's three processes (the block manager checking its invariants), started one by one."""

    def __init__(self, model: Path, run_dir: Path) -> None:
        self.services: list[ServiceProcess] = []  # frontend first: the order they stop in
        try:
            self.executor = self._start(["executor", "--model", str(model), "--device", "cpu", "--block-size",
                                         str(BLOCK_SIZE), "--num-blocks", str(STACK_BLOCKS), "--cpu-swap-mib", "1"],
                                        f"unix:{run_dir}/executor.sock")
            self.block_manager = self._start(["block-manager", "--geometry-from", self.executor.address,
                                              "--check-integrity"], f"unix:{run_dir}/block-manager.sock")
            self.http_port = free_port()
            self.frontend = self._start(["frontend", "--executor", self.executor.address, "--block-manager",
                                         self.block_manager.address, "--model", str(model),
                                         "--http-listen", f"127.0.0.1:{self.http_port}"],
                                        f"127.0.0.1:{free_port()}")
        except BaseException:
            for service in self.services:
                stop_service(service)
            raise
        self.channel = grpc.insecure_channel(self.frontend.address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.bm_channel = grpc.insecure_channel(self.block_manager.address)
        self.bm_stub = bm_grpc.BlockManagerStub(self.bm_channel)

    def _start(self, args: list[str], listen: str) -> ServiceProcess:
        service = start_service(args, listen)
        self.services.insert(0, service)
        return service

    def assert_up_and_idle(self) -> None:
        """Every process serves; the requests are gone and their blocks free (aborts end within a step)."""
        for service in self.services:
            assert_serving(service)

        def idle() -> bool:
            status = self.stub.Status(pb.StatusRequest(), timeout=10)
            stats = self.bm_stub.Stats(bm.StatsRequest(), timeout=10).stats
            return (status.num_running == status.num_waiting == status.num_used_blocks == stats.num_sequences
                    == stats.num_used_blocks == 0)

        wait_for(idle, "the pod is idle and holds no block", timeout=20, poll_s=0.02)

    def stop(self) -> None:
        self.channel.close()
        self.bm_channel.close()
        codes = [stop_service(s) for s in self.services]
        assert codes == [0, 0, 0], "".join(line for s in self.services for line in s.output[-20:])


@pytest.fixture(scope="module")
def stack(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tiny_chat_model_dir, tmp_path_factory.mktemp("fuzz-pod"))
    yield stack
    stack.stop()


def assert_serving(service: ServiceProcess) -> None:
    assert service.proc.poll() is None, f"exited with {service.proc.returncode}:\n{''.join(service.output[-40:])}"
    with grpc.insecure_channel(service.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def one(method: grpc.StreamStreamMultiCallable, request: Any) -> Any:
    """A step on a stream of its own: its answer, or its error raised."""
    return next(method(iter([request]), timeout=60))


def answer(call: Callable[[], Any], allowed: set[grpc.StatusCode]) -> Any:
    """The call's response (None when it failed); fails unless its status code is in `allowed`."""
    try:
        response = call()
    except grpc.RpcError as exc:
        assert exc.code() in allowed, f"{exc.code()}: {exc.details()}"
        return None
    assert OK in allowed, "answered OK"
    return response


def first_and_cancel(stream: Any) -> Any:
    try:
        return next(stream)
    finally:
        stream.cancel()


class EventReplay:
    """A subscriber of SubscribeKvEvents on a thread: the cached keys rebuilt from the snapshot and the batches,
    each message checked as it comes (one epoch, batches numbered one apart, heartbeats repeating the number)."""

    def __init__(self, stream: Any, with_load: bool) -> None:
        self.stream, self.with_load = stream, with_load
        self.keys: set[bytes] = set()
        self.epoch, self.sequence, self.problem = "", -1, ""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for message in self.stream:
                self._apply(kv_message_from_proto(message))
                if self.with_load and not message.HasField("load"):
                    self.problem = f"no load report in {message}"
        except grpc.RpcError as exc:
            if exc.code() != Code.CANCELLED:
                self.problem = f"the stream ended {exc.code()}: {exc.details()}"
        except Exception as exc:
            self.problem = repr(exc)

    def _apply(self, message: KvSnapshot | KvEventBatch) -> None:
        if isinstance(message, KvSnapshot):
            assert self.sequence == -1, "a second snapshot"
            self.epoch, self.sequence, self.keys = message.epoch, message.sequence, set(message.block_hashes)
            return
        assert message.epoch == self.epoch and message.sequence == self.sequence + bool(message.events), message
        self.sequence = message.sequence
        for change in message.events:
            if isinstance(change, BlocksStored):
                self.keys |= set(change.block_hashes)
            elif isinstance(change, BlocksRemoved):
                self.keys -= set(change.block_hashes)
            else:
                self.keys.clear()

    def assert_matches(self, subscribe: Callable[[], Any]) -> None:
        """A fresh subscription's snapshot equals the keys replayed up to its sequence."""
        snapshot = kv_message_from_proto(first_and_cancel(subscribe()))
        assert isinstance(snapshot, KvSnapshot) and snapshot.epoch == self.epoch
        wait_for(lambda: self.problem or self.sequence >= snapshot.sequence, "the replay caught up", timeout=10,
                 poll_s=0.01)
        assert not self.problem, self.problem
        assert self.sequence == snapshot.sequence and self.keys == snapshot.block_hashes

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(timeout=10)


# ---- block manager ---------------------------------------------------------------------------------------------------

@fuzz(150)
@given(data=st.data())
def test_block_manager_steps(block_manager: ServiceProcess, data: st.DataObject) -> None:
    sequences = Sequences()
    with grpc.insecure_channel(block_manager.address) as channel:
        stub = bm_grpc.BlockManagerStub(channel)
        answer(lambda: stub.Reset(bm.ResetRequest(), timeout=30), {OK})
        for _ in range(data.draw(st.integers(1, 10), label="steps")):
            ops = data.draw(st.lists(sequences.ops(), min_size=1, max_size=3), label="ops")
            response = answer(lambda ops=ops: one(stub.Step, bm.StepRequest(ops=ops)), {OK, INVALID})
            if response is not None:
                assert len(response.results) == len(ops)
                sequences.update(ops, response)
        stats = answer(lambda: stub.Stats(bm.StatsRequest(), timeout=30), {OK}).stats
    assert stats.num_free_blocks + stats.num_used_blocks == stats.num_total_blocks == BM_BLOCKS
    assert (stats.num_sequences, stats.num_swapped_sequences) == (len(sequences.resident | sequences.swapped),
                                                                  len(sequences.swapped))
    assert_serving(block_manager)


@fuzz(60)
@given(data=st.data())
def test_block_manager_kv_events(block_manager: ServiceProcess, data: st.DataObject) -> None:
    """Whatever the steps do to the prefix index (admissions, commits, evictions, swaps, refusals, invalid steps,
    a Reset), a subscriber's replay of the events equals a later snapshot."""
    sequences = Sequences()
    with grpc.insecure_channel(block_manager.address) as channel:
        stub = bm_grpc.BlockManagerStub(channel)
        subscribe = functools.partial(stub.SubscribeKvEvents, kv_pb.SubscribeKvEventsRequest(), timeout=60)
        replay = EventReplay(subscribe(), with_load=False)
        try:
            answer(lambda: stub.Reset(bm.ResetRequest(), timeout=30), {OK})
            for _ in range(data.draw(st.integers(1, 10), label="steps")):
                ops = data.draw(st.lists(sequences.ops(), min_size=1, max_size=3), label="ops")
                response = answer(lambda ops=ops: one(stub.Step, bm.StepRequest(ops=ops)), {OK, INVALID})
                if response is not None:
                    sequences.update(ops, response)
            replay.assert_matches(subscribe)
        finally:
            replay.close()
    assert_serving(block_manager)


HUGE = 200_000
HUGE_STEPS: dict[str, Callable[[], list[bm.Op]]] = {  # answered in linear time; built when their test runs
    "create-huge-prompt": lambda: [bm.Op(create=bm.Create(seq_id=1, token_ids=[1] * HUGE, cache_namespace=NAMESPACE))],
    "admit-huge-prompt": lambda: [bm.Op(admit=bm.Admit(seq_id=1, token_ids=[1] * HUGE, cache_namespace=NAMESPACE,
                                                       num_tokens=UINT32))],
    "decode-huge-batch": lambda: [bm.Op(decode=bm.Decode(seq_ids=range(HUGE), token_ids=[1] * HUGE))],
    "swap-out-huge-batch": lambda: [bm.Op(swap_out=bm.SwapOut(seq_ids=range(HUGE)))],
    "huge-free-ops": lambda: [bm.Op(free=bm.Free(seq_id=i)) for i in range(HUGE)],
    # 200k creates take seconds with --check-integrity: a tenth of them
    "many-create-ops": lambda: [bm.Op(create=bm.Create(seq_id=i, token_ids=[i % 3], cache_namespace=NAMESPACE))
                                for i in range(HUGE // 10)],
}


@pytest.mark.parametrize("name", list(HUGE_STEPS))
def test_block_manager_huge_repeated_fields(block_manager: ServiceProcess, name: str) -> None:
    ops = HUGE_STEPS[name]()
    with grpc.insecure_channel(block_manager.address) as channel:
        stub = bm_grpc.BlockManagerStub(channel)
        answer(lambda: stub.Reset(bm.ResetRequest(), timeout=30), {OK})
        response = answer(lambda: one(stub.Step, bm.StepRequest(ops=ops)), {OK, INVALID})
        assert response is None or len(response.results) == len(ops)
        answer(lambda: stub.Reset(bm.ResetRequest(), timeout=30), {OK})
    assert_serving(block_manager)


# ---- executor --------------------------------------------------------------------------------------------------------

@fuzz(100)
@given(data=st.data())
def test_executor_steps(executor: ServiceProcess, data: st.DataObject) -> None:
    """A run of up to four steps, numbered 1, 2, ... (mostly), after a Reset; sent one after the other, or all at
    once as the frontend's overlapped steps are (step N+1 before step N has answered)."""
    requests = [data.draw(execute_requests(i + 1), label=f"step {i + 1}") for i in range(data.draw(st.integers(1, 4)))]
    overlapped = data.draw(st.booleans(), label="overlapped")
    with grpc.insecure_channel(executor.address) as channel:
        stub = ex_grpc.ExecutorStub(channel)
        answer(lambda: stub.Reset(ex.ResetRequest(epoch=EPOCH), timeout=30), {OK})
        answers = stub.Execute(iter(requests), timeout=60) if overlapped else None  # all on one stream
        for request in requests:
            # another epoch's step is lost to its sender whatever it holds: the epoch is checked first
            allowed = {OK, INVALID} if request.epoch == EPOCH else {UNAVAILABLE}
            call = functools.partial(next, answers) if answers else functools.partial(one, stub.Execute, request)
            response = answer(call, allowed)
            if response is None and answers:
                break  # the stream ended with this step's error: the steps behind it are void
            if response is not None:
                assert list(response.seq_ids) == list(itertools.compress(request.seq_ids, request.sample))
                assert all(0 <= t < TINY_VOCAB for t in response.token_ids)
    assert_serving(executor)


@pytest.mark.parametrize("field", ["seq_ids", "copies", "swap_out"])
def test_executor_huge_repeated_fields(executor: ServiceProcess, field: str) -> None:
    values = range(HUGE) if field == "seq_ids" else [ex.BlockCopy(src=1, dst=2)] * HUGE
    request_ = ex.ExecuteRequest(epoch=EPOCH, **{field: values})
    with grpc.insecure_channel(executor.address) as channel:
        stub = ex_grpc.ExecutorStub(channel)
        answer(lambda: stub.Reset(ex.ResetRequest(epoch=EPOCH), timeout=30), {OK})
        answer(lambda: one(stub.Execute, request_), {OK, INVALID})
    assert_serving(executor)


@fuzz(20)
@given(epoch=st.integers(0, UINT64))
def test_executor_reset_and_info(executor: ServiceProcess, epoch: int) -> None:
    with grpc.insecure_channel(executor.address) as channel:
        stub = ex_grpc.ExecutorStub(channel)
        assert answer(lambda: stub.Reset(ex.ResetRequest(epoch=epoch), timeout=30), {OK}).epoch == epoch
        info = answer(lambda: stub.Info(ex.InfoRequest(), timeout=30), {OK})
        assert (info.epoch, info.num_blocks, info.vocab_size) == (epoch, EXECUTOR_BLOCKS, TINY_VOCAB)
        step = ex.ExecuteRequest(epoch=epoch ^ 1)  # an old epoch's step: lost to its sender, never run
        answer(lambda: one(stub.Execute, step), {UNAVAILABLE})
    assert_serving(executor)


# ---- frontend --------------------------------------------------------------------------------------------------------

def generate(stub: pb_grpc.InferenceStub, request: pb.GenerateRequest, how: Call) -> None:
    allowed = {OK, INVALID, EXHAUSTED}
    kind, argument = (how, 60.0) if isinstance(how, str) else how
    if kind.endswith("within"):
        allowed.add(Code.DEADLINE_EXCEEDED)  # the client's own: the server cancels the request and frees its blocks
    if kind.startswith("complete"):
        response = answer(lambda: stub.Complete(request, timeout=argument), allowed)
        if response is not None:
            assert len(response.choices) == (request.params.n if request.params.HasField("n") else 1)
        return
    if kind == "cancel after":
        stream = stub.Generate(request, timeout=60)
        answer(lambda: list(itertools.islice(stream, int(argument))), allowed)
        stream.cancel()
        answer(lambda: list(stream), allowed | {Code.CANCELLED})
        return
    chunks = answer(lambda: list(stub.Generate(request, timeout=argument)), allowed)
    assert chunks is None or chunks[-1].HasField("usage")


@fuzz(80)
@given(request=GENERATE_REQUESTS, how=CALLS)
@example(request=pb.GenerateRequest(), how="stream")
@example(request=pb.GenerateRequest(text="Hi", params=pb.GenerationParameters(max_tokens=200, n=4, ignore_eos=True)),
         how=("cancel after", 2))
# a negative prompt token reached the detokenizer before the engine's check: INTERNAL (OverflowError)
@example(request=pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, -1])), how="stream")
@example(request=pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-(2**31)])), how="complete")
def test_frontend_generate(stack: Stack, request: pb.GenerateRequest, how: Call) -> None:
    generate(stack.stub, request, how)
    stack.assert_up_and_idle()


@fuzz(25)
@given(request=GENERATE_REQUESTS, how=CALLS,
       metadata=st.lists(st.tuples(st.sampled_from(["x-api-key", "authorization", "x-cache-salt"]),
                                   st.text("abc- ", max_size=8)), max_size=2))
def test_frontend_kv_events(stack: Stack, request: pb.GenerateRequest, how: Call,
                            metadata: list[tuple[str, str]]) -> None:
    """The pod's relay under any request and any caller (no keys file: every caller is trusted): every message
    carries the load, and the replay equals a later subscriber's snapshot."""
    subscribe = functools.partial(stack.stub.SubscribeKvEvents, kv_pb.SubscribeKvEventsRequest(), timeout=60,
                                  metadata=metadata)
    replay = EventReplay(subscribe(), with_load=True)
    try:
        generate(stack.stub, request, how)
        stack.assert_up_and_idle()
        replay.assert_matches(subscribe)
    finally:
        replay.close()


@fuzz(40)
@given(request=st.one_of(st.builds(pb.TokenizeRequest, text=TEXTS), st.builds(pb.TokenizeRequest, chat=CHATS),
                         st.just(pb.TokenizeRequest())))
@example(request=pb.TokenizeRequest(text="word " * 200_000))
def test_frontend_tokenize_list_models_status(stack: Stack, request: pb.TokenizeRequest) -> None:
    response = answer(lambda: stack.stub.Tokenize(request, timeout=60), {OK, INVALID})
    assert response is None or all(0 <= t < CHAT_VOCAB for t in response.token_ids)
    assert answer(lambda: stack.stub.ListModels(pb.ListModelsRequest(), timeout=10), {OK}).models
    assert answer(lambda: stack.stub.Status(pb.StatusRequest(), timeout=10), {OK}).num_total_blocks == STACK_BLOCKS
    stack.assert_up_and_idle()


# ---- the OpenAI-compatible HTTP API ----------------------------------------------------------------------------------

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                | st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
SMALL = st.integers(-3, 12) | st.sampled_from([0, 2**31, 2**63, -(2**63)])
HTTP_FIELDS = {  # each field: plausible values, edge values, and any JSON at all
    "prompt": TEXTS | st.lists(st.integers(-2, CHAT_VOCAB + 2), max_size=8)
    | st.lists(TEXTS, max_size=3) | st.lists(st.lists(st.integers(0, CHAT_VOCAB - 1), max_size=4), max_size=2),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", ""]),
                                                "content": TEXTS | st.none() | JSON_VALUES}), max_size=3),
    "max_tokens": SMALL, "max_completion_tokens": SMALL, "n": SMALL, "logprobs": SMALL | st.booleans(),
    "top_logprobs": SMALL, "temperature": st.floats(-1, 3) | st.just(1e308), "top_p": st.floats(-0.5, 1.5),
    "top_k": SMALL, "seed": SMALL, "stop": TEXTS | st.lists(TEXTS, max_size=5), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(-2, CHAT_VOCAB + 2), max_size=3), "best_of": SMALL, "echo": st.booleans(),
    "model": st.sampled_from(["", "nope"]) | TEXTS, "presence_penalty": st.floats(-2, 2),
}
PLAUSIBLE = {  # values a client means: the requests run (and stream, sample, stop, return logprobs) often
    "prompt": TEXTS | st.lists(st.integers(0, CHAT_VOCAB - 1), min_size=1, max_size=8),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": TEXTS}), min_size=1, max_size=3),
    "max_tokens": st.integers(1, 8), "n": st.integers(1, 3), "logprobs": st.integers(0, 3),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1), "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**31), "stop": TEXTS | st.lists(TEXTS, max_size=2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "ignore_eos": st.booleans(),
}


def http_bodies(required: str) -> st.SearchStrategy[dict[str, Any]]:
    """Mostly a plausible request with its required field; else any mix of fields and values."""
    plausible = st.fixed_dictionaries({required: PLAUSIBLE[required]}, optional={
        k: v for k, v in PLAUSIBLE.items() if k not in ("prompt", "messages")})
    wild = st.fixed_dictionaries({}, optional={k: v | JSON_VALUES for k, v in HTTP_FIELDS.items()})
    return st.integers(0, 3).flatmap(lambda i: wild if i == 3 else plausible)


def http_call(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@fuzz(100)
@given(call=st.sampled_from([("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]).flatmap(
    lambda c: st.tuples(st.just(c[0]), http_bodies(c[1]).map(lambda b: json.dumps(b).encode())
                        | st.binary(max_size=64))))
@example(call=("/v1/completions", b'{"prompt": "Hi", "max_tokens": 3, "stream": true, "n": 2, "logprobs": 2}'))
@example(call=("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'))
@example(call=("/v1/completions", b'{"prompt": "Hi", "temperature": NaN}'))
def test_http_api(stack: Stack, call: tuple[str, bytes]) -> None:
    """Any body gets a status a client can act on, never 500, with OpenAI's error object; a stream that starts
    ends with [DONE]; the pod stays up and holds nothing afterwards."""
    path, body = call
    status, payload = http_call(stack.http_port, path, body)
    event(f"HTTP {status}")
    assert status in (200, 400, 404, 413, 429), (status, payload[:400])
    if status != 200:
        error = json.loads(payload)["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"], error
    elif payload.startswith(b"data: "):  # a stream: events, an error event at worst, then the end
        assert payload.endswith(b"data: [DONE]\n\n"), payload[-200:]
        assert b'"server_error"' not in payload, payload[:400]
    else:
        assert json.loads(payload)["choices"], payload[:400]
    stack.assert_up_and_idle()


# ---- random bytes to every method ------------------------------------------------------------------------------------

SERVICES = {  # fixture -> (service descriptor, codes a parsed random message may get)
    "block_manager": (bm.DESCRIPTOR.services_by_name["BlockManager"], {OK, INVALID}),
    "executor": (ex.DESCRIPTOR.services_by_name["Executor"], {OK, INVALID, UNAVAILABLE}),  # UNAVAILABLE: epochs
    "stack": (pb.DESCRIPTOR.services_by_name["Inference"], {OK, INVALID, EXHAUSTED}),
}
@pytest.mark.parametrize("name", list(SERVICES))
def test_random_bytes_to_every_method(request: pytest.FixtureRequest, name: str) -> None:
    fixture = request.getfixturevalue(name)
    service: ServiceProcess = fixture.frontend if isinstance(fixture, Stack) else fixture
    descriptor, allowed = SERVICES[name]

    @fuzz(40)
    @given(raw=RAW)
    @example(raw=b"\xff\xff\xff")  # corrupt: gRPC answered UNKNOWN with the parser's exception before
    @example(raw=b"\x0a\x02\xff\xfe")  # a string (or a message) field that is not UTF-8
    def send_to_every_method(raw: bytes | tuple[int, bytes, int]) -> None:
        payload = raw_payload(name, raw)
        with grpc.insecure_channel(service.address) as channel:
            for method in descriptor.methods:
                path = f"/{descriptor.full_name}/{method.name}"
                if method.name == "SubscribeKvEvents":  # endless: its snapshot, or its error
                    stream = channel.unary_stream(path)
                    answer(lambda stream=stream: first_and_cancel(stream(payload, timeout=60)), allowed)
                elif method.server_streaming:
                    stream = channel.unary_stream(path)
                    answer(lambda stream=stream: list(stream(payload, timeout=60)), allowed)
                else:
                    answer(lambda path=path: channel.unary_unary(path)(payload, timeout=60), allowed)
        assert_serving(service)

    send_to_every_method()
    if isinstance(fixture, Stack):
        fixture.assert_up_and_idle()


@pytest.mark.parametrize("name", list(SERVICES))
def test_a_message_over_the_size_limit_is_resource_exhausted(request: pytest.FixtureRequest, name: str) -> None:
    fixture = request.getfixturevalue(name)
    service: ServiceProcess = fixture.frontend if isinstance(fixture, Stack) else fixture
    descriptor, _ = SERVICES[name]
    limit = 4 * 2**20 if isinstance(fixture, Stack) else 64 * 2**20  # --max-message-bytes's default; the sidecars'
    method = descriptor.methods[0]
    with grpc.insecure_channel(service.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = (channel.unary_stream if method.server_streaming else channel.unary_unary)(
            f"/{descriptor.full_name}/{method.name}")
        answer(lambda: list(call(b"\x00" * (limit + 1), timeout=60)) if method.server_streaming
               else call(b"\x00" * (limit + 1), timeout=60), {EXHAUSTED})
    assert_serving(service)
