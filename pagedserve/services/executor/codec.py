"""The executor's messages on the wire (executor.proto), both directions, and its method names: what the
executor's client and server share, so that neither imports the other.

A step goes as columns (one packed array per field, not a message per sequence), with the inputs the executor
holds left out (held_inputs.py). Columns are built by transposing the sequences (`zip(*...)`) and rows by
mapping over the columns: C loops, not a Python pass per sequence, on the path every step takes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import accumulate, chain, compress, repeat
from typing import Any

from ...protos import executor_pb2 as pb
from ..common.errors import InvalidRequest
from .held_inputs import HeldInputs, SentInputs
from .step_types import ExecutorInfo, SampledToken, SamplingParams, SequenceInput, StepInput, new_row

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
EXECUTE_METHOD = f"/{SERVICE_NAME}/Execute"

# a step's per-sequence fields: a `same_batch` step has none
SEQUENCE_FIELDS = ("seq_ids", "num_tokens", "start_positions", "block_table_lens", "sample", "token_ids",
                   "slot_mapping", "block_tables", "temperature", "top_k", "top_p", "seed", "num_top_logprobs",
                   "table_held", "table_kept", "sampling_held")


def step_to_proto(step: StepInput, epoch: int = 0, held: SentInputs | None = None) -> pb.ExecuteRequest:
    """`held`: the tables and sampling parameters the executor holds; only the others are sent, a grown table as
    its new blocks (and recorded as held from now on). The steady decode step, the last step's batch again with
    every input held, goes as `same_batch`: no per-sequence field at all; so does a step the scheduler built as
    that already (`StepInput.same_batch`, no sequences: SchedulerConfig.repeat_batches)."""
    # what every step carries, its sequences aside
    step_fields: dict[str, Any] = {name: [pb.BlockCopy(src=s, dst=d) for s, d in getattr(step, name)]
                                   for name in ("swap_out", "swap_in", "copies")}
    step_fields.update(step_id=step.step_id, epoch=epoch, released_seq_ids=step.released_seq_ids)
    if step.same_batch:
        (held or SentInputs()).send_repeated(step)  # ValueError without the batch of the step before
        return pb.ExecuteRequest(**step_fields, same_batch=True)
    seqs = step.sequences
    seq_ids, token_lists, starts, tables, slot_lists, samplings = zip(*seqs, strict=True) if seqs else ((),) * 6
    sampled = list(filter(None, samplings))  # the SamplingParams of those that sample (a tuple, never empty)
    table_fields: dict[str, Any]
    if held is None:
        table_fields = {"block_table_lens": list(map(len, tables)), "block_tables": list(chain.from_iterable(tables))}
        sampling_fields = _sampling_fields(sampled, ())
    else:
        repeats = held.repeats(step.step_id, seq_ids, starts, token_lists)
        held.release(step.released_seq_ids)  # first, as the receiver does: what the step brings is held after
        table_fields = _table_fields(held, seq_ids, tables)
        sampling_held = held.sent_sampling(list(compress(seq_ids, samplings)), sampled) if sampled else []
        sampling_fields = _sampling_fields(sampled, sampling_held)
        held.record_batch(step.step_id, seq_ids, starts, token_lists)
        if (repeats and all(table_fields["table_held"]) and len(sampled) == len(seqs)
                and not sampling_fields["temperature"]):
            # every sequence decodes what it sampled last step, into its held table's slot (the slot rule, which
            # the scheduler's slots follow and the runner checks of every other step), with held parameters
            return pb.ExecuteRequest(**step_fields, same_batch=True)
    return pb.ExecuteRequest(
        **step_fields, **table_fields, **sampling_fields,
        seq_ids=seq_ids,
        num_tokens=list(map(len, token_lists)),
        start_positions=starts,
        sample=list(map(bool, samplings)),
        token_ids=list(chain.from_iterable(token_lists)),
        slot_mapping=list(chain.from_iterable(slot_lists)),
    )


def _table_fields(held: SentInputs, seq_ids: Sequence[int], tables: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The step's tables as sent: none of those the executor holds (length 0), of a changed one its new blocks."""
    table_held, kept = held.sent(seq_ids, tables)
    table_lens = list(map(len, tables))
    sent_tables: Iterable[Sequence[int]] = tables
    table_kept: Sequence[int] = ()
    if any(table_held) or any(kept):
        not_held = list(map(operator.not_, table_held))
        table_lens = list(map(operator.mul, table_lens, not_held))
        sent_tables = []
        for i in compress(range(len(tables)), not_held):  # the few that changed
            table_lens[i] -= kept[i]
            sent_tables.append(tables[i][kept[i]:] if kept[i] else tables[i])
        table_kept = kept if any(kept) else ()
    return {"table_held": table_held, "table_kept": table_kept, "block_table_lens": table_lens,
            "block_tables": list(chain.from_iterable(sent_tables))}


