"""The executor's gRPC client: StepInput in, sampled tokens out."""

from __future__ import annotations

import grpc

from ...protos import executor_pb2 as pb
from ...protos import executor_pb2_grpc as pb_grpc
from ..common.grpc_server import CHANNEL_OPTIONS
from ..common.tracing import traced_channel
from .step_types import ExecutorInfo, SampledToken, StepInput


def step_to_proto(step: StepInput) -> pb.ExecuteRequest:
    request = pb.ExecuteRequest(
        swap_out=[pb.BlockCopy(src=s, dst=d) for s, d in step.swap_out],
        swap_in=[pb.BlockCopy(src=s, dst=d) for s, d in step.swap_in],
        copies=[pb.BlockCopy(src=s, dst=d) for s, d in step.copies],
        step_id=step.step_id,
    )
    for seq in step.sequences:
        out = request.sequences.add(seq_id=seq.seq_id, token_ids=seq.token_ids, start_position=seq.start_position,
                                    block_table=seq.block_table, slot_mapping=seq.slot_mapping,
                                    sample=seq.sampling is not None)
        if seq.sampling is not None:
            s = seq.sampling
            out.sampling.CopyFrom(pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                                    seed=s.seed, num_top_logprobs=s.num_top_logprobs))
    return request


def tokens_from_proto(response: pb.ExecuteResponse) -> list[SampledToken]:
    return [SampledToken(t.seq_id, t.token_id, t.logprob, list(t.top_token_ids), list(t.top_logprobs))
            for t in response.tokens]


class RunningStep:
    """A step sent to the executor, not answered yet."""

    def __init__(self, future: grpc.Future) -> None:
        self.future = future

    def result(self) -> list[SampledToken]:
        return tokens_from_proto(self.future.result())


class RemoteExecutor:
    def __init__(self, address: str, timeout: float = 600.0) -> None:
        self.channel = traced_channel(grpc.insecure_channel(address, options=CHANNEL_OPTIONS))
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self.timeout = timeout

    def execute(self, step: StepInput) -> list[SampledToken]:
        return tokens_from_proto(self.stub.Execute(step_to_proto(step), timeout=self.timeout))

    def submit(self, step: StepInput) -> RunningStep:
        """Sends the step and returns at once: overlapped steps queue behind the one running."""
        return RunningStep(self.stub.Execute.future(step_to_proto(step), timeout=self.timeout))

    def info(self) -> ExecutorInfo:
        i = self.stub.Info(pb.InfoRequest(), timeout=self.timeout)
        return ExecutorInfo(i.model, i.model_digest, i.dtype, i.device, i.vocab_size, i.max_model_len, i.block_size,
                            i.num_blocks, i.num_cpu_blocks, tuple(i.eos_token_ids), i.kernel_backend)

    def close(self) -> None:
        self.channel.close()
