"""The executor's sampled tokens recorded into their sequences, and each request's output of the step."""

from __future__ import annotations

import operator
import time
from collections.abc import Callable

from ..executor.step_types import SampledToken, new_row
from .request import FinishReason, Request, SeqStatus, Sequence, SequenceOutput, StepOutput

_SEQ_ID = operator.attrgetter("seq_id")
_TOKEN_SEQ_ID = operator.itemgetter(0)  # SampledToken.seq_id


def check_answer(seqs: list[Sequence], sampled: list[SampledToken]) -> None:
    """The executor answered one token per sampling sequence of the step, in the step's order."""
    if len(sampled) != len(seqs):
        raise RuntimeError(f"the executor sampled {len(sampled)} tokens for {len(seqs)} sequences")
    if list(map(_TOKEN_SEQ_ID, sampled)) != list(map(_SEQ_ID, seqs)):
        token, seq = next((t, s) for t, s in zip(sampled, seqs, strict=True) if t.seq_id != s.seq_id)
        raise RuntimeError(f"the executor answered for sequence {token.seq_id}, not {seq.seq_id}")


def record_sampled(seqs: list[Sequence], sampled: list[SampledToken], max_model_len: int,
                   finish: Callable[[Sequence, FinishReason], object]
                   ) -> tuple[dict[Request, StepOutput], list[Request], int]:
    """Appends each sequence's token (`sampled[i]` is `seqs[i]`'s), and calls `finish` for one that reached a
    stop token or its length limit. A sequence that finished after the step was sent drops its token: it is
    never streamed. Returns the outputs by request (none for a `final_only` request), the requests a sequence of
    which ended, and the number of tokens recorded."""
    # every sequence, every step: one plain loop over the rows unpacked, limits looked up once per request
    now, finished = time.monotonic(), SeqStatus.FINISHED
    outputs: dict[Request, StepOutput] = {}
    ended: list[Request] = []
    dropped = 0
    for seq, (_, token_id, logprob, top_ids, top_logprobs) in zip(seqs, sampled, strict=True):
        seq.num_pending -= 1
        if seq.status is finished:
            dropped += 1
            continue
        request, token_ids = seq.request, seq.token_ids
        token_ids.append(token_id)
        seq.logprobs.append(logprob)
        # () when none were asked for: the empty tuple is one object the collector never tracks
        top = tuple(zip(top_ids, top_logprobs, strict=True)) if top_ids else ()
        seq.top_logprobs.append(top)
        metrics = request.metrics
        if metrics.first_token is None:
            metrics.first_token = now
        if seq.index == 0:
            metrics.token_times.append(now)
        if token_id in request.stop_ids:
            finish(seq, FinishReason.STOP)
            ended.append(request)
        elif len(token_ids) >= request.max_len or len(token_ids) >= max_model_len:
            finish(seq, FinishReason.LENGTH)
            ended.append(request)
        if request.final_only:
            continue
        output = outputs.get(request)
        if output is None:
            output = outputs[request] = new_row(StepOutput, (request, []))
        output.outputs.append(SequenceOutput(seq.seq_id, seq.index, (token_id,), seq.finish_reason, (logprob,),
                                             (top,)))
    return outputs, ended, len(sampled) - dropped
