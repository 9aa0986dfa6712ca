"""A real `pagedserve block-manager` process driven over real gRPC on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedserve.protos import block_manager_pb2 as pb
from pagedserve.protos import block_manager_pb2_grpc as pb_grpc
from pagedserve.services.block_manager.client import RemoteBlockManager
from pagedserve.services.common.processes import ServiceProcess, running_service, wait_serving

NS = b"namespace-digest"


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with running_service(["block-manager", "--num-blocks", "8", "--block-size", "4", "--cpu-blocks", "4"]) as s:
        yield s


class OneStepStub:
    """The stub, with each Step its own one-message stream (the frontend's client keeps one stream for all;
    see test_one_stream_carries_the_steps_in_order)."""

    def __init__(self, stub: pb_grpc.BlockManagerStub) -> None:
        self.raw, self.Stats, self.Reset = stub, stub.Stats, stub.Reset

    def Step(self, request: pb.StepRequest) -> pb.StepResponse:
        return next(self.raw.Step(iter([request]), timeout=30))


@pytest.fixture
def stub(server: ServiceProcess) -> Iterator[OneStepStub]:
    with grpc.insecure_channel(server.address) as channel:
        stub = OneStepStub(pb_grpc.BlockManagerStub(channel))
        stub.Reset(pb.ResetRequest())
        yield stub


def create(seq_id: int, tokens: list[int], ns: bytes = NS) -> pb.Op:
    return pb.Op(create=pb.Create(seq_id=seq_id, token_ids=tokens, cache_namespace=ns))


def admit(seq_id: int, tokens: list[int], num_tokens: int) -> pb.Op:
    return pb.Op(admit=pb.Admit(seq_id=seq_id, token_ids=tokens, cache_namespace=NS, num_tokens=num_tokens))


def free(seq_id: int) -> pb.Op:
    return pb.Op(free=pb.Free(seq_id=seq_id))


def reserve(seq_id: int, n: int, append: list[int] | None = None, admission: bool = False) -> pb.Op:
    return pb.Op(reserve=pb.Reserve(seq_id=seq_id, num_tokens=n, append_token_ids=append or [], admission=admission))


def commit(seq_id: int, n: int) -> pb.Op:
    return pb.Op(commit=pb.Commit(seq_id=seq_id, num_computed_tokens=n))


def test_batched_steps_prefill_decode_fork_cow_swap_free(stub: OneStepStub) -> None:
    r = stub.Step(pb.StepRequest(ops=[admit(1, [1, 2, 3, 4, 5, 6], 6)]))
    assert [x.status for x in r.results] == [pb.GRANTED]
    assert list(r.results[0].slot_mapping) == [0, 1, 2, 3, 4, 5]
    assert [(d.seq_id, d.keep, list(d.append)) for d in r.results[0].deltas] == [(1, 0, [0, 1])]
    assert r.stats.num_used_blocks == 2 and r.stats.num_free_blocks == 6

    # a fork whose first write copies the shared tail, plus a decode step for the parent
    r = stub.Step(pb.StepRequest(ops=[
        commit(1, 6),
        pb.Op(fork=pb.Fork(parent_seq_id=1, child_seq_id=2)),
        reserve(2, 1, [42]),
        reserve(1, 1, [7]),
    ]))
    assert all(x.status == pb.GRANTED for x in r.results)
    cow = r.results[2]
    assert [(c.src, c.dst, c.num_slots) for c in cow.copies] == [(1, 2, 2)]
    assert list(cow.slot_mapping) == [10] and list(r.results[3].slot_mapping) == [6]
    assert r.stats.num_cow_copies == 1

    # a second prompt with the same first block hits the prefix cache
    r = stub.Step(pb.StepRequest(ops=[admit(3, [1, 2, 3, 4, 9], 8)]))
    (delta,) = r.results[0].deltas
    assert r.results[0].num_cached_tokens == 4 and delta.append[0] == 0
    assert list(r.results[0].slot_mapping) == [delta.append[1] * 4]

    r = stub.Step(pb.StepRequest(ops=[pb.Op(swap_out=pb.SwapOut(seq_ids=[1, 2]))]))
    assert r.results[0].status == pb.GRANTED and len(r.results[0].swap_out) == 3
    r = stub.Step(pb.StepRequest(ops=[pb.Op(swap_in=pb.SwapIn(seq_ids=[1, 2]))]))
    assert r.results[0].status == pb.GRANTED and r.stats.num_swapped_sequences == 0

    r = stub.Step(pb.StepRequest(ops=[pb.Op(free=pb.Free(seq_id=s)) for s in (1, 2, 3)]))
    assert r.stats.num_used_blocks == 0 and r.stats.num_sequences == 0 and r.stats.num_cached_blocks == 1


def test_refusal_is_per_op_and_later_ops_on_that_sequence_are_skipped(stub: OneStepStub) -> None:
    r = stub.Step(pb.StepRequest(ops=[admit(1, list(range(40)), 40), admit(2, [1, 2], 2)]))
    assert [x.status for x in r.results] == [pb.REFUSED, pb.GRANTED]  # 10 blocks of 4: more than the 8 there are
    assert "admission needs more than the 8 free blocks" in r.results[0].reason
    stub.Step(pb.StepRequest(ops=[free(2), admit(3, [5] * 8, 8)]))
    stub.Step(pb.StepRequest(ops=[pb.Op(swap_out=pb.SwapOut(seq_ids=[3]))]))
    stub.Step(pb.StepRequest(ops=[admit(5, [7] * 28, 28)]))  # 7 of the 8 blocks: seq 3 needs 2 to come back
    r = stub.Step(pb.StepRequest(ops=[pb.Op(swap_in=pb.SwapIn(seq_ids=[3])), reserve(3, 1, [9])]))
    assert [x.status for x in r.results] == [pb.REFUSED, pb.REFUSED]
    assert "too few to swap in" in r.results[0].reason and "earlier op on sequence 3" in r.results[1].reason


def test_decode_op_batches_a_whole_step(stub: OneStepStub) -> None:
    ops = [admit(1, [1, 2, 3, 4], 4), admit(2, [5, 6, 7], 3)]
    stub.Step(pb.StepRequest(ops=ops))
    decode = pb.Op(decode=pb.Decode(seq_ids=[1, 2], token_ids=[9, 9]))
    r = stub.Step(pb.StepRequest(ops=[decode])).results[0]
    assert r.status == pb.GRANTED and list(r.slot_mapping) == [8, 7] and list(r.refused_seq_ids) == []
    assert [(d.seq_id, d.keep, list(d.append)) for d in r.deltas] == [(1, 1, [2])]
    # fill the cache, then decode again: seq 1 has room in its tail, seq 2's is full and it is refused
    stub.Step(pb.StepRequest(ops=[admit(3, [1] * 20, 20)]))
    r = stub.Step(pb.StepRequest(ops=[pb.Op(decode=pb.Decode(seq_ids=[1, 2], token_ids=[7, 7]))])).results[0]
    assert list(r.refused_seq_ids) == [2] and list(r.slot_mapping) == [9]


SEQ1 = [create(1, [1, 2])]  # a setup step: sequence 1 exists, 2 known tokens, no slots
SEQ1_RESERVED = [admit(1, [1, 2, 3], 2)]  # 3 known tokens, 2 slots
BAD_STEPS = [
    ([], [pb.Op(decode=pb.Decode(seq_ids=[1, 2], token_ids=[3]))], "ops[0].decode: seq_ids must be distinct"),
    ([], [pb.Op(decode=pb.Decode(seq_ids=[77], token_ids=[3]))], "ops[0].decode.seq_ids: unknown sequence 77"),
    ([], [pb.Op()], "ops[0]: no operation set"),
    ([], [reserve(99, 1)], "ops[0].reserve.seq_id: unknown sequence 99"),
    ([], [create(1, [])], "ops[0].create.token_ids: must not be empty"),
    ([], [create(1, [-5])], "ops[0].create.token_ids: token id -5"),
    ([], [create(1, [1], ns=b"short")], "ops[0].create.cache_namespace"),
    ([], [admit(1, [1], 0)], "ops[0].admit.num_tokens: must be positive"),
    (SEQ1, [create(1, [2])], "ops[0].create.seq_id: sequence 1 already exists"),
    (SEQ1, [reserve(1, 3)], "ops[0].reserve.num_tokens"),
    (SEQ1_RESERVED, [commit(1, 3)], "ops[0].commit.num_computed_tokens"),
    (SEQ1, [free(1), free(1)], "ops[1].free.seq_id"),
    (SEQ1, [pb.Op(swap_in=pb.SwapIn(seq_ids=[1]))], "is not swapped out"),
    (SEQ1, [pb.Op(swap_out=pb.SwapOut(seq_ids=[1, 1]))], "non-empty and distinct"),
    ([], [pb.Op(fork=pb.Fork(parent_seq_id=5, child_seq_id=6))], "ops[0].fork.parent_seq_id"),
    # within one step, a sequence that reserved slots takes no further op: the executor writes those slots
    # after the step's copies, swaps and frees, so a fork, swap-out or free would see them empty
    (SEQ1_RESERVED, [reserve(1, 1), pb.Op(fork=pb.Fork(parent_seq_id=1, child_seq_id=2))],
     "ops[1].fork.parent_seq_id: sequence 1 reserved slots earlier in this step"),
    (SEQ1_RESERVED, [reserve(1, 1), pb.Op(swap_out=pb.SwapOut(seq_ids=[1]))], "reserved slots earlier"),
    (SEQ1_RESERVED, [reserve(1, 1), free(1)], "ops[1].free.seq_id: sequence 1 reserved slots earlier"),
    (SEQ1_RESERVED, [pb.Op(decode=pb.Decode(seq_ids=[1], token_ids=[4])), reserve(1, 1)], "(decode)"),
    ([], [create(1, [1, 2]), reserve(1, 1)], "ops[1].reserve.seq_id: sequence 1 was created earlier"),
]


@pytest.mark.parametrize(("setup", "ops", "message"), BAD_STEPS)
def test_bad_input_is_invalid_argument_and_changes_nothing(
    stub: OneStepStub, setup: list[pb.Op], ops: list[pb.Op], message: str
) -> None:
    if setup:
        assert all(r.status == pb.GRANTED for r in stub.Step(pb.StepRequest(ops=setup)).results)
    before = stub.Stats(pb.StatsRequest()).stats
    with pytest.raises(grpc.RpcError) as info:
        stub.Step(pb.StepRequest(ops=ops))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert stub.Stats(pb.StatsRequest()).stats == before  # nothing applied; the server keeps serving


def test_health_and_reflection(server: ServiceProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(responses).list_services_response.service}
        assert "pagedserve.block_manager.v1.BlockManager" in names and "grpc.health.v1.Health" in names


def test_health_names_each_service_and_no_other(server: ServiceProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        named = health.Check(health_pb2.HealthCheckRequest(service="pagedserve.block_manager.v1.BlockManager"))
        assert named.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        watch.cancel()


def test_health_watch_follows_the_service_until_it_stops() -> None:
    """The standard streaming Watch (what a load balancer or a client library uses): SERVING, then NOT_SERVING
    when the service stops, and then the stream ends OK (grpcio's never ends: it held the stop for its whole
    grace, and our clients keep one open). Our error-mapping wrapper once answered it INTERNAL."""
    with running_service(["block-manager", "--num-blocks", "4"]) as service:
        with grpc.insecure_channel(service.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            service.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(StopIteration):
                next(watch)
            assert watch.code() == grpc.StatusCode.OK
        assert service.proc.wait(timeout=15) == 0


def test_one_stream_carries_the_steps_in_order(stub: OneStepStub) -> None:
    """Steps sent before any is answered come back in order, each applied after the one before; a bad one
    ends the stream INVALID_ARGUMENT after the good ones were answered."""
    steps = [pb.StepRequest(ops=[admit(1, [1, 2, 3, 4], 4)]),
             pb.StepRequest(ops=[pb.Op(decode=pb.Decode(seq_ids=[1], token_ids=[5]))]),
             pb.StepRequest(ops=[pb.Op(decode=pb.Decode(seq_ids=[1], token_ids=[6]))]),
             pb.StepRequest(ops=[reserve(99, 1)]),
             pb.StepRequest(ops=[free(1)])]  # never applied: the stream ended before it
    answers = stub.raw.Step(iter(steps), timeout=30)
    assert [list(next(answers).results[0].slot_mapping) for _ in range(3)] == [[0, 1, 2, 3], [4], [5]]
    with pytest.raises(grpc.RpcError) as info:
        next(answers)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown sequence 99" in info.value.details()
    assert stub.Stats(pb.StatsRequest()).stats.num_sequences == 1


def test_a_message_that_does_not_parse_ends_the_stream_invalid_argument(server: ServiceProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.stream_stream("/pagedserve.block_manager.v1.BlockManager/Step")
        with pytest.raises(grpc.RpcError) as info:
            next(raw(iter([b"\xff\xff\xff"]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request:" in info.value.details()


def test_the_client_starts_no_thread_per_step_and_survives_a_restart(tmp_path: Path) -> None:
    """The client's steps share one stream: no thread starts per step (counted through threading.settrace,
    which every new Python thread calls). A stopping service ends the stream UNAVAILABLE (a lost sidecar, to
    the frontend), and the next step opens a stream to the service started again on the same socket."""
    listen = f"unix:{tmp_path}/bm.sock"
    args = ["block-manager", "--num-blocks", "8", "--block-size", "4"]
    started: list[str] = []

    def count_thread(*_: object) -> None:
        started.append(threading.current_thread().name)

    client = RemoteBlockManager(listen)
    for _ in range(2):  # the service, then the service started again on the same socket
        with running_service(args, listen=listen) as service:
            client.send([]).result()  # (re)opens the stream
            threading.settrace(count_thread)
            try:
                for _ in range(20):
                    client.send([]).result()
            finally:
                threading.settrace(None)  # type: ignore[arg-type]
            assert started == [], f"threads started by steps: {started}"
            service.proc.send_signal(signal.SIGTERM)
            assert service.proc.wait(timeout=15) == 0
        with pytest.raises(grpc.RpcError) as lost:
            client.send([]).result()
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in lost.value.details(), lost.value
    client.close()


def test_a_step_unanswered_past_the_timeout_is_deadline_exceeded(tmp_path: Path) -> None:
    """A block manager that stops answering (SIGSTOP) fails the step DEADLINE_EXCEEDED once the client's
    timeout passes, although the stream has no deadline of its own; once it runs again, the next step works."""
    listen = f"unix:{tmp_path}/bm.sock"
    with running_service(["block-manager", "--num-blocks", "8", "--block-size", "4"], listen=listen) as service:
        client = RemoteBlockManager(listen, timeout=1.0)
        client.send([]).result()
        os.kill(service.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as late:
                client.send([]).result()
        finally:
            os.kill(service.proc.pid, signal.SIGCONT)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.send([]).result().stats.num_total_blocks == 8
        client.close()


def test_an_answer_that_races_the_watchdog_stands_and_the_next_step_opens_a_new_stream(tmp_path: Path) -> None:
    """The watchdog cancels the call just as an answer arrives (forced here: a wrapper around the real call
    fires it inside `next`, since the real race cannot be timed). That answer is returned; the call is gone,
    so a step still due on it fails DEADLINE_EXCEEDED, and the next step goes on a new stream."""
    listen = f"unix:{tmp_path}/bm.sock"
    with running_service(["block-manager", "--num-blocks", "8", "--block-size", "4"], listen=listen):
        client = RemoteBlockManager(listen)
        client.send([]).result()
        call = client.steps.call
        assert call is not None

        class WatchdogFiresOnArrival:
            def __init__(self, responses: Any) -> None:
                self.responses = responses

            def __next__(self) -> Any:
                answer = next(self.responses)
                call.cancel_if_late(float("inf"))  # the watchdog's turn, between arrival and bookkeeping
                return answer

            def cancel(self) -> None:
                self.responses.cancel()

            def is_active(self) -> bool:
                return bool(self.responses.is_active())

        call.responses = WatchdogFiresOnArrival(call.responses)
        assert client.send([]).result().stats.num_total_blocks == 8  # the answer stands
        assert client.send([]).result().stats.num_total_blocks == 8  # on a new stream
        assert client.steps.call is not call
        # with a second step due on the call, that one fails: its answer went with the call
        call = client.steps.call
        call.responses = WatchdogFiresOnArrival(call.responses)
        first, second = client.send([]), client.send([])
        assert first.result().stats.num_total_blocks == 8
        with pytest.raises(grpc.RpcError) as late:
            second.result()
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        client.close()


def test_sigterm_stops_gracefully() -> None:
    with running_service(["block-manager", "--num-blocks", "4"]) as service:
        service.proc.send_signal(signal.SIGTERM)
        assert service.proc.wait(timeout=15) == 0


def test_unix_socket_listen(tmp_path: object) -> None:
    listen = f"unix:{tmp_path}/bm.sock"
    with running_service(["block-manager", "--num-blocks", "4"], listen=listen) as service, \
            grpc.insecure_channel(service.address) as channel:
        stats = pb_grpc.BlockManagerStub(channel).Stats(pb.StatsRequest()).stats
        assert stats.num_total_blocks == 4


def test_pagedserve_health_is_the_exec_probe_of_a_sidecar(server: ServiceProcess, tmp_path: Path) -> None:
    """Exit 0 while the sidecar serves, 1 with the reason when nothing answers at the address."""
    def health(address: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pagedserve", "health", address, "--timeout", "2"],
                              capture_output=True, text=True, timeout=60)

    serving = health(server.address)
    assert serving.returncode == 0 and serving.stdout.strip() == f"{server.address}: SERVING"
    gone = health(f"unix:{tmp_path}/nothing.sock")
    assert gone.returncode == 1 and "UNREACHABLE: UNAVAILABLE" in gone.stdout


def test_a_block_manager_takes_its_geometry_from_the_executor(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """In a pod the containers start together: started first, `--geometry-from` waits for the executor and
    sizes the pool from its Info, so the two can never disagree."""
    executor, address = f"unix:{tmp_path}/executor.sock", f"unix:{tmp_path}/bm.sock"
    block_manager = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "block-manager", "--geometry-from", executor, "--listen", address],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with running_service(["executor", "--model", str(tiny_llama_dir), "--device", "cpu", "--block-size", "8",
                              "--num-blocks", "24", "--cpu-swap-mib", "1"], listen=executor):
            wait_serving(address, 120, block_manager)  # type: ignore[arg-type]
            with grpc.insecure_channel(address) as channel:
                stats = pb_grpc.BlockManagerStub(channel).Stats(pb.StatsRequest()).stats
    finally:
        block_manager.terminate()
        assert block_manager.wait(timeout=30) == 0
    assert (stats.num_total_blocks, stats.block_size) == (24, 8) and stats.num_cpu_blocks > 0
