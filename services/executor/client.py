"""The executor's gRPC client: StepInput in, sampled tokens out."""

from __future__ import annotations

import grpc

from ...protos import executor_pb2 as pb
from ...protos import executor_pb2_grpc as pb_grpc
from ..common.channels import StepChannel
from .step_types import ExecutorInfo, HeldTables, SampledToken, StepInput


def step_to_proto(step: StepInput, epoch: int = 0, held: HeldTables | None = None) -> pb.ExecuteRequest:
    """`held`: the tables the executor holds; only the others are sent (and recorded as held from now on)."""
    seqs = step.sequences
    sampled = [s.sampling for s in seqs if s.sampling is not None]
    if held is None:
        table_held = [False] * len(seqs)
    else:
        table_held = [held.held(s) for s in seqs]
        held.release(step.released_seq_ids)
    tables = [() if h else s.block_table for s, h in zip(seqs, table_held, strict=True)]  # a held one: not sent
    return pb.ExecuteRequest(
        swap_out=[pb.BlockCopy(src=s, dst=d) for s, d in step.swap_out],
        swap_in=[pb.BlockCopy(src=s, dst=d) for s, d in step.swap_in],
        copies=[pb.BlockCopy(src=s, dst=d) for s, d in step.copies],
        step_id=step.step_id,
        seq_ids=[s.seq_id for s in seqs],
        num_tokens=[len(s.token_ids) for s in seqs],
        start_positions=[s.start_position for s in seqs],
        block_table_lens=[len(table) for table in tables],
        sample=[s.sampling is not None for s in seqs],
        token_ids=[t for s in seqs for t in s.token_ids],
        slot_mapping=[slot for s in seqs for slot in s.slot_mapping],
        block_tables=[b for table in tables for b in table],
        temperature=[p.temperature for p in sampled],
        top_k=[p.top_k for p in sampled],
        top_p=[p.top_p for p in sampled],
        seed=[p.seed for p in sampled],
        num_top_logprobs=[p.num_top_logprobs for p in sampled],
        epoch=epoch,
        released_seq_ids=step.released_seq_ids,
        table_held=table_held if held is not None else [],
    )


def tokens_from_proto(response: pb.ExecuteResponse) -> list[SampledToken]:
    r = response
    if not r.num_top:  # no top logprobs asked for: the common case
        return [SampledToken(s, t, lp, [], []) for s, t, lp in zip(r.seq_ids, r.token_ids, r.logprobs, strict=True)]
    tokens, top_ids, top_values, at = [], list(r.top_token_ids), list(r.top_logprobs), 0
    for s, t, lp, n in zip(r.seq_ids, r.token_ids, r.logprobs, r.num_top, strict=True):
        tokens.append(SampledToken(s, t, lp, top_ids[at : at + n], top_values[at : at + n]))
        at += n
    return tokens


class RunningStep:
    """A step sent to the executor, not answered yet."""

    def __init__(self, future: grpc.Future) -> None:
        self.future = future

    def result(self) -> list[SampledToken]:
        return tokens_from_proto(self.future.result())


class RemoteExecutor:
    def __init__(self, address: str, timeout: float = 600.0) -> None:
        self.channel = StepChannel(address)
        self.stub = pb_grpc.ExecutorStub(self.channel.channel)
        self.timeout = timeout
        self.epoch = 0
        self.held = HeldTables()  # what the executor holds, as far as the steps sent tell

    def submit(self, step: StepInput) -> RunningStep:
        """Sends the step and returns at once: overlapped steps queue behind the one running."""
        self.channel.keep_polled()
        return RunningStep(self.stub.Execute.future(step_to_proto(step, self.epoch, self.held), timeout=self.timeout))

    def info(self) -> ExecutorInfo:
        return _info(self.stub.Info(pb.InfoRequest(), timeout=self.timeout))

    def reset(self, epoch: int) -> ExecutorInfo:
        """A new epoch: the executor drops every step sent before (see the proto)."""
        info = _info(self.stub.Reset(pb.ResetRequest(epoch=epoch), timeout=self.timeout))
        self.epoch = epoch
        self.held.clear()  # a reset executor holds no table
        return info

    def close(self) -> None:
        self.channel.close()


def _info(i: pb.InfoResponse) -> ExecutorInfo:
    return ExecutorInfo(i.model, i.model_digest, i.dtype, i.device, i.vocab_size, i.max_model_len, i.block_size,
                        i.num_blocks, i.num_cpu_blocks, tuple(i.eos_token_ids), i.kernel_backend, i.epoch,
                        i.kv_layout or "paged")
