"""The continuous-batching scheduler: which sequences run each step, with how many tokens.

Each step, within a token budget and a cap on running sequences:
1. Running sequences first: one token for each decode, a chunk for each unfinished prefill (chunked
   prefill mixes with decodes). A running sequence that got no block last step makes room first: the
   newest running sequences are preempted (recompute: free and requeue at the front; or swap to the CPU
   pool), before any reservation, so every preempted sequence's stored KV is complete.
2. Swapped sequences resume (swap-in) before anything new is admitted; then waiting requests are admitted
   in arrival order (preempted ones sit at the front) while the block estimate allows: nothing starves.
3. One BlockManager call carries every op of the step; a refusal is never silent: an admission stays
   waiting, a running sequence skips the step and triggers preemption in the next.

A request with n > 1 prefills its prompt but the last token once, then forks n sequences that share those
blocks; each computes the last prompt token itself and samples with its own seed, so they diverge.

A KV layout that keeps each sequence's KV apart (virtual, static: `share_kv=False`) can share nothing: each
admission gets a namespace of its own (no prefix hits), and the n samples of a request are n independent
sequences that each prefill the prompt. Each step tells the executor which sequences were freed since the
last one (`released_seq_ids`), so such a layout gives their memory back (when the engine goes idle, at its
next step).

Overlapped steps (the engine's default): step N+2 is planned, and its BlockManager call made, while step N
runs and N+1 waits behind it; the answer is applied once N's tokens are recorded (`plan`, then `apply`).
So a sequence's two newest tokens may still be being sampled (`num_pending`). Its decode asks the executor
for LAST_SAMPLED and the block manager for a slot whose token it learns in a later Decode. `num_computed`
counts the tokens of every step already sent; a sequence with a pending token is neither admitted, swapped
in nor given a Reserve until its tokens are back, and one that will have reached its length limit is not
scheduled again; one that finished between plan and apply is left out of the step.

A decode into a free slot of the sequence's own tail block (not shared since a fork) needs no block, so the
scheduler computes its slot itself and sends no op (as vLLM v1 allocates only when a sequence enters a block):
with 16-token blocks a steady step names one running sequence in 16 to the block manager. It hears of those
slots, and their tokens, in an Advance sent before any op that needs the sequence's ledger level: the Decode
into its next block, a Reserve, a Fork, a SwapOut, a Spare, the commit before its Free; one packed Advance at
the head of the call carries them all (ledger.py).

So that most steps make no call at all, a call also takes a spare block (Spare) for every such decode that
will reach its table's end within `spare_lookahead` steps; it enters the spare without an op too. The first
sequence to take the last free slot of its table without one forces a call, which takes spares for the next
batch: with 16-token blocks and a lookahead of 8, about one step in eight calls the block manager, and no
decode needs a Decode. A call of only an Advance, Spares and Frees shapes no row of its step (every decode is
placed locally), so the step is sent without waiting for the answer, which is applied at the next plan
(`deferred`): the block manager's work is off the path to the accelerator.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..block_manager.manager import NO_TOKEN
from ..block_manager.stats import BlockStats
from ..block_manager.step import (
    AdmitOp,
    CommitOp,
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
from ..executor.step_types import SampledToken, SequenceInput, StepInput, new_row
from .ledger import PendingAdvance, decode_token
from .ports import Answered, BlockManagerPort, PendingAnswer
from .request import FinishReason, Request, SeqStatus, SequenceOutput, SequenceState, StepOutput
from .step_rows import add_decodes, add_tokens, advance_repeated, repeats_last_batch

_SEQ_ID = operator.attrgetter("seq_id")
_TOKEN_SEQ_ID = operator.itemgetter(0)  # SampledToken.seq_id


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    share_kv: bool = True  # prefix hits and forks; False for a per-sequence KV layout (ExecutorInfo.kv_layout)
    local_decodes: bool = True  # a decode into its own tail block without the block manager (False: to compare)
    # A running sequence whose table will have fewer free slots than this after its step gets a spare block at
    # the next call (0: no spares; at most block_size - 1), so that the next steps need no call (see plan)
    spare_lookahead: int = 8
    # the steady decode step (the last step's sequences again, each decoding what it sampled there) sent as
    # `same_batch` with no rows: for an executor port that holds the last batch (RemoteExecutor, LocalExecutor)
    repeat_batches: bool = True


@dataclass
class PlannedStep:
    routes: list[tuple[Op, list[SequenceState]]]  # each op with the sequences its outcome is about
    answer: PendingAnswer  # the block manager's, to the routes' ops
    local: list[SequenceState]  # decodes into a free slot of their own tail block: no block-manager op
    deferred: bool = False  # the ops shape no row of the step (Advance, Spare, Free): answer applied next plan


@dataclass
class ScheduledStep:
    sampled: list[SequenceState]  # the sequences that sample a token, in the step's order (the executor's answer)
    step_input: StepInput


SWAP_WITHOUT_POOL = ("preemption by swap needs a CPU swap pool, and the cache has none: give it one"
                     " (--cpu-swap-mib > 0) or preempt by recompute")


def shares_kv(kv_layout: str) -> bool:
    """Whether sequences may share KV blocks under the executor's layout (only paged blocks can)."""
    return kv_layout == "paged"


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManagerPort) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # in admission order: the newest is preempted first
        self.swapped: deque[SequenceState] = deque()
        self.pending: list[Op] = []  # frees of finished or aborted sequences, sent with the next call
        self.advance = PendingAdvance()  # the catch-ups the next call carries (ledger.py)
        self.requests: dict[str, Request] = {}
        self.fork_parents: list[SequenceState] = []  # first samples of requests whose other samples are not forked
        self.stats: BlockStats = block_manager.stats()
        if config.preemption_mode == "swap" and self.stats.num_cpu_blocks == 0:
            raise ValueError(SWAP_WITHOUT_POOL)
        self.starved = False  # a running sequence got no block in the last step
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.released: list[int] = []  # sequences freed in the block manager, not yet told to the executor
        self._seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._admissions = itertools.count(1)  # private namespaces when nothing is shared
        self._last_batch: list[SequenceState] = []  # the last step's sequences if every one sampled, else empty
        self._quiet_steps = 0  # plans to come that need no pass over the running sequences (_plan_quiet)
        self._quiet_running: list[SequenceState] = []  # the running sequences they are about
        self._unsettled: PlannedStep | None = None  # a deferred call sent, its answer not applied yet (_settle)
        self._tables_changed = False  # a table grew since the last step was sent: the next names its rows
        self.num_generated = 0  # tokens recorded by `update`, ever (the throughput metric's count)

    # ---- requests ------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        # a one-token prompt has no prefix worth sharing: its n samples start as n independent sequences
        count = request.params.n if len(request.prompt_token_ids) < 2 or not self.config.share_kv else 1
        for index in range(count):
            seq = SequenceState(next(self._seq_ids), request, index, list(request.prompt_token_ids))
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

    def restart(self) -> None:
        """Every sequence back to the waiting queue, to be prefilled again from the tokens it has: the block
        manager and the executor start over (a lost sidecar). Tokens being sampled are void; they were never
        seen, so nothing streamed repeats, and seeded draws depend only on (seed, position)."""
        resumed = [*self.running, *self.swapped]  # running in admission order, then swapped: keep that order
        self.running, self.swapped, self.pending, self.starved = [], deque(), [], False
        self.advance.clear()
        self.released = []  # the executor is reset too
        self._last_batch, self._quiet_steps, self._unsettled = [], 0, None  # the sidecars start over: answers void
        for seq in reversed(resumed):
            self._requeue_for_recompute(seq)
        for seq in self.waiting:
            seq.num_pending = 0

    def flush(self) -> None:
        """Sends pending frees (and Advances) now (a cancelled request must not hold blocks until the next step)."""
        self._settle()
        if self.pending or self.advance:
            ops = self.advance.take([(op, []) for op in self.pending])
            self.pending = []
            self.released += [op.seq_id for op in ops if isinstance(op, FreeOp)]
            self.stats = self.block_manager.step(ops).stats

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def has_deferred_answer(self) -> bool:
        """A deferred call's answer (spares) is not applied yet: the block manager's tables may be a block ahead."""
        return self._unsettled is not None

    # ---- planning ------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Plans the step, makes its BlockManager call, and returns the executor's input (in lock step)."""
        planned = self.plan()
        return self.apply(planned) if planned is not None else None

    def apply(self, planned: PlannedStep) -> ScheduledStep | None:
        """The executor's input from the block manager's answer to a planned step. Tokens recorded between
        `plan` and `apply` (the engine collects a step meanwhile) are used; a sequence that finished since
        is left out (its blocks are freed with the next call). A deferred call's answer is not waited for."""
        if planned.deferred:
            self._unsettled = planned
            return self._apply_answer([], [], planned.local)
        answer = planned.answer.result()
        self.stats = answer.stats
        return self._apply_answer(planned.routes, answer.outcomes, planned.local)

    def plan(self) -> PlannedStep | None:
        """Plans the step and sends its ops in one BlockManager call, without waiting for the answer."""
        self._settle()
        quiet = self._plan_quiet()
        return quiet if quiet is not None else self._plan_full()

    def _plan_quiet(self) -> PlannedStep | None:
        """The plan of a step in a quiet stretch, without a pass over the running sequences: the last full plan
        found every running sequence decoding into its own tail block or spare, no call to make, and how many
        steps more that holds (`_quiet_steps`), and nothing changed since (the same running sequences, none
        waiting or swapped, no frees, catch-ups or forks to send). The full plan would find the same."""
        if not self._quiet_steps or self.pending or self.waiting or self.swapped or self.fork_parents \
                or self.starved or self.advance:
            return None
        running, quiet = self.running, self._quiet_running
        if len(running) != len(quiet) or not all(map(operator.is_, running, quiet)):
            return None
        self._quiet_steps -= 1
        return PlannedStep([], Answered(StepAnswer([], self.stats)), list(running))

    def _quiet_steps_after(self, local: list[SequenceState]) -> int:
        """How many plans after this one find `local`, every running sequence, decoding into its own blocks with
        nothing to send: while each has a free slot past the ones planned (a step takes one), and its known
        tokens (each step adds one, sampled or pending) stay short of its length limit (`_target_len`). With
        spares, the stretch ends one slot earlier: the plan after it finds the tightest sequence at its last free
        slot, which forces the call that takes its spare (else it would need a Decode a step later)."""
        block_size, max_model_len = self.config.block_size, self.config.max_model_len
        margin = 2 if self._spare_lookahead else 1
        room = min(len(s.block_table) * block_size - s.num_computed for s in local) - margin
        to_limit = min(min(s.request.max_len, max_model_len) - len(s.token_ids) - s.num_pending for s in local) - 1
        return max(0, min(room, to_limit))

    def _plan_full(self) -> PlannedStep | None:
        self._quiet_steps = 0
        routes: list[tuple[Op, list[SequenceState]]] = [(op, []) for op in self.pending]
        self.pending = []
        if self.starved:
            routes += self._make_room()
        budget = self.config.max_num_batched_tokens
        if self.fork_parents:  # not a pass over every running sequence each step while no request waits to fork
            self.fork_parents = [s for s in self.fork_parents if s.request.num_unforked > 0]
            for parent in [s for s in self.running if self._ready_to_fork(s)]:
                self.advance.add(parent)  # a child's copy-on-write copies the tail slots the ledger has
                routes += [(ForkOp(parent.seq_id, child.seq_id), [child]) for child in self._fork(parent)]
        decode_seqs: list[SequenceState] = []
        decode_tokens: list[int] = []
        local: list[SequenceState] = []
        spare_wanted: list[SequenceState] = []  # local decodes near their table's end, with no spare
        free_estimate = self.stats.num_free_blocks - self._watermark_blocks()
        block_size, local_decodes, lookahead = self.config.block_size, self.config.local_decodes, self._spare_lookahead
        spare_due = False  # a local decode takes its table's last free slot: its spare cannot wait for a later call
        for seq in self.running:  # every running sequence, every step: the one-token case written out
            num_tokens = min(self._remaining(seq), budget)
            if num_tokens == 0:
                continue
            if num_tokens == 1:
                room = len(seq.block_table) * block_size - seq.num_computed  # free slots of its tail and spare
                if local_decodes and seq.tail_private and room > 0:
                    budget -= 1  # its slot is in its own tail block or spare: nothing for the block manager to do
                    local.append(seq)
                    if seq.num_committed + seq.num_local_slots + 1 < seq.num_computed:
                        self.advance.add(seq)  # a prefill chunk's commit: its full blocks join the prefix cache now
                    if room <= lookahead and not seq.request.num_unforked:  # a fork parent may hold no spare
                        spare_wanted.append(seq)
                        spare_due |= room == 1
                    continue
                if seq.num_local_slots:
                    self.advance.add(seq)
                told = decode_token(seq)
                if told is not None:  # the block manager's ledger as of this call (undone for a refusal)
                    seq.num_committed = seq.num_computed
                    seq.num_known_to_manager += told != NO_TOKEN
                    budget -= 1
                    # _blocks_needed(seq, 1) of a running sequence
                    free_estimate -= max(0, -(-(seq.num_computed + 1) // block_size) - len(seq.block_table))
                    decode_seqs.append(seq)
                    decode_tokens.append(told)
                    continue
            if seq.num_computed + num_tokens > len(seq.token_ids):
                continue  # no Decode (see decode_token) and its input is still being sampled: next step
            budget -= num_tokens
            free_estimate -= self._blocks_needed(seq, num_tokens)
            routes += self._reserve(seq, num_tokens)
        if decode_seqs:
            routes.append((DecodeOp([s.seq_id for s in decode_seqs], decode_tokens), decode_seqs))
        room = self.config.max_num_seqs - len(self.running)
        if self.swapped:  # resume before admitting anything new
            seq = self.swapped[0]
            if room > 0 and budget > 0 and not seq.num_pending and self._blocks_needed(seq, 1) <= free_estimate:
                routes.append((SwapInOp([seq.seq_id]), [seq]))
                routes += self._reserve(seq, 1)
        else:
            for seq in self.waiting:
                target = self._target_len(seq)
                chunk = min(target, budget)
                blocks = self._blocks_needed(seq, chunk)
                if room <= 0 or chunk <= 0 or blocks > free_estimate or seq.num_pending:
                    break
                # the block manager learns only the tokens up to the target, so that a prefix hit can never
                # make it reserve (and the executor compute) a token meant for after a fork
                admit = AdmitOp(seq.seq_id, seq.token_ids[:target], self._namespace(seq), chunk)
                routes.append((admit, [seq]))
                room, budget, free_estimate = room - 1, budget - chunk, free_estimate - blocks
        # Spares for the decodes that would soon need one, while a block per running sequence stays free besides,
        # so that the next steps need no call (blocks are taken k steps early): with a call made anyway, or one
        # that a decode at its last free slot forces.
        num_spares = min(len(spare_wanted), free_estimate - len(self.running))
        if not routes and not self.advance and not (spare_due and num_spares > 0):
            if local and len(local) == len(self.running):  # a quiet stretch may start: see _plan_quiet
                self._quiet_steps, self._quiet_running = self._quiet_steps_after(local), list(self.running)
            return PlannedStep([], Answered(StepAnswer([], self.stats)), local) if local else None
        if num_spares > 0:
            spares = spare_wanted[:num_spares]
            for seq in spares:
                self.advance.add(seq)  # the block manager checks the spare against the slots it knows
            routes.append((SpareOp([s.seq_id for s in spares]), spares))
        self.released += [op.seq_id for op, _ in routes if isinstance(op, FreeOp)]
        deferred = all(isinstance(op, SpareOp | FreeOp) for op, _ in routes)  # and the Advance: none shape a row
        ops = self.advance.take(routes)
        return PlannedStep(routes, self.block_manager.send(ops), local, deferred)

    @property
    def _spare_lookahead(self) -> int:
        return min(self.config.spare_lookahead, self.config.block_size - 1)  # fewer free slots than a block: none

    def _settle(self) -> None:
        """Applies a deferred call's answer (its spares join their tables) before anything else is planned or
        sent; its error, if any, is this plan's."""
        planned, self._unsettled = self._unsettled, None
        if planned is not None:
            answer = planned.answer.result()
            self.stats = answer.stats
            for (_, seqs), outcome in zip(planned.routes, answer.outcomes, strict=True):
                self._take_deltas(seqs, outcome)

    def _take_deltas(self, seqs: list[SequenceState], outcome: OpOutcome) -> None:
        if not outcome.deltas:  # most ops change no table: no index of their sequences
            return
        by_id = {s.seq_id: s for s in seqs}
        for delta in outcome.deltas:
            if (seq := by_id.get(delta.seq_id)) is not None:
                # a new list, never changed in place: a step's input holds the table it was sent with
                seq.block_table = seq.block_table[: delta.keep] + list(delta.append)
                self._tables_changed = True

    def _reserve(self, seq: SequenceState, num_tokens: int) -> list[tuple[Op, list[SequenceState]]]:
        routes: list[tuple[Op, list[SequenceState]]] = []
        if seq.status is SeqStatus.RUNNING:
            self.advance.add(seq)  # the commit of what it computed, and any slots it placed itself
        elif seq.num_committed < seq.num_computed:  # swapped in by this call (after the Advance that heads it)
            routes.append((CommitOp(seq.seq_id, seq.num_computed), []))
            seq.num_committed = seq.num_computed
        append = seq.token_ids[seq.num_known_to_manager : seq.num_computed + num_tokens]
        assert seq.num_computed + num_tokens <= len(seq.token_ids), f"reserve of {seq.seq_id}: tokens not known yet"
        routes.append((ReserveOp(seq.seq_id, num_tokens, append), [seq]))
        return routes

    def _apply_answer(
        self, routes: list[tuple[Op, list[SequenceState]]], outcomes: list[OpOutcome], local: list[SequenceState]
    ) -> ScheduledStep | None:
        inputs: list[SequenceInput] = []  # in the order of the routes
        sampled: list[SequenceState] = []  # the sequences that sample a token, in the order of `inputs`
        copies: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        swap_out: list[tuple[int, int]] = []
        self.starved = False
        if not routes and not self._tables_changed and self.config.repeat_batches \
                and repeats_last_batch(local, self._last_batch):
            return self._repeat(local)
        now = time.monotonic()
        for (op, seqs), outcome in zip(routes, outcomes, strict=True):
            self._take_deltas(seqs, outcome)
            if outcome.copies or outcome.swap_in or outcome.swap_out:
                copies += [(c.src, c.dst) for c in outcome.copies]
                swap_in += [(c.src, c.dst) for c in outcome.swap_in]
                swap_out += [(c.src, c.dst) for c in outcome.swap_out]
            match op:
                case DecodeOp():
                    told_tokens: Sequence[int] = op.token_ids
                    if outcome.refused_seq_ids:  # committed, but told nothing and given nothing
                        refused = set(outcome.refused_seq_ids)
                        for seq, told in zip(seqs, told_tokens, strict=True):
                            seq.num_known_to_manager -= seq.seq_id in refused and told != NO_TOKEN
                        seqs = [s for s in seqs if s.seq_id not in refused]
                        self.starved = True
                    for seq in seqs:
                        seq.tail_private = True  # a new tail block, or its own copy of a shared one
                    add_decodes(seqs, outcome.slot_mapping, self.config.block_size, inputs, sampled)
                case ReserveOp() if outcome.granted:
                    (seq,) = seqs
                    seq.num_known_to_manager = seq.num_computed + op.num_tokens
                    seq.tail_private |= op.num_tokens > 0  # a shared tail written into was copied
                    add_tokens(seq, list(outcome.slot_mapping), inputs, sampled)
                case ReserveOp():
                    self.starved |= seqs[0].status is SeqStatus.RUNNING
                case AdmitOp() if outcome.granted:
                    (seq,) = seqs
                    self.waiting.remove(seq)
                    self.running.append(seq)
                    seq.status = SeqStatus.RUNNING
                    seq.num_computed = seq.num_committed = outcome.num_cached_tokens
                    seq.num_known_to_manager = len(op.token_ids)
                    seq.tail_private = True  # prefix hits are whole blocks: the tail is new
                    add_tokens(seq, list(outcome.slot_mapping), inputs, sampled)
                    seq.request.metrics.first_scheduled = seq.request.metrics.first_scheduled or now
                    seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, outcome.num_cached_tokens)
                case SwapInOp() if outcome.granted:
                    (seq,) = seqs
                    self.swapped.remove(seq)
                    self.running.append(seq)
                    seq.status = SeqStatus.RUNNING
                case SwapOutOp() if outcome.granted:
                    seqs[0].block_table = []
                    seqs[0].tail_private = False
                case SwapOutOp():  # the CPU pool is full after all: recompute instead
                    (seq,) = seqs
                    self.swapped.remove(seq)
                    self.pending.append(FreeOp(seq.seq_id))
                    self._requeue_for_recompute(seq)
        if local:
            add_decodes(local, None, self.config.block_size, inputs, sampled)
        if not inputs and not (swap_out or swap_in or copies):
            return None  # the releases wait for the next step: an extra one would break LAST_SAMPLED's numbering
        step = StepInput(inputs, swap_out=swap_out, swap_in=swap_in, copies=copies, step_id=next(self._step_ids),
                         released_seq_ids=self._take_released())
        self._tables_changed = False  # the rows carry every table
        self._last_batch = sampled if len(sampled) == len(inputs) else []
        return ScheduledStep(sampled, step)

    def _repeat(self, local: list[SequenceState]) -> ScheduledStep:
        """The steady decode step: the decodes advanced (step_rows.advance_repeated), and a step that names no
        sequence (`same_batch`): the executor's port fills in the last batch's, one position on, each slot by the
        slot rule over the table it holds (the slot `add_decodes` would compute)."""
        advance_repeated(local)
        step = StepInput((), step_id=next(self._step_ids), released_seq_ids=self._take_released(), same_batch=True)
        return ScheduledStep(local, step)

    def _take_released(self) -> list[int]:
        released, self.released = self.released, []
        return released

    def _namespace(self, seq: SequenceState) -> bytes:
        """The request's cache namespace; when nothing may be shared, one of this admission's own, so that no
        block (not even its own from before a preemption) is ever a prefix hit."""
        if self.config.share_kv:
            return seq.request.cache_namespace
        return seq.request.cache_namespace + b"/unshared/%d" % next(self._admissions)

    # ---- results -------------------------------------------------------------------------------------

    def update(self, step: ScheduledStep, sampled: list[SampledToken]) -> list[StepOutput]:
        """Records the step's sampled tokens; finishes sequences that hit a stop condition. A sequence that
        finished (or was aborted) after the step was sent drops its token: it is never streamed. A `final_only`
        request gets an output (with no new tokens) only in the step it finishes."""
        # Runs for every sequence every step, on the path that must fit in the executor's step time: one plain
        # loop over the rows unpacked, limits looked up once per request.
        now = time.monotonic()
        outputs: dict[Request, StepOutput] = {}
        ended: list[Request] = []
        max_model_len = self.config.max_model_len
        finished = SeqStatus.FINISHED
        if len(sampled) != len(step.sampled):
            raise RuntimeError(f"the executor sampled {len(sampled)} tokens for {len(step.sampled)} sequences")
        if list(map(_TOKEN_SEQ_ID, sampled)) != list(map(_SEQ_ID, step.sampled)):  # in the step's order
            token, seq = next((t, s) for t, s in zip(sampled, step.sampled, strict=True) if t.seq_id != s.seq_id)
            raise RuntimeError(f"the executor answered for sequence {token.seq_id}, not {seq.seq_id}")
        dropped = 0
        for seq, (_, token_id, logprob, top_ids, top_logprobs) in zip(step.sampled, sampled, strict=True):
            seq.num_pending -= 1
            if seq.status is finished:
                dropped += 1
                continue
            request = seq.request
            token_ids = seq.token_ids
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
                self._finish(seq, FinishReason.STOP)
                ended.append(request)
            elif len(token_ids) >= request.max_len or len(token_ids) >= max_model_len:
                self._finish(seq, FinishReason.LENGTH)
                ended.append(request)
            if request.final_only:
                continue
            output = outputs.get(request)
            if output is None:
                output = outputs[request] = new_row(StepOutput, (request, []))
            output.outputs.append(SequenceOutput(seq.seq_id, seq.index, (token_id,), seq.finish_reason, (logprob,),
                                                 (top,)))
        self.num_generated += len(sampled) - dropped
        for request in ended:
            if request.final_only and request.finished and request not in outputs:
                outputs[request] = new_row(StepOutput, (request, []))
            self._forget_if_done(request)
        return list(outputs.values())

    def finish(self, seq: SequenceState, reason: FinishReason) -> None:
        """Ends a sequence for a reason found outside the scheduler (a stop string)."""
        if seq.status is not SeqStatus.FINISHED:
            self._finish(seq, reason)
            self._forget_if_done(seq.request)

    # ---- helpers -------------------------------------------------------------------------------------

    def _target_len(self, seq: SequenceState) -> int:
        """Tokens to compute before sampling: an n > 1 parent stops short of its last prompt token; a sequence
        whose pending tokens (being sampled) take it to its length limit computes nothing more."""
        request, num_pending = seq.request, seq.num_pending
        if request.num_unforked > 0 and seq.index == 0:
            return len(seq.token_ids) - 1
        known = len(seq.token_ids) + num_pending
        if num_pending and (known >= request.max_len or known >= self.config.max_model_len):
            return seq.num_computed
        return known

    def _remaining(self, seq: SequenceState) -> int:
        return self._target_len(seq) - seq.num_computed

    def _ready_to_fork(self, seq: SequenceState) -> bool:
        return seq.index == 0 and seq.request.num_unforked > 0 and seq.num_computed == len(seq.token_ids) - 1

    def _fork(self, parent: SequenceState) -> list[SequenceState]:
        request = parent.request
        parent.tail_private = False  # the children share its tail block until each one's first Decode copies it
        children = []
        for index in range(1, request.params.n):
            child = SequenceState(
                next(self._seq_ids), request, index, list(parent.token_ids), SeqStatus.RUNNING,
                parent.num_computed, parent.num_known_to_manager, parent.num_committed, list(parent.block_table),
            )
            request.seqs.append(child)
            self.running.append(child)
            children.append(child)
        request.num_unforked = 0
        return children

    def _watermark_blocks(self) -> int:
        return int(self.stats.watermark * self.stats.num_total_blocks)

    def _blocks_needed(self, seq: SequenceState, num_tokens: int) -> int:
        """New blocks to hold num_tokens more tokens (a resumed sequence gets its whole table back)."""
        held = len(seq.block_table) if seq.status is SeqStatus.RUNNING else 0
        return max(0, -(-(seq.num_computed + num_tokens) // self.config.block_size) - held)

    def _make_room(self) -> list[tuple[Op, list[SequenceState]]]:
        """Preempts the newest running sequences until the free-block estimate covers the others' next step."""
        routes: list[tuple[Op, list[SequenceState]]] = []
        free = self.stats.num_free_blocks
        needed = sum(self._blocks_needed(s, min(self._remaining(s), 1)) for s in self.running)
        while self.running and free < needed:
            victim = self.running.pop()
            needed -= self._blocks_needed(victim, min(self._remaining(victim), 1))
            free += len(victim.block_table)
            victim.request.num_preemptions += 1
            swap = self.config.preemption_mode == "swap" and len(victim.block_table) <= self.stats.num_free_cpu_blocks
            if swap:
                self.advance.add(victim)  # the swap copies the slots the ledger has
                routes.append((SwapOutOp([victim.seq_id]), [victim]))
                victim.status = SeqStatus.SWAPPED
                self.swapped.append(victim)
                self.num_preemptions["swap"] += 1
            else:
                routes.append((FreeOp(victim.seq_id), [victim]))
                self._requeue_for_recompute(victim)
                self.num_preemptions["recompute"] += 1
        return routes

    def _requeue_for_recompute(self, seq: SequenceState) -> None:
        """Back to the front of the queue; its prompt and output so far are prefilled again on admission."""
        seq.status = SeqStatus.WAITING
        seq.block_table = []
        seq.num_computed = seq.num_known_to_manager = seq.num_committed = seq.num_local_slots = 0
        seq.tail_private = False
        self.waiting.appendleft(seq)

    def _finish(self, seq: SequenceState, reason: FinishReason) -> SequenceOutput:
        if seq.status is SeqStatus.RUNNING:
            # its computed blocks join the prefix cache before they are freed (a one-token request's prompt too).
            # Steps still in flight that write them run before any step that could hit them.
            self.advance.add(seq)
        if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
            self.pending.append(FreeOp(seq.seq_id))
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
