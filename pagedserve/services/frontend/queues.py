"""Where each request's sequences are, and the moves between the queues that the KV client must hear of.

A sequence waits (new, or preempted by recompute: at the front), runs (in admission order: the newest is
preempted first), is swapped out to the CPU pool, or is finished. The scheduler (a subclass) decides which
moves to make each step; this class holds the queues and makes the moves every caller shares: adding a request,
ending a sequence (its blocks freed with the next call), requeueing one to be recomputed (it holds no KV).
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from .growth import OutputLengths
from .kv_client import KVClient
from .request import FinishReason, Request, SeqStatus, Sequence, SequenceOutput, StepOutput


class SequenceQueues:
    def __init__(self, kv: KVClient, share_kv: bool) -> None:
        """`share_kv`: a request's n samples share its prompt's blocks (one prefill, then a fork)."""
        self.kv, self.share_kv = kv, share_kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.swapped: deque[Sequence] = deque()
        self.requests: dict[str, Request] = {}
        self.fork_parents: list[Sequence] = []  # first samples of requests whose other samples are not forked
        self.output_lengths = OutputLengths()  # of the sequences that stopped or reached their limit
        self._seq_ids = itertools.count(1)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_waiting_requests(self) -> int:
        """Requests with a sequence waiting for admission: new ones, and preempted ones to be recomputed."""
        return len({seq.request.request_id for seq in self.waiting})

    def request(self, request_id: str) -> Request | None:
        """The request, while it has a sequence not finished."""
        return self.requests.get(request_id)

    def add(self, request: Request) -> None:
        """Queues the request's first sequence (its other samples are forked from it later), or all n of them.
        A one-token prompt has no prefix worth sharing: its n samples start as n independent sequences."""
        count = request.params.n if len(request.prompt_token_ids) < 2 or not self.share_kv else 1
        for index in range(count):
            seq = self.new_sequence(request, index, list(request.prompt_token_ids))
            request.seqs.append(seq)
            self.waiting.append(seq)
        request.num_unforked = request.params.n - count
        if request.num_unforked:
            self.fork_parents.append(request.seqs[0])
        self.requests[request.request_id] = request

    def abort(self, request_id: str) -> StepOutput | None:
        """Finishes every sequence of the request; their blocks are freed by `flush` or the next step."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        outputs = [self._finish(s, FinishReason.ABORT) for s in request.seqs if s.status is not SeqStatus.FINISHED]
        request.num_unforked = 0
        self._forget_if_done(request)
        return StepOutput(request, outputs)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends a sequence for a reason found outside the scheduler (a stop string)."""
        if seq.status is not SeqStatus.FINISHED:
            self._finish(seq, reason)
            self._forget_if_done(seq.request)

    def finish_sample(self, request_id: str, index: int) -> Request | None:
        """Ends sample `index` of the request (a stop string ended it); returns the request, if still there."""
        request = self.requests.get(request_id)
        for seq in request.seqs if request is not None else ():
            if seq.index == index:
                self.finish(seq, FinishReason.STOP)
        return request

    def new_sequence(self, request: Request, index: int, token_ids: list[int], status: SeqStatus = SeqStatus.WAITING,
                     num_computed: int = 0) -> Sequence:
        return Sequence(next(self._seq_ids), request, index, token_ids, status, num_computed)

    def requeue_all(self) -> None:
        """Every running and swapped sequence back to the waiting queue, its tokens being sampled void."""
        resumed = [*self.running, *self.swapped]  # running in admission order, then swapped: keep that order
        self.running, self.swapped = [], deque()
        for seq in reversed(resumed):
            self._requeue_for_recompute(seq)
        for seq in self.waiting:
            seq.num_pending = 0

    def _requeue_for_recompute(self, seq: Sequence) -> None:
        """Back to the front of the queue; its prompt and output so far are prefilled again on admission."""
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        self.kv.forget(seq)
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> SequenceOutput:
        self.kv.free_later(seq)
        if reason is not FinishReason.ABORT and seq.status is not SeqStatus.FINISHED:
            self.output_lengths.observe(len(seq.token_ids) - seq.num_prompt_tokens)
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.status is not SeqStatus.FINISHED:
            seq.request.num_finished += 1
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.request.metrics.finished = time.monotonic()
        return SequenceOutput(seq.seq_id, seq.index, [], reason)

    def _forget_if_done(self, request: Request) -> None:
        if request.finished:
            self.requests.pop(request.request_id, None)
