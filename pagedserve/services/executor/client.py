"""The executor's gRPC client: StepInput in, sampled tokens out."""

from __future__ import annotations

from ...protos import executor_pb2 as pb
from ...protos import executor_pb2_grpc as pb_grpc
from ..common.channels import Pending, StepChannel, StepStream
from .codec import EXECUTE_METHOD, info_from_proto, step_to_proto, tokens_from_proto
from .held_inputs import SentInputs
from .step_types import ExecutorInfo, SampledToken, StepInput


class RunningStep:
    """A step sent to the executor, not answered yet."""

    def __init__(self, pending: Pending[pb.ExecuteResponse]) -> None:
        self.pending = pending

    def result(self) -> list[SampledToken]:
        return tokens_from_proto(self.pending.result())


class RemoteExecutor:
    def __init__(self, address: str, timeout: float = 600.0) -> None:
        self.channel = StepChannel(address)
        self.stub = pb_grpc.ExecutorStub(self.channel.channel)
        self.steps: StepStream[pb.ExecuteResponse] = self.channel.stream(EXECUTE_METHOD, pb.ExecuteResponse, timeout)
        self.timeout = timeout
        self.epoch = 0
        self.held = SentInputs()  # what the executor holds, as far as the steps sent tell

    def submit(self, step: StepInput) -> RunningStep:
        """Sends the step and returns at once: overlapped steps queue behind the one running."""
        return RunningStep(self.steps.send(step_to_proto(step, self.epoch, self.held)))

    def info(self) -> ExecutorInfo:
        return info_from_proto(self.stub.Info(pb.InfoRequest(), timeout=self.timeout))

    def reset(self, epoch: int) -> ExecutorInfo:
        """A new epoch: the executor drops every step sent before (see the proto)."""
        info = info_from_proto(self.stub.Reset(pb.ResetRequest(epoch=epoch), timeout=self.timeout))
        self.epoch = epoch
        self.steps.reopen()  # the old epoch's stream may lead to a process that is gone
        self.held.clear()  # a reset executor holds no table
        return info

    def close(self) -> None:
        self.steps.close()
        self.channel.close()
