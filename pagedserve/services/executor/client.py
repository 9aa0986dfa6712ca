"""The executor's gRPC client: StepInput in, sampled tokens out."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import chain, compress, repeat
from typing import Any

from ...protos import executor_pb2 as pb
from ...protos import executor_pb2_grpc as pb_grpc
from ..common.channels import Pending, StepChannel, StepStream
from .step_types import ExecutorInfo, HeldInputs, SampledToken, SamplingParams, StepInput, new_row

EXECUTE_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Executor'].full_name}/Execute"

def step_to_proto(step: StepInput, epoch: int = 0, held: HeldInputs | None = None) -> pb.ExecuteRequest:
    """`held`: the tables and sampling parameters the executor holds; only the others are sent, a grown table as
    its new blocks (and recorded as held from now on). The steady decode step, the last step's batch again with
    every input held, goes as `same_batch`: no per-sequence field at all; so does a step the scheduler built as
    that already (`StepInput.same_batch`, no sequences: SchedulerConfig.repeat_batches).
    Columns by transposing the sequences (zip(*...)): C loops, not one Python pass per field."""
    # what every step carries, its sequences aside
    step_fields: dict[str, Any] = {name: [pb.BlockCopy(src=s, dst=d) for s, d in getattr(step, name)]
                                   for name in ("swap_out", "swap_in", "copies")}
    step_fields.update(step_id=step.step_id, epoch=epoch, released_seq_ids=step.released_seq_ids)
    if step.same_batch:
        flagged = f"step {step.step_id} is flagged same_batch, but"
        if step.sequences:
            raise ValueError(f"{flagged} names sequences")
        if held is None or held.batch is None:
            raise ValueError(f"{flagged} no batch of the step before is held")
        if held.batch[0] != step.step_id - 1:
            raise ValueError(f"{flagged} the batch held is step {held.batch[0]}'s")
        held.commit_repeated(step)  # its sequences were held with the steps before: the scheduler's promise
        return pb.ExecuteRequest(**step_fields, same_batch=True)
    seqs = step.sequences
    seq_ids, token_lists, starts, tables, slot_lists, samplings = zip(*seqs, strict=True) if seqs else ((),) * 6
    repeats = held is not None and held.repeats(step.step_id, seq_ids, starts, token_lists)
    table_held: Sequence[bool] = ()
    table_kept: Sequence[int] = ()
    table_lens = list(map(len, tables))
    sent_tables: Iterable[Sequence[int]] = tables
    if held is not None:
        table_held, kept = held.sent(seq_ids, tables)
        if any(table_held) or any(kept):  # a held table is not sent (length 0); of a changed one, its new blocks
            not_held = list(map(operator.not_, table_held))
            table_lens = list(map(operator.mul, table_lens, not_held))
            sent_tables = []
            for i in compress(range(len(tables)), not_held):  # the few that changed
                table_lens[i] -= kept[i]
                sent_tables.append(tables[i][kept[i]:] if kept[i] else tables[i])
            table_kept = kept if any(kept) else ()
    sampled = list(filter(None, samplings))  # the SamplingParams of those that sample (a tuple, never empty)
    sampling_held: Sequence[bool] = ()
    sent_sampling: Sequence[SamplingParams] = sampled
    if held is not None and sampled:
        sampling_held = held.sent_sampling(list(compress(seq_ids, samplings)), sampled)
        if all(sampling_held):  # the steady state: none follow
            sent_sampling = []
        elif any(sampling_held):
            sent_sampling = list(compress(sampled, map(operator.not_, sampling_held)))
        else:
            sampling_held = ()  # all follow: the empty field says so
    if held is not None:  # after this step's inputs are recorded, as the executor does (`HeldInputs.commit`): a
        held.record_batch(step.step_id, seq_ids, starts, token_lists)
        held.release(step.released_seq_ids)  # sequence freed and admitted again in one step holds nothing after
        if repeats and not sent_tables and not table_kept and len(sampled) == len(seqs) and not sent_sampling:
            # every sequence decodes what it sampled last step, into its held table's slot (the slot rule, which
            # the scheduler's slots follow and the runner checks of every other step), with held parameters
            return pb.ExecuteRequest(**step_fields, same_batch=True)
    temperature, top_k, top_p, seed, num_top_logprobs = (
        zip(*sent_sampling, strict=True) if sent_sampling else ((),) * 5)
    return pb.ExecuteRequest(
        **step_fields,
        seq_ids=seq_ids,
        num_tokens=list(map(len, token_lists)),
        start_positions=starts,
        block_table_lens=table_lens,
        sample=list(map(bool, samplings)),
        token_ids=list(chain.from_iterable(token_lists)),
        slot_mapping=list(chain.from_iterable(slot_lists)),
        block_tables=list(chain.from_iterable(sent_tables)),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        num_top_logprobs=num_top_logprobs,
        table_held=table_held,
        table_kept=table_kept,
        sampling_held=sampling_held,
    )


def tokens_from_proto(response: pb.ExecuteResponse) -> list[SampledToken]:
    r = response
    if not len(r.seq_ids) == len(r.token_ids) == len(r.logprobs):
        raise ValueError(f"a response of {len(r.seq_ids)} sequences, {len(r.token_ids)} tokens and"
                         f" {len(r.logprobs)} logprobs")
    if not r.num_top:  # no top logprobs asked for: the common case, rows built in C
        return list(map(new_row, repeat(SampledToken), zip(r.seq_ids, r.token_ids, r.logprobs, repeat(()), repeat(()))))
    tokens, top_ids, top_values, at = [], list(r.top_token_ids), list(r.top_logprobs), 0
    for s, t, lp, n in zip(r.seq_ids, r.token_ids, r.logprobs, r.num_top, strict=True):
        tokens.append(SampledToken(s, t, lp, top_ids[at : at + n], top_values[at : at + n]))
        at += n
    return tokens


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
        self.held = HeldInputs()  # what the executor holds, as far as the steps sent tell

    def submit(self, step: StepInput) -> RunningStep:
        """Sends the step and returns at once: overlapped steps queue behind the one running."""
        return RunningStep(self.steps.send(step_to_proto(step, self.epoch, self.held)))

    def info(self) -> ExecutorInfo:
        return _info(self.stub.Info(pb.InfoRequest(), timeout=self.timeout))

    def reset(self, epoch: int) -> ExecutorInfo:
        """A new epoch: the executor drops every step sent before (see the proto)."""
        info = _info(self.stub.Reset(pb.ResetRequest(epoch=epoch), timeout=self.timeout))
        self.epoch = epoch
        self.steps.reopen()  # the old epoch's stream may lead to a process that is gone
        self.held.clear()  # a reset executor holds no table
        return info

    def close(self) -> None:
        self.steps.close()
        self.channel.close()


def _info(i: pb.InfoResponse) -> ExecutorInfo:
    return ExecutorInfo(i.model, i.model_digest, i.dtype, i.device, i.vocab_size, i.max_model_len, i.block_size,
                        i.num_blocks, i.num_cpu_blocks, tuple(i.eos_token_ids), i.kernel_backend, i.epoch,
                        i.kv_layout or "paged", i.kv_cache_dtype)
