"""The continuous-batching scheduler: which sequences run each step, with how many tokens (docs/scheduler.md).

It decides only: room first (after a running sequence got no block, the newest are preempted), then the running
sequences within the token budget (a token per decode, a chunk per unfinished prefill), then the swapped, then
admissions in arrival order while the blocks allow, less the room the running sequences are expected to grow into
(growth.py). It asks the KV client (kv_client.py) for slots, and takes the steady stretch's shortcuts from
fast_paths.py; the queues and their moves are queues.py's. Overlapped steps: step N+2 is planned and its call sent
(`plan`) while N runs, and applied (`apply`) once N's tokens are recorded.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Literal

from ..block_manager.contract import AdmitOp, BlockStats, DecodeOp, Op, OpOutcome, ReserveOp, SwapInOp, SwapOutOp
from ..common.kv_geometry import blocks_for
from ..executor.step_types import SampledToken, StepInput, new_row
from .fast_paths import FastPaths
from .growth import Growing, forked_growth, peak_growth, sharing_once, total_growth
from .kv_client import KVClient, PlannedStep
from .ports import BlockManagerPort
from .queues import SequenceQueues
from .request import SeqStatus, Sequence, StepOutput
from .sampled_tokens import check_answer, record_sampled
from .step_rows import StepRows


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
    # the next call (0: no spares; at most block_size - 1), so that the next steps need no call (kv_client.py)
    spare_lookahead: int = 8
    # the steady decode step sent as `same_batch` with no rows: for an executor port that holds the last batch
    # (RemoteExecutor, LocalExecutor); see fast_paths.py
    repeat_batches: bool = True
    # admission leaves the running sequences the blocks they are expected to grow into at their peak (growth.py);
    # False: it admits while the free blocks cover the prompt, and preemption makes room later. The servers turn it
    # on by default (`--no-reserve-growth`); an offline batch (LLM) admits while blocks last
    reserve_growth: bool = False


@dataclass
class ScheduledStep:
    sampled: list[Sequence]  # the sequences that sample a token, in the step's order (the executor's answer)
    step_input: StepInput


SWAP_WITHOUT_POOL = ("preemption by swap needs a CPU swap pool, and the cache has none: give it one"
                     " (--cpu-swap-mib > 0) or preempt by recompute")


def shares_kv(kv_layout: str) -> bool:
    """Whether sequences may share KV blocks under the executor's layout (only paged blocks can)."""
    return kv_layout == "paged"


