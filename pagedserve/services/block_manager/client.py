"""The block manager's gRPC client: the same ops and outcomes as the in-process core, over the wire."""

from __future__ import annotations

from collections.abc import Sequence

from ...protos import block_manager_pb2 as pb
from ...protos import block_manager_pb2_grpc as pb_grpc
from ..common.channels import Pending, StepChannel, StepStream
from .manager import BlockCopy, BlockTableDelta
from .stats import BlockStats
from .step import (
    AdmitOp,
    AdvanceOp,
    CommitOp,
    CreateOp,
    DecodeOp,
    ForkOp,
    FreeOp,
    Op,
    OpOutcome,
    ReserveOp,
    SpareOp,
    StepAnswer,
    SwapInOp,
    SwapOutOp,
)

STEP_METHOD = f"/{pb.DESCRIPTOR.services_by_name['BlockManager'].full_name}/Step"


def op_to_proto(op: Op) -> pb.Op:
    match op:
        case DecodeOp():
            return pb.Op(decode=pb.Decode(seq_ids=op.seq_ids, token_ids=op.token_ids))
        case ReserveOp():
            return pb.Op(reserve=pb.Reserve(seq_id=op.seq_id, num_tokens=op.num_tokens,
                                            append_token_ids=op.append_token_ids, admission=op.admission))
        case CommitOp():
            return pb.Op(commit=pb.Commit(seq_id=op.seq_id, num_computed_tokens=op.num_computed_tokens))
        case AdvanceOp():
            return pb.Op(advance=pb.Advance(seq_ids=op.seq_ids, num_slots=op.num_slots, num_tokens=op.num_tokens,
                                            token_ids=op.token_ids))
        case SpareOp():
            return pb.Op(spare=pb.Spare(seq_ids=op.seq_ids))
        case AdmitOp():
            return pb.Op(admit=pb.Admit(seq_id=op.seq_id, token_ids=op.token_ids,
                                        cache_namespace=op.cache_namespace, num_tokens=op.max_tokens))
        case CreateOp():
            return pb.Op(create=pb.Create(seq_id=op.seq_id, token_ids=op.token_ids,
                                          cache_namespace=op.cache_namespace))
        case FreeOp():
            return pb.Op(free=pb.Free(seq_id=op.seq_id))
        case ForkOp():
            return pb.Op(fork=pb.Fork(parent_seq_id=op.parent_seq_id, child_seq_id=op.child_seq_id))
        case SwapOutOp():
            return pb.Op(swap_out=pb.SwapOut(seq_ids=op.seq_ids))
        case SwapInOp():
            return pb.Op(swap_in=pb.SwapIn(seq_ids=op.seq_ids))
    raise AssertionError(f"unhandled op {op!r}")


def _copies(copies: Sequence[pb.BlockCopy]) -> list[BlockCopy]:
    return [BlockCopy(c.src, c.dst, c.num_slots) for c in copies]


def outcome_from_proto(result: pb.OpResult) -> OpOutcome:
    return OpOutcome(
        granted=result.status == pb.GRANTED,
        reason=result.reason,
        deltas=[BlockTableDelta(d.seq_id, d.keep, tuple(d.append)) for d in result.deltas],
        slot_mapping=list(result.slot_mapping),
        copies=_copies(result.copies),
        swap_out=_copies(result.swap_out),
        swap_in=_copies(result.swap_in),
        num_cached_tokens=result.num_cached_tokens,
        refused_seq_ids=list(result.refused_seq_ids),
    )


def stats_from_proto(stats: pb.Stats) -> BlockStats:
    return BlockStats(**{name: getattr(stats, name) for name in BlockStats.__dataclass_fields__})


def step_to_proto(ops: Sequence[Op]) -> pb.StepRequest:
    return pb.StepRequest(ops=[op_to_proto(op) for op in ops])


def answer_from_proto(response: pb.StepResponse) -> StepAnswer:
    return StepAnswer([outcome_from_proto(r) for r in response.results], stats_from_proto(response.stats))


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
