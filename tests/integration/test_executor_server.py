"""A real `pagedserve executor` process driven over gRPC: steps, bad inputs, health."""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.kernels import cpu_unavailable_reason
from pagedserve.protos import executor_pb2 as pb
from pagedserve.protos import executor_pb2_grpc as pb_grpc
from pagedserve.services.common.kv_geometry import slot_of
from pagedserve.services.common.processes import ServiceProcess, running_service, start_service, stop_service
from pagedserve.services.executor.codec import step_to_proto, tokens_from_proto
from pagedserve.services.executor.held_inputs import SentInputs
from pagedserve.services.executor.step_types import (
    SampledToken,
    SamplingParams,
    SequenceInput,
    StepInput,
)

BLOCK = 4


@pytest.fixture(scope="module")
def executor(tiny_llama_dir: Path) -> Iterator[ServiceProcess]:
    args = ["executor", "--model", str(tiny_llama_dir), "--num-blocks", "32", "--block-size", str(BLOCK),
            "--device", "cpu", "--cpu-swap-mib", "1"]
    with running_service(args) as service:
        yield service


class OneStepStub:
    """The stub, with each Execute its own one-message stream (the frontend's client keeps one stream for all;
    see test_overlapped_steps_feed_the_tokens_they_sampled_forward)."""

    def __init__(self, stub: pb_grpc.ExecutorStub) -> None:
        self.raw, self.Info, self.Reset = stub, stub.Info, stub.Reset

    def Execute(self, request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        return next(self.raw.Execute(iter([request]), timeout=60))


@pytest.fixture
def stub(executor: ServiceProcess) -> Iterator[OneStepStub]:
    with grpc.insecure_channel(executor.address) as channel:
        yield OneStepStub(pb_grpc.ExecutorStub(channel))


def seq_step(seq_id: int, tokens: list[int], start: int, table: list[int], sample: bool = True) -> SequenceInput:
    slots = [slot_of(table, p, BLOCK) for p in range(start, start + len(tokens))]
    return SequenceInput(seq_id, tokens, start, table, slots, SamplingParams(num_top_logprobs=3) if sample else None)


def step(*sequences: SequenceInput, step_id: int = 0, copies: list[tuple[int, int]] | None = None) -> pb.ExecuteRequest:
    """The request the frontend's client builds (packed arrays) for these sequences."""
    return step_to_proto(StepInput(list(sequences), copies=copies or [], step_id=step_id))


def tokens(response: pb.ExecuteResponse) -> list[SampledToken]:
    return tokens_from_proto(response)


def test_info_reports_the_cache_geometry(stub: OneStepStub) -> None:
    info = stub.Info(pb.InfoRequest())
    backend = "cpu" if cpu_unavailable_reason() is None else "torch"  # the native kernel, where this machine builds it
    assert (info.num_blocks, info.block_size, info.vocab_size, info.kernel_backend) == (32, BLOCK, 96, backend)
    assert info.dtype == "float32" and info.num_cpu_blocks > 0 and info.model_digest.startswith("sha256:")


def test_prefill_then_decode_match_hf_greedy(stub: OneStepStub, tiny_llama_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    prompt = [5, 17, 42, 8, 9, 60]
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    table = [7, 3]  # non-contiguous blocks, in any order
    token = tokens(stub.Execute(step(seq_step(1, prompt, 0, table))))[0]
    assert token.seq_id == 1 and token.token_id == expected[0]
    assert token.top_token_ids[0] == token.token_id and token.logprob == pytest.approx(token.top_logprobs[0])
    got = [token.token_id]
    for position in (6, 7):
        t = tokens(stub.Execute(step(seq_step(1, [got[-1]], position, table))))[0]
        got.append(t.token_id)
    assert got == expected
    # copy-on-write applies before the forward pass: two more tokens half fill block 11; a fork whose
    # table ends in a copy of it (block 9, never written) must read the copied slots and continue identically
    for position in (8, 9):
        got.append(tokens(stub.Execute(step(seq_step(1, [got[-1]], position, [7, 3, 11]))))[0].token_id)
    forked = tokens(stub.Execute(step(seq_step(2, [got[-1]], 10, [7, 3, 9]), copies=[(11, 9)])))[0]
    again = tokens(stub.Execute(step(seq_step(1, [got[-1]], 10, [7, 3, 11]))))[0]
    assert forked.token_id == again.token_id and forked.logprob == pytest.approx(again.logprob, abs=1e-5)
    assert forked.top_logprobs == pytest.approx(again.top_logprobs, abs=1e-5)


def test_a_held_block_table_is_used_until_released_or_reset(stub: OneStepStub) -> None:
    """The frontend's client sends a sequence's table only when it changed (`table_held`); the executor uses
    the one it holds, and forgets it when the sequence is released or the executor resets."""
    sender, table, prompt = SentInputs(), [12, 13], [5, 17, 42, 8, 9, 60]
    first = step_to_proto(StepInput([seq_step(40, prompt, 0, table)]), held=sender)
    assert list(first.table_held) == [False] and list(first.block_tables) == table
    token = tokens(stub.Execute(first))[0].token_id
    held = step_to_proto(StepInput([seq_step(40, [token], 6, table)]), held=sender)  # the same table object
    assert list(held.table_held) == [True] and list(held.block_table_lens) == [0] and not held.block_tables
    by_held = tokens(stub.Execute(held))[0]
    sent = tokens(stub.Execute(step(seq_step(40, [token], 6, list(table)))))[0]  # the same step, table sent
    assert by_held.token_id == sent.token_id and by_held.logprob == pytest.approx(sent.logprob, abs=1e-6)
    stub.Execute(step_to_proto(StepInput([], released_seq_ids=[40]), held=sender))
    assert 40 not in sender.tables
    with pytest.raises(grpc.RpcError) as gone:
        stub.Execute(held)
    assert gone.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "holds no block table" in gone.value.details()
    stub.Execute(step(seq_step(41, prompt, 0, table)))  # held from here on, until the Reset
    stub.Reset(pb.ResetRequest(epoch=0))
    held_41 = step_to_proto(StepInput([seq_step(41, [token], 6, table)]), held=SentInputs())
    held_41.table_held[:] = [True]
    del held_41.block_tables[:]
    held_41.block_table_lens[:] = [0]
    with pytest.raises(grpc.RpcError) as reset:
        stub.Execute(held_41)
    assert reset.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "holds no block table" in reset.value.details()
    # the same step in another epoch (sent before its sender lost this executor): lost, not a bad step, although
    # its held inputs are unknown here too
    held_41.epoch = 1
    held_41.sampling_held[:] = [True]
    for name in ("temperature", "top_k", "top_p", "seed", "num_top_logprobs"):
        held_41.ClearField(name)
    with pytest.raises(grpc.RpcError) as stale:
        stub.Execute(held_41)
    assert stale.value.code() == grpc.StatusCode.UNAVAILABLE and "epoch" in stale.value.details()


def test_a_grown_table_sends_only_its_new_blocks(stub: OneStepStub) -> None:
    """A decode's table that grew by a block (or had its tail copied on write) goes as the blocks it adds to the
    table the executor holds (`table_kept`), and runs as the whole table would."""
    sender, prompt, table = SentInputs(), [5, 17, 42, 8, 9, 60, 3, 11], [12, 13]  # two full blocks of 4
    token = tokens(stub.Execute(step_to_proto(StepInput([seq_step(43, prompt, 0, table)]), held=sender)))[0].token_id
    grown = [*table, 14]  # position 8 starts a third block
    delta = step_to_proto(StepInput([seq_step(43, [token], 8, grown)]), held=sender)
    assert (list(delta.table_held), list(delta.table_kept)) == ([False], [2])
    assert (list(delta.block_table_lens), list(delta.block_tables)) == ([1], [14])
    by_delta = tokens(stub.Execute(delta))[0]
    whole = tokens(stub.Execute(step(seq_step(43, [token], 8, list(grown)))))[0]
    assert by_delta.token_id == whole.token_id and by_delta.logprob == pytest.approx(whole.logprob, abs=1e-6)
    copied = [12, 13, 15]  # the tail block replaced (copy-on-write): two entries kept, one new
    again = step_to_proto(StepInput([seq_step(43, [token], 8, copied)]), held=sender)
    assert (list(again.table_kept), list(again.block_tables)) == ([2], [15])
    stub.Execute(again)
    stub.Execute(step_to_proto(StepInput([], released_seq_ids=[43]), held=sender))


def test_overlapped_steps_feed_the_tokens_they_sampled_forward(stub: OneStepStub) -> None:
    """Steps 42 and 43 are sent on one stream with step 41, before it answers, each with LAST_SAMPLED (-1) as its
    input: the executor runs them in order and gives the tokens that serial steps with known inputs give."""
    prompt, table = [5, 17, 42, 8, 9, 60], [12, 13, 14]
    serial = [tokens(stub.Execute(step(seq_step(1, prompt, 0, table))))[0].token_id]
    for position in (6, 7):
        request = step(seq_step(1, [serial[-1]], position, table))
        serial.append(tokens(stub.Execute(request))[0].token_id)
    base = tokens(stub.Execute(pb.ExecuteRequest()))  # any step number may start a run of overlapped steps
    assert not base
    requests = [step(seq_step(1, prompt, 0, table), step_id=41)]
    for step_id, position in ((42, 6), (43, 7)):
        requests.append(step(seq_step(1, [-1], position, table), step_id=step_id))
    assert [tokens(r)[0].token_id for r in stub.raw.Execute(iter(requests), timeout=60)] == serial
    for request, message in (
        (step(seq_step(1, [-1], 8, table), step_id=45), "last step run was 43"),
        (step(seq_step(1, [-1], 8, table)), "last step run was"),
        (step(seq_step(2, [-1], 8, table), step_id=44), "no token for sequence 2"),
        (step(seq_step(1, [-1, 5], 8, table), step_id=44), "stands alone"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            stub.Execute(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()


def test_the_steady_decode_step_goes_as_the_same_batch_and_samples_what_it_would_in_full(stub: OneStepStub) -> None:
    """Two sequences prefilled, then decoded on one stream as the frontend's client sends them (held inputs): from
    the first decode on, each step is `same_batch`, no per-sequence field, and the tokens are those of the same
    steps sent in full (one message per stream: nothing held)."""
    prompts, tables = {1: [5, 17, 42, 8, 9, 60], 2: [7, 3, 11]}, {1: [12, 13, 14], 2: [20, 21, 22]}
    params = SamplingParams(num_top_logprobs=3)

    def sequences(decoding: bool, position: dict[int, int]) -> list[SequenceInput]:
        return [SequenceInput(s, [-1] if decoding else prompts[s], position[s], tables[s],
                              [slot_of(tables[s], p, BLOCK)
                               for p in range(position[s], position[s] + (1 if decoding else len(prompts[s])))],
                              params) for s in prompts]

    held, requests, in_full = SentInputs(), [], []
    for step_id in range(91, 96):
        decoding = step_id > 91
        start = {s: 0 if not decoding else len(prompts[s]) + step_id - 92 for s in prompts}
        step = StepInput(sequences(decoding, start), step_id=step_id)
        requests.append(step_to_proto(step, held=held))
        in_full.append(step_to_proto(step))
    assert [r.same_batch for r in requests] == [False, True, True, True, True]
    assert not requests[1].seq_ids and not requests[1].slot_mapping
    def answers(sent: list[pb.ExecuteRequest]) -> list[list[tuple[int, int]]]:
        return [[(t.seq_id, t.token_id) for t in tokens(r)] for r in stub.raw.Execute(iter(sent), timeout=60)]

    streamed = answers(requests)
    assert streamed == answers(in_full)
    assert len(streamed) == 5 and all(len(t) == 2 for t in streamed)


def test_a_failed_step_ends_its_stream_and_voids_the_steps_behind_it(stub: OneStepStub) -> None:
    """The answers before the failure come back; the step queued behind it never runs: the stream's next
    step would otherwise sample again from a cache the failed one left as it was."""
    prompt, table = [5, 17, 42, 8, 9, 60], [12, 13, 14]
    requests = [step(seq_step(1, prompt, 0, table), step_id=71),
                step(seq_step(1, [-1], 6, [40, 1]), step_id=72),  # fails on the step thread: block 40 is outside
                step(seq_step(1, [7], 6, table), step_id=73)]  # would run (its inputs are its own), if it ran
    answers = stub.raw.Execute(iter(requests), timeout=60)
    first = tokens(next(answers))[0].token_id
    with pytest.raises(grpc.RpcError) as info:
        next(answers)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_table: 40 outside" in info.value.details()
    # 73 never ran: the last step run is still 71 (else "last step run was 73"), whose token a new 72 reads
    again = tokens(stub.Execute(step(seq_step(1, [-1], 6, table), step_id=72)))[0].token_id
    assert again == tokens(stub.Execute(step(seq_step(1, [first], 6, table))))[0].token_id


BAD = [
    (step(seq_step(1, [500], 0, [0])), "token id 500 outside the vocabulary"),
    (step(seq_step(1, [5], 300, [0] * 80)), "exceed the context"),
    (step(seq_step(1, [5, 6], 0, [40])), "block_table: 40 outside"),
    (step(SequenceInput(1, [5, 6], 0, [0], [0])), "slot_mapping: 1 entries, the sequences' lengths add up to 2"),
    (step(SequenceInput(1, [5], 0, [0], [3])), "not in its block"),
    (step(SequenceInput(1, [5, 6, 7, 8, 9], 0, [0], [0, 1, 2, 3, 4])), "cannot hold"),
    (step(SequenceInput(1, [], 0, [0], [])), "must not be empty"),
    (pb.ExecuteRequest(seq_ids=[1, 2], num_tokens=[1], start_positions=[0, 0], block_table_lens=[1, 1],
                       sample=[False, False]), "num_tokens: 1 entries for 2 sequences"),
    (pb.ExecuteRequest(seq_ids=[1], num_tokens=[1], start_positions=[0], block_table_lens=[1], sample=[True],
                       token_ids=[5], slot_mapping=[0], block_tables=[0]), "temperature: 0 entries for 1 sequences"),
    (pb.ExecuteRequest(seq_ids=[1], num_tokens=[1], start_positions=[0], block_table_lens=[1], sample=[False],
                       token_ids=[5], slot_mapping=[0], block_tables=[0], table_held=[True, False]),
     "table_held: 2 entries for 1 sequences"),
    (pb.ExecuteRequest(seq_ids=[1], num_tokens=[1], start_positions=[0], block_table_lens=[1], sample=[False],
                       token_ids=[5], slot_mapping=[0], block_tables=[0], table_held=[True]),
     "block_table_lens[0]: 1 blocks for a table the executor holds"),
    (pb.ExecuteRequest(seq_ids=[1], num_tokens=[1], start_positions=[0], block_table_lens=[1], sample=[False],
                       token_ids=[5], slot_mapping=[0], block_tables=[0], table_kept=[1, 1]),
     "table_kept: 2 entries for 1 sequences"),
    (pb.ExecuteRequest(seq_ids=[987654], num_tokens=[1], start_positions=[0], block_table_lens=[1], sample=[False],
                       token_ids=[5], slot_mapping=[0], block_tables=[0], table_kept=[1]),
     "table_kept[0]: this executor holds no block table for sequence 987654"),
    (pb.ExecuteRequest(step_id=999999, same_batch=True), "same_batch: step 999999 repeats the batch of step 999998,"
                                                         " but the last step this executor holds is"),
    (pb.ExecuteRequest(step_id=5, same_batch=True, token_ids=[-1]), "token_ids: must be empty in a same_batch step"),
]


@pytest.mark.parametrize(("bad", "message"), BAD)
def test_bad_input_answers_invalid_argument(stub: OneStepStub, bad: pb.ExecuteRequest, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Execute(bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()


def test_bad_block_copies_and_swaps(stub: OneStepStub) -> None:
    for request in (pb.ExecuteRequest(copies=[pb.BlockCopy(src=0, dst=32)]),
                    pb.ExecuteRequest(swap_in=[pb.BlockCopy(src=10_000, dst=1)])):
        with pytest.raises(grpc.RpcError) as info:
            stub.Execute(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the cache" in info.value.details()
    assert stub.Info(pb.InfoRequest()).num_blocks == 32  # still serving


def test_swap_round_trip_preserves_the_cache(stub: OneStepStub) -> None:
    prompt = [3, 4, 5, 6, 7]
    first = tokens(stub.Execute(step(seq_step(5, prompt, 0, [20, 21]))))[0].token_id
    stub.Execute(pb.ExecuteRequest(swap_out=[pb.BlockCopy(src=20, dst=0), pb.BlockCopy(src=21, dst=1)]))
    stub.Execute(pb.ExecuteRequest(swap_in=[pb.BlockCopy(src=0, dst=25), pb.BlockCopy(src=1, dst=26)]))
    after_swap = tokens(stub.Execute(step(seq_step(5, [first], 5, [25, 26]))))[0]
    in_place = tokens(stub.Execute(step(seq_step(5, [first], 5, [20, 21]))))[0]
    assert after_swap.token_id == in_place.token_id and after_swap.logprob == pytest.approx(in_place.logprob)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """As the process below runs (`--threads 1`); build_runner sets it for the whole of this process."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_torch_thread")
def test_an_executor_with_a_bf16_cache_says_so_and_steps_as_one_in_process(tiny_llama_dir: Path) -> None:
    """`--kv-cache-dtype bfloat16` reaches the process: Info reports it (weights still float32), and a prefill,
    decodes and a swap round trip sample what the same configuration samples in this process."""
    from pagedserve.services.executor.engine_config import build_runner
    from pagedserve.services.executor.options import ExecutorConfig

    flags = ["--model", str(tiny_llama_dir), "--num-blocks", "32", "--block-size", str(BLOCK), "--device", "cpu",
             "--cpu-swap-mib", "1", "--kv-cache-dtype", "bfloat16", "--threads", "1"]
    local, local_info = build_runner(ExecutorConfig.from_args(_executor_args(flags)))
    prompt, table, moved_to = [5, 17, 42, 8, 9, 60], [7, 3, 11], [20, 21, 22]
    with running_service(["executor", *flags]) as service, grpc.insecure_channel(service.address) as channel:
        remote = OneStepStub(pb_grpc.ExecutorStub(channel))
        info = remote.Info(pb.InfoRequest())
        assert (info.dtype, info.kv_cache_dtype, info.num_blocks) == ("float32", "bfloat16", 32)
        assert info.num_cpu_blocks == local_info.num_cpu_blocks > 0
        ours, theirs = [], []
        for position in (0, 6, 7, 8, 9, 10):
            tokens_in = prompt if position == 0 else [ours[-1].token_id]
            if position == 10:  # the sequence's blocks out to the swap pool and back in elsewhere
                remote.Execute(pb.ExecuteRequest(swap_out=[pb.BlockCopy(src=b, dst=i) for i, b in enumerate(table)]))
                remote.Execute(pb.ExecuteRequest(swap_in=[pb.BlockCopy(src=i, dst=b) for i, b in enumerate(moved_to)]))
            remote_table = moved_to if position == 10 else table
            ours.append(tokens(remote.Execute(step(seq_step(1, tokens_in, position, remote_table))))[0])
            theirs.append(local.execute(StepInput([seq_step(1, tokens_in, position, table)]))[0])
    assert [t.token_id for t in ours] == [t.token_id for t in theirs]
    assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs], abs=1e-5)


def _executor_args(flags: list[str]) -> object:
    import argparse

    from pagedserve.services.executor.options import add_executor_arguments

    parser = argparse.ArgumentParser()
    add_executor_arguments(parser)
    return parser.parse_args(flags)


def test_a_stopping_executor_ends_an_open_stream_unavailable(tiny_llama_dir: Path) -> None:
    """The frontend keeps its step stream open for as long as the executor lives: at SIGTERM the stream ends
    UNAVAILABLE (a lost sidecar, to the frontend) and the process exits at once, not after the stop's grace."""
    args = ["executor", "--model", str(tiny_llama_dir), "--num-blocks", "8", "--block-size", str(BLOCK),
            "--device", "cpu"]
    with running_service(args) as service, grpc.insecure_channel(service.address) as channel:
        requests: queue.SimpleQueue[pb.ExecuteRequest | None] = queue.SimpleQueue()
        answers = pb_grpc.ExecutorStub(channel).Execute(iter(requests.get, None), timeout=60)
        requests.put(step(seq_step(1, [5, 17, 42], 0, [2])))
        assert len(tokens(next(answers))) == 1
        service.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as stopped:
            next(answers)
        assert stopped.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in stopped.value.details()
        assert service.proc.wait(timeout=30) == 0
        requests.put(None)


def test_health_is_not_serving_until_the_model_is_loaded() -> None:
    """SmolLM2 takes seconds to load: health must say NOT_SERVING, and Execute UNAVAILABLE, meanwhile."""
    service = start_service(["executor", "--kv-cache-mib", "16", "--device", "cpu"], until_serving=False)
    try:
        address = service.address
        seen = []
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            first = health.Check(health_pb2.HealthCheckRequest()).status
            assert first == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.ExecutorStub(channel).Info(pb.InfoRequest())
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                seen.append(health.Check(health_pb2.HealthCheckRequest()).status)
                if seen[-1] == health_pb2.HealthCheckResponse.SERVING:
                    break
                time.sleep(0.2)
            assert seen[-1] == health_pb2.HealthCheckResponse.SERVING
            assert pb_grpc.ExecutorStub(channel).Info(pb.InfoRequest()).model == "smollm2-135m"
    finally:
        assert stop_service(service) == 0


def test_frontend_refuses_a_block_manager_that_disagrees(executor: ServiceProcess, tiny_llama_dir: Path) -> None:
    with running_service(["block-manager", "--num-blocks", "30", "--block-size", str(BLOCK)]) as block_manager:
        frontend = start_service(["frontend", "--block-manager", block_manager.address, "--executor", executor.address,
                                  "--model", str(tiny_llama_dir)], until_serving=False)
        try:
            assert frontend.proc.wait(timeout=120) == 2
            deadline = time.monotonic() + 10  # the reader thread may still be collecting the last lines
            while "disagree" not in "".join(frontend.output) and time.monotonic() < deadline:
                time.sleep(0.05)
            output = "".join(frontend.output)
            assert "disagree on the KV cache" in output and "KV blocks: executor 32, block manager 30" in output
        finally:
            stop_service(frontend)