class Scheduler(SequenceQueues):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManagerPort) -> None:
        kv = KVClient(block_manager, config.block_size, config.local_decodes, config.spare_lookahead)
        if config.preemption_mode == "swap" and kv.stats.num_cpu_blocks == 0:
            raise ValueError(SWAP_WITHOUT_POOL)
        super().__init__(kv, config.share_kv)
        self.config = config
        self.fast = FastPaths(config.block_size, config.max_model_len, kv.spare_lookahead, config.repeat_batches)
        self.starved = False  # a running sequence got no block in the last step
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_reserve_holds = 0  # plans whose admission the growth reserve stopped, not the free blocks
        self.num_generated = 0  # tokens recorded by `update`, ever (the throughput metric's count)
        self._step_ids = itertools.count(1)
        self._admissions = itertools.count(1)  # private namespaces when nothing is shared

    @property
    def stats(self) -> BlockStats:
        """The block manager's statistics as of its last answer."""
        return self.kv.stats

    def status(self) -> dict[str, Any]:
        """The queues' lengths, the block statistics, the preemptions and the reserve's holds so far (the server's
        Status, the metrics)."""
        return {"num_running": len(self.running), "num_waiting": len(self.waiting), "num_swapped": len(self.swapped),
                "stats": self.kv.stats, "num_preemptions_recompute": self.num_preemptions["recompute"],
                "num_preemptions_swap": self.num_preemptions["swap"], "num_reserve_holds": self.num_reserve_holds}

    # ---- planning ------------------------------------------------------------------------------------

    def plan(self) -> PlannedStep | None:
        """Plans the step and sends its ops in one BlockManager call, without waiting for the answer."""
        self.kv.settle()
        quiet = self._plan_quiet()
        return quiet if quiet is not None else self._plan_full()

    def _plan_quiet(self) -> PlannedStep | None:
        """A quiet stretch's plan, without a pass over the running sequences (fast_paths.py), while nothing
        else is to plan: none waiting or swapped, no forks, no starved sequence, no frees or catch-ups due."""
        if not self.fast.quiet_steps or self.waiting or self.swapped or self.fork_parents or self.starved \
                or self.kv.has_ops_due:
            return None
        local = self.fast.quiet_plan(self.running)
        return self.kv.unsent(local) if local is not None else None

    def _plan_full(self) -> PlannedStep | None:
        self.fast.stop_quiet()
        self.kv.begin()
        if self.starved:
            self._make_room()
        if self.fork_parents:  # not a pass over every running sequence each step while no request waits to fork
            self._fork_ready()
        budget, local = self._schedule_running(self.config.max_num_batched_tokens)
        room = self.config.max_num_seqs - len(self.running)
        if self.swapped:  # resume before admitting anything new
            seq = self.swapped[0]
            if room > 0 and budget > 0 and not seq.num_pending \
                    and self.kv.blocks_needed(seq, 1) <= self.kv.free_estimate:
                self.kv.swap_in(seq)
        else:
            self._admit(room, budget)
        planned = self.kv.send(local, len(self.running))
        if planned is None or not planned.routes:  # no call: a quiet stretch may start
            self.fast.start_quiet(local, self.running)
        return planned

    def _schedule_running(self, budget: int) -> tuple[int, list[Sequence]]:
        """Every running sequence, every full plan: a token for each decode (placed here when it can be), a
        chunk for each unfinished prefill. Returns the budget left and the decodes placed here."""
        kv, local = self.kv, list[Sequence]()
        for seq in self.running:
            num_tokens = min(self._remaining(seq), budget)
            if num_tokens == 0:
                continue
            if num_tokens == 1:
                if kv.place_decode(seq):
                    local.append(seq)
                    budget -= 1
                    continue
                if kv.decode(seq):
                    budget -= 1
                    continue
            if seq.num_computed + num_tokens > len(seq.token_ids):
                continue  # no Decode (see decode_token) and its input is still being sampled: next step
            budget -= num_tokens
            kv.reserve(seq, num_tokens)
        return budget, local

    def _admit(self, room: int, budget: int) -> None:
        """Admits waiting sequences in order while they fit: the first that does not stops it (nothing starves).
        One fits when the free blocks cover its chunk and, with `reserve_growth`, the growth expected of the
        running sequences, of those admitted before it and of itself at its expected peak (growth.py); with
        nothing running, its chunk alone decides, so a request that fits the cache is always admitted. The block
        manager learns only the tokens up to the target, so that a prefix hit can never make it reserve (and the
        executor compute) a token meant for after a fork."""
        group: list[Growing] | None = None  # the running sequences and those admitted so far, reckoned when needed
        taken = 0  # blocks the admitted ones took from the free ones
        for seq in self.waiting:
            target = self._target_len(seq)
            chunk = min(target, budget)
            blocks = self.kv.blocks_needed(seq, chunk)
            if room <= 0 or chunk <= 0 or blocks > self.kv.free_estimate or seq.num_pending:
                break
            if self.config.reserve_growth:
                if group is None:
                    group = self._running_growth()
                # what it holds once admitted without taking a free block: the blocks its prefix hit reuses
                entry = self.output_lengths.entry(seq, self.config.max_model_len,
                                                  held=blocks_for(chunk, self.config.block_size) - blocks)
                group.append(entry)
                if seq.index == 0 and seq.request.num_unforked:  # the samples it forks once its prompt is computed
                    group += [forked_growth(entry, self.config.block_size)] * seq.request.num_unforked
                if len(group) > 1 and not self._fits(group, self.kv.free_estimate + taken):
                    self.num_reserve_holds += 1  # (alone in the cache it is admitted whatever its expected growth)
                    break
                taken += blocks
            self.kv.admit(seq, seq.token_ids[:target], self._namespace(seq), chunk, blocks)
            room, budget = room - 1, budget - chunk

    def _running_growth(self) -> list[Growing]:
        """The running sequences as the reserve sees them, the samples of one request sharing its prompt's blocks
        once (growth.sharing_once)."""
        group: list[Growing] = []
        families: dict[int, tuple[int, list[Growing]]] = {}  # request -> its prompt length and running samples
        for seq in self.running:
            entry = self.output_lengths.entry(seq, self.config.max_model_len)
            if seq.request.params.n > 1:
                families.setdefault(id(seq.request), (seq.num_prompt_tokens, []))[1].append(entry)
            else:
                group.append(entry)
        block_size = self.config.block_size
        for prompt, family in families.values():
            group += sharing_once(family, prompt // block_size * block_size, block_size)
        return group

    def _fits(self, group: list[Growing], free: int) -> bool:
        """Whether the free blocks cover the group's expected growth: at once (the cheap bound), or at its peak."""
        block_size = self.config.block_size
        return total_growth(group, block_size) <= free or peak_growth(group, block_size) <= free

    def _make_room(self) -> None:
        """Preempts the newest running sequences until the free blocks cover what the others' next token needs."""
        free = self.kv.num_free_blocks
        needed = sum(self.kv.blocks_needed(s, min(self._remaining(s), 1)) for s in self.running)
        while self.running and free < needed:
            victim = self.running.pop()
            needed -= self.kv.blocks_needed(victim, min(self._remaining(victim), 1))
            free += len(victim.block_table)
            victim.request.num_preemptions += 1
            if self.config.preemption_mode == "swap" and self.kv.can_swap_out(victim):
                self.kv.swap_out(victim)
                victim.status = SeqStatus.SWAPPED
                self.swapped.append(victim)
                self.num_preemptions["swap"] += 1
            else:
                self.kv.free_now(victim)
                self._requeue_for_recompute(victim)
                self.num_preemptions["recompute"] += 1

    def _fork_ready(self) -> None:
        """Forks the n - 1 other samples of each first sample that computed its prompt but the last token."""
        self.fork_parents = [s for s in self.fork_parents if s.request.num_unforked > 0]
        for parent in [s for s in self.running if s.index == 0 and s.request.num_unforked > 0
                       and s.num_computed == len(s.token_ids) - 1]:
            request = parent.request
            children = [self.new_sequence(request, index, list(parent.token_ids), SeqStatus.RUNNING,
                                          parent.num_computed) for index in range(1, request.params.n)]
            request.seqs += children
            self.running += children
            request.num_unforked = 0
            self.kv.fork(parent, children)

    # ---- the executor's input ------------------------------------------------------------------------

    def apply(self, planned: PlannedStep) -> ScheduledStep | None:
        """The executor's input from the block manager's answer to a planned step. Tokens recorded between
        `plan` and `apply` (the engine collects a step meanwhile) are used; a sequence that finished since
        is left out (its blocks are freed with the next call). A deferred call's answer is not waited for."""
        answered, local = self.kv.answered(planned), planned.local
        self.starved = False
        if not answered and self.fast.repeats(local, self.kv.table_version):
            self.fast.repeat(local)  # the executor's port fills in the last batch's rows, one position on
            return ScheduledStep(local, StepInput((), step_id=next(self._step_ids),
                                                  released_seq_ids=self.kv.take_released(), same_batch=True))
        rows = StepRows(self.config.block_size)
        for (op, seqs), outcome in answered:
            granted = self.kv.take_outcome(op, seqs, outcome)
            self._take(op, granted, outcome)
            rows.add_outcome(op, granted, outcome)
        if local:
            rows.add_local(local)
        if rows.empty:
            return None  # the releases wait for the next step: an extra one would break LAST_SAMPLED's numbering
        step = rows.step(next(self._step_ids), self.kv.take_released())
        self.fast.rows_sent(rows.sampled, len(rows.inputs), self.kv.table_version)  # the rows carry every table
        return ScheduledStep(rows.sampled, step)

    def _take(self, op: Op, seqs: list[Sequence], outcome: OpOutcome) -> None:
        """One op's outcome for the queues (`seqs`: the sequences it granted); a refusal starves a running one."""
        match op:
            case DecodeOp():
                self.starved |= bool(outcome.refused_seq_ids)
            case ReserveOp() if not outcome.granted:
                self.starved |= seqs[0].status is SeqStatus.RUNNING
            case AdmitOp() if outcome.granted:
                seq, metrics = seqs[0], seqs[0].request.metrics
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = SeqStatus.RUNNING
                metrics.first_scheduled = metrics.first_scheduled or time.monotonic()
                seq.request.num_cached_tokens = max(seq.request.num_cached_tokens, outcome.num_cached_tokens)
            case SwapInOp() if outcome.granted:
                self.swapped.remove(seqs[0])
                self.running.append(seqs[0])
                seqs[0].status = SeqStatus.RUNNING
            case SwapOutOp() if not outcome.granted:  # the CPU pool is full after all: recompute instead
                self.swapped.remove(seqs[0])
                self.kv.free_later(seqs[0])
                self._requeue_for_recompute(seqs[0])

    def _namespace(self, seq: Sequence) -> bytes:
        """The request's cache namespace; when nothing may be shared, one of this admission's own, so that no
        block (not even its own from before a preemption) is ever a prefix hit."""
        if self.config.share_kv:
            return seq.request.cache_namespace
        return seq.request.cache_namespace + b"/unshared/%d" % next(self._admissions)

    # ---- results -------------------------------------------------------------------------------------

    def update(self, step: ScheduledStep, sampled: list[SampledToken]) -> list[StepOutput]:
        """Records the step's sampled tokens (sampled_tokens.py); finishes sequences that hit a stop condition.
        A `final_only` request gets an output (with no new tokens) only in the step it finishes."""
        check_answer(step.sampled, sampled)
        outputs, ended, num_recorded = record_sampled(step.sampled, sampled, self.config.max_model_len, self._finish)
        self.num_generated += num_recorded
        for request in ended:
            if request.final_only and request.finished and request not in outputs:
                outputs[request] = new_row(StepOutput, (request, []))
            self._forget_if_done(request)
        return list(outputs.values())

    # ---- helpers -------------------------------------------------------------------------------------

    def _target_len(self, seq: Sequence) -> int:
        """Tokens to compute before sampling: an n > 1 parent stops short of its last prompt token; a sequence
        whose pending tokens (being sampled) take it to its length limit computes nothing more."""
        request, num_pending = seq.request, seq.num_pending
        if request.num_unforked > 0 and seq.index == 0:
            return len(seq.token_ids) - 1
        known = len(seq.token_ids) + num_pending
        if num_pending and (known >= request.max_len or known >= self.config.max_model_len):
            return seq.num_computed
        return known

    def _remaining(self, seq: Sequence) -> int:
        return self._target_len(seq) - seq.num_computed

    # ---- the block manager and the executor ---------------------------------------------------------

    def flush(self) -> None:
        """Sends pending frees (and Advances) now (a cancelled request must not hold blocks until the next step)."""
        self.kv.flush()

    def restart(self) -> None:
        """Every sequence back to the waiting queue, to be prefilled again from the tokens it has: the block
        manager and the executor start over (a lost sidecar). Tokens being sampled are void; they were never
        seen, so nothing streamed repeats, and seeded draws depend only on (seed, position)."""
        self.starved = False
        self.kv.restart()
        self.fast.reset()  # the sidecars start over: the batch they held is gone
        self.requeue_all()

    def reset_block_manager(self) -> None:
        """Empties the block manager (after a failed step: the prefix cache may point at KV never written)."""
        self.kv.reset()

    def resume(self, stats: BlockStats) -> None:
        """The sidecars were re-synchronised (after `restart`): the block manager is empty, with these stats."""
        self.kv.resume(stats)