def _sampling_fields(sampled: Sequence[SamplingParams], sampling_held: Sequence[bool]) -> dict[str, Any]:
    """The parameters of the sequences that sample, those the executor holds (`sampling_held`) left out: none
    follow in the steady state, and the field is empty when all do."""
    sent: Sequence[SamplingParams] = sampled
    if sampling_held and all(sampling_held):
        sent = []
    elif any(sampling_held):
        sent = list(compress(sampled, map(operator.not_, sampling_held)))
    else:
        sampling_held = ()
    temperature, top_k, top_p, seed, num_top_logprobs = zip(*sent, strict=True) if sent else ((),) * 5
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
            "num_top_logprobs": num_top_logprobs, "sampling_held": sampling_held}


def step_from_proto(r: pb.ExecuteRequest, held: HeldInputs | None = None, block_size: int = 0) -> StepInput:
    """Splits the packed arrays into sequences, with the tables and sampling parameters `held` for them filled in
    (`table_held`, `table_kept`, `sampling_held`), or a `same_batch` step's from the held batch (its slots by the
    slot rule over `block_size`); InvalidRequest when their lengths disagree or an input is not held. Each
    repeated field is read once (a pass over one makes its ints anew), and in the steady state (every sequence
    decodes, every input held) nothing is walked by a Python loop. Changes nothing held."""
    held = held.without(r.released_seq_ids) if held is not None else HeldInputs()
    swap_out, swap_in, copies = ([(c.src, c.dst) for c in moves] for moves in (r.swap_out, r.swap_in, r.copies))
    if r.same_batch:
        named = next((name for name in SEQUENCE_FIELDS if len(getattr(r, name))), None)
        if named is not None:
            raise InvalidRequest(f"{named}: must be empty in a same_batch step (its sequences are the last step's)")
        if block_size <= 0:
            raise ValueError("a same_batch step needs the cache's block size for its slots")
        return StepInput(held.repeated_batch(r.step_id, block_size), swap_out, swap_in, copies, r.step_id,
                         list(r.released_seq_ids), same_batch=True)
    seq_ids = list(r.seq_ids)
    num_tokens, table_lens, table_held = _check_lengths(r, len(seq_ids))
    params = _samplings_from_proto(r, held, seq_ids)
    tokens, slots, tables = list(r.token_ids), list(r.slot_mapping), list(r.block_tables)
    if num_tokens.count(1) == len(seq_ids):  # decodes only: one token each
        token_lists, slot_lists = [[t] for t in tokens], [[s] for s in slots]
    else:
        ends = list(accumulate(num_tokens))
        token_lists = [tokens[end - n : end] for n, end in zip(num_tokens, ends, strict=True)]
        slot_lists = [slots[end - n : end] for n, end in zip(num_tokens, ends, strict=True)]
    table_lists: Sequence[Sequence[int]] = [()] * len(seq_ids)  # every table held: `resolve_tables` fills them all
    if tables:
        table_lists = [tables[end - n : end] for n, end in zip(table_lens, accumulate(table_lens), strict=True)]
    table_kept = list(r.table_kept)
    if table_held or table_kept:
        table_lists = held.resolve_tables(seq_ids, table_lists, table_held, table_kept)
    # columns to rows in C (map over the columns), not one Python pass per sequence
    sequences = list(map(new_row, repeat(SequenceInput),
                         zip(seq_ids, token_lists, r.start_positions, table_lists, slot_lists, params, strict=True)))
    return StepInput(sequences, swap_out, swap_in, copies, r.step_id, list(r.released_seq_ids))


