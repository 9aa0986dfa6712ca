"""The block manager's gRPC client: the same ops and outcomes as the in-process core, over the wire."""

from __future__ import annotations

from collections.abc import Sequence

from ...protos import block_manager_pb2 as pb
from ...protos import block_manager_pb2_grpc as pb_grpc
from ..common.channels import Pending, StepChannel, StepStream
from .codec import STEP_METHOD, answer_from_proto, stats_from_proto, step_to_proto
from .contract import BlockStats, Op, StepAnswer


class PendingStep:
    """A Step sent, not answered yet."""

    def __init__(self, pending: Pending[pb.StepResponse]) -> None:
        self.pending = pending

    def result(self) -> StepAnswer:
        return answer_from_proto(self.pending.result())


class RemoteBlockManager:
    """The engine thread sends one Step per scheduler step, all on one stream."""

    def __init__(self, address: str, timeout: float = 30.0) -> None:
        self.channel = StepChannel(address)
        self.stub = pb_grpc.BlockManagerStub(self.channel.channel)
        self.steps: StepStream[pb.StepResponse] = self.channel.stream(STEP_METHOD, pb.StepResponse, timeout)
        self.timeout = timeout

    def step(self, ops: Sequence[Op]) -> StepAnswer:
        return self.send(ops).result()

    def send(self, ops: Sequence[Op]) -> PendingStep:
        """The step, returning at once: the engine collects the executor's tokens meanwhile."""
        return PendingStep(self.steps.send(step_to_proto(ops)))

    def stats(self) -> BlockStats:
        return stats_from_proto(self.stub.Stats(pb.StatsRequest(), timeout=self.timeout).stats)

    def reset(self) -> BlockStats:
        stats = stats_from_proto(self.stub.Reset(pb.ResetRequest(), timeout=self.timeout).stats)
        self.steps.reopen()  # the stream may lead to a process that is gone (a restart while idle)
        return stats

    def close(self) -> None:
        self.steps.close()
        self.channel.close()
