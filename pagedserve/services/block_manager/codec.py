"""The block manager's contract on the wire: the RPC names and both directions of every proto conversion, so that
the server and its client (protos/block_manager.proto at each end) import this module and never each other."""

from __future__ import annotations

from collections.abc import Sequence

from ...protos import block_manager_pb2 as pb
from .contract import (
    AdmitOp,
    AdvanceOp,
    BlockCopy,
    BlockStats,
    BlockTableDelta,
    CommitOp,
    CreateOp,
    DecodeOp,
    ForkOp,
    FreeOp,
    InvalidStep,
    Op,
    OpOutcome,
    ReserveOp,
    SpareOp,
    StepAnswer,
    SwapInOp,
    SwapOutOp,
)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["BlockManager"].full_name
STEP_METHOD = f"/{SERVICE_NAME}/Step"


# ---- ops: the frontend sends them, the sidecar reads them ------------------------------------------------------


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


def op_from_proto(index: int, op: pb.Op) -> Op:
    """The op at `index` of a request; InvalidStep if it sets none."""
    kind = op.WhichOneof("kind")
    if kind == "reserve":
        r = op.reserve
        return ReserveOp(r.seq_id, r.num_tokens, r.append_token_ids, r.admission)
    if kind == "decode":
        return DecodeOp(list(op.decode.seq_ids), list(op.decode.token_ids))
    if kind == "commit":
        return CommitOp(op.commit.seq_id, op.commit.num_computed_tokens)
    if kind == "advance":
        advance = op.advance
        return AdvanceOp(advance.seq_ids, advance.num_slots, advance.num_tokens, advance.token_ids)
    if kind == "spare":
        return SpareOp(op.spare.seq_ids)
    if kind == "create":
        return CreateOp(op.create.seq_id, op.create.token_ids, op.create.cache_namespace)
    if kind == "admit":
        a = op.admit
        return AdmitOp(a.seq_id, a.token_ids, a.cache_namespace, a.num_tokens)
    if kind == "free":
        return FreeOp(op.free.seq_id)
    if kind == "fork":
        return ForkOp(op.fork.parent_seq_id, op.fork.child_seq_id)
    if kind == "swap_out":
        return SwapOutOp(op.swap_out.seq_ids)
    if kind == "swap_in":
        return SwapInOp(op.swap_in.seq_ids)
    raise InvalidStep(f"ops[{index}]: no operation set")


def step_to_proto(ops: Sequence[Op]) -> pb.StepRequest:
    return pb.StepRequest(ops=[op_to_proto(op) for op in ops])


# ---- answers: the sidecar sends them, the frontend reads them ------------------------------------------------


def _copies_to_proto(copies: list[BlockCopy]) -> list[pb.BlockCopy]:
    return [pb.BlockCopy(src=c.src, dst=c.dst, num_slots=c.num_slots) for c in copies]


def _copies_from_proto(copies: Sequence[pb.BlockCopy]) -> list[BlockCopy]:
    return [BlockCopy(c.src, c.dst, c.num_slots) for c in copies]


def outcome_to_proto(outcome: OpOutcome) -> pb.OpResult:
    if not outcome.granted:
        return pb.OpResult(status=pb.REFUSED, reason=outcome.reason)
    result = pb.OpResult(
        status=pb.GRANTED, slot_mapping=outcome.slot_mapping, num_cached_tokens=outcome.num_cached_tokens
    )
    for delta in outcome.deltas:
        result.deltas.add(seq_id=delta.seq_id, keep=delta.keep, append=delta.append)
    if outcome.copies:
        result.copies.extend(_copies_to_proto(outcome.copies))
    if outcome.swap_out:
        result.swap_out.extend(_copies_to_proto(outcome.swap_out))
    if outcome.refused_seq_ids:
        result.refused_seq_ids.extend(outcome.refused_seq_ids)
    if outcome.swap_in:
        result.swap_in.extend(_copies_to_proto(outcome.swap_in))
    return result


def outcome_from_proto(result: pb.OpResult) -> OpOutcome:
    return OpOutcome(
        granted=result.status == pb.GRANTED,
        reason=result.reason,
        deltas=[BlockTableDelta(d.seq_id, d.keep, tuple(d.append)) for d in result.deltas],
        slot_mapping=list(result.slot_mapping),
        copies=_copies_from_proto(result.copies),
        swap_out=_copies_from_proto(result.swap_out),
        swap_in=_copies_from_proto(result.swap_in),
        num_cached_tokens=result.num_cached_tokens,
        refused_seq_ids=list(result.refused_seq_ids),
    )


def stats_to_proto(stats: BlockStats) -> pb.Stats:
    return pb.Stats(**vars(stats))


def stats_from_proto(stats: pb.Stats) -> BlockStats:
    return BlockStats(**{name: getattr(stats, name) for name in BlockStats.__dataclass_fields__})


def answer_to_proto(outcomes: Sequence[OpOutcome], stats: BlockStats) -> pb.StepResponse:
    return pb.StepResponse(results=[outcome_to_proto(o) for o in outcomes], stats=stats_to_proto(stats))


def answer_from_proto(response: pb.StepResponse) -> StepAnswer:
    return StepAnswer([outcome_from_proto(r) for r in response.results], stats_from_proto(response.stats))