def _check_lengths(r: pb.ExecuteRequest, num_seqs: int) -> tuple[list[int], list[int], list[bool]]:
    """InvalidRequest unless the per-sequence columns agree in length; the tokens per sequence, the table lengths
    and `table_held`."""
    for name in ("num_tokens", "start_positions", "block_table_lens", "sample"):
        if len(getattr(r, name)) != num_seqs:
            raise InvalidRequest(f"{name}: {len(getattr(r, name))} entries for {num_seqs} sequences")
    num_tokens, table_lens, table_held = list(r.num_tokens), list(r.block_table_lens), list(r.table_held)
    if table_held:
        if len(table_held) != num_seqs:
            raise InvalidRequest(f"table_held: {len(table_held)} entries for {num_seqs} sequences (or none)")
        if any(table_lens) and any(map(operator.and_, table_held, table_lens)):  # in C; the index for the error
            bad = next(i for i, (is_held, n) in enumerate(zip(table_held, table_lens, strict=True)) if is_held and n)
            raise InvalidRequest(f"block_table_lens[{bad}]: {table_lens[bad]} blocks for a table the executor holds"
                                 " (table_held): must be 0")
    num_all_tokens = num_seqs if num_tokens.count(1) == num_seqs else sum(num_tokens)
    for name, wanted in (("token_ids", num_all_tokens), ("slot_mapping", num_all_tokens),
                         ("block_tables", sum(table_lens))):
        if len(getattr(r, name)) != wanted:
            raise InvalidRequest(f"{name}: {len(getattr(r, name))} entries, the sequences' lengths add up to {wanted}")
    for name in ("top_k", "top_p", "seed", "num_top_logprobs"):
        if len(getattr(r, name)) != len(r.temperature):
            raise InvalidRequest(f"{name}: {len(getattr(r, name))} entries for {len(r.temperature)} temperatures")
    return num_tokens, table_lens, table_held


def _samplings_from_proto(r: pb.ExecuteRequest, held: HeldInputs,
                          seq_ids: Sequence[int]) -> Sequence[SamplingParams | None]:
    """Each sequence's sampling parameters (None where it does not sample), the held ones filled in."""
    flags = list(r.sample)
    top_p = list(r.top_p)
    if top_p and min(top_p) <= 0:  # unset: off
        top_p = [p if p > 0 else 1.0 for p in top_p]
    sent = list(map(new_row, repeat(SamplingParams),  # checked equally long (`_check_lengths`)
                    zip(r.temperature, r.top_k, top_p, r.seed, r.num_top_logprobs, strict=True)))
    all_sample = flags.count(True) == len(seq_ids)
    sampled = held.resolve_sampling(seq_ids if all_sample else list(compress(seq_ids, flags)), list(r.sampling_held),
                                    sent)
    if all_sample:
        return sampled
    each = iter(sampled)  # some sequences do not sample (prefill chunks)
    return [next(each) if sample else None for sample in flags]


def tokens_to_proto(tokens: list[SampledToken]) -> pb.ExecuteResponse:
    if not tokens:
        return pb.ExecuteResponse()
    seq_ids, token_ids, logprobs, top_ids, top_values = zip(*tokens, strict=True)  # columns, in C
    response = pb.ExecuteResponse(seq_ids=seq_ids, token_ids=token_ids, logprobs=logprobs)
    if any(top_ids):
        response.num_top.extend(map(len, top_ids))
        response.top_token_ids.extend(chain.from_iterable(top_ids))
        response.top_logprobs.extend(chain.from_iterable(top_values))
    return response


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


def info_to_proto(info: ExecutorInfo) -> pb.InfoResponse:
    return pb.InfoResponse(**{**vars(info), "eos_token_ids": list(info.eos_token_ids)})


def info_from_proto(i: pb.InfoResponse) -> ExecutorInfo:
    return ExecutorInfo(i.model, i.model_digest, i.dtype, i.device, i.vocab_size, i.max_model_len, i.block_size,
                        i.num_blocks, i.num_cpu_blocks, tuple(i.eos_token_ids), i.kernel_backend, i.epoch,
                        i.kv_layout or "paged", i.kv_cache_dtype)
