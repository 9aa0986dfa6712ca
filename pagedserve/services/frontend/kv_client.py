"""The frontend's side of the block manager: what the scheduler asks of the KV cache, as one object.

As vLLM v1's KVCacheManager sits beside its scheduler, `KVClient` sits beside ours: the scheduler decides
(admission, budgets, preemption, chunking) and asks it for slots; it owns everything the frontend mirrors of
the block manager's state and every call to it:
- the ledger (the sequences' mirror fields, request.py) and the Advance that brings the block manager level
  with the decodes placed here (ledger.py);
- the call being planned: each step's ops, gathered as the scheduler asks (`place_decode`, `decode`,
  `reserve`, `admit`, `fork`, `swap_in`, `swap_out`, `free_now`) and sent at once (`send`), with spares for the
  decodes near their table's end;
- the answers: applied to the tables (`take_outcome`), or, for a deferred call (only an Advance, Spares and
  Frees, which shape no row of its step), applied at the next plan (`settle`);
- the frees of finished sequences (sent with the next call, or by `flush`), and the release list: the sequences
  freed in the block manager that the executor has not been told of (`take_released`).

A decode into a free slot of the sequence's own tail block (or spare) needs no op: its slot is computed here
(step_rows.py) and the block manager hears of it in a later Advance. So that most steps make no call at all,
a call also takes a spare block (Spare) for each such decode within `spare_lookahead` slots of its table's
end, while a block per running sequence stays free besides; the first decode to take its table's last free
slot without one forces a call (docs/scheduler.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..block_manager.contract import (
    NO_TOKEN,
    AdmitOp,
    BlockStats,
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
from ..common.kv_geometry import blocks_for
from .ledger import PendingAdvance, decode_token
from .ports import Answered, BlockManagerPort, PendingAnswer
from .request import SeqStatus, Sequence

Route = tuple[Op, list[Sequence]]  # an op with the sequences its outcome is about


@dataclass
class PlannedStep:
    routes: list[Route]
    answer: PendingAnswer  # the block manager's, to the routes' ops
    local: list[Sequence]  # decodes into a free slot of their own blocks: no block-manager op
    deferred: bool = False  # the ops shape no row of the step (Advance, Spare, Free): answer applied next plan


class KVClient:
    def __init__(self, port: BlockManagerPort, block_size: int, local_decodes: bool = True,
                 spare_lookahead: int = 8) -> None:
        """`local_decodes`: place decodes into a sequence's own blocks here (False: every decode an op, to
        compare); `spare_lookahead`: in slots, at most block_size - 1 (fewer free slots than a block: none)."""
        self.port, self.block_size, self.local_decodes = port, block_size, local_decodes
        self.spare_lookahead = min(spare_lookahead, block_size - 1)
        self.stats: BlockStats = port.stats()  # as of the last answer
        self.table_version = 0  # bumped whenever a table changes (the repeated batch holds the tables it sent)
        self._advance = PendingAdvance()  # the catch-ups the next call carries
        self._frees: list[Op] = []  # frees of finished or aborted sequences, sent with the next call
        self._released: list[int] = []  # sequences freed in the block manager, not yet told to the executor
        self._unsettled: PlannedStep | None = None  # a deferred call sent, its answer not applied yet
        # the call being planned, from `begin` to `send`
        self._routes: list[Route] = []
        self._decodes: list[Sequence] = []
        self._decode_tokens: list[int] = []
        self._spare_wanted: list[Sequence] = []  # local decodes near their table's end, with no spare
        self._spare_due = False  # a local decode takes its table's last free slot: its spare cannot wait
        self.free_estimate = 0  # free blocks above the watermark, less what the call being planned takes

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def has_deferred_answer(self) -> bool:
        """A deferred call's answer (spares) is not applied yet: the block manager's tables may be a block ahead."""
        return self._unsettled is not None

    @property
    def has_ops_due(self) -> bool:
        """Frees or catch-ups wait to be sent: the next plan makes a call."""
        return bool(self._frees or self._advance)

    @property
    def has_released(self) -> bool:
        """Sequences were freed that the executor has not been told of (the next step tells it)."""
        return bool(self._released)

    @property
    def num_free_blocks(self) -> int:
        return self.stats.num_free_blocks

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.stats.num_free_cpu_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks to hold num_tokens more tokens (a resumed sequence gets its whole table back)."""
        held = len(seq.block_table) if seq.status is SeqStatus.RUNNING else 0
        return max(0, blocks_for(seq.num_computed + num_tokens, self.block_size) - held)

    # ---- planning a call -----------------------------------------------------------------------------

    def begin(self) -> None:
        """Starts the next call's ops with the frees waiting to be sent."""
        self._routes = [(op, []) for op in self._frees]
        self._frees = []
        self._decodes, self._decode_tokens, self._spare_wanted, self._spare_due = [], [], [], False
        self.free_estimate = self.stats.num_free_blocks - int(self.stats.watermark * self.stats.num_total_blocks)

    def place_decode(self, seq: Sequence) -> bool:
        """A decode into a free slot of the sequence's own tail block or spare: nothing for the block manager to
        do now (its slot is computed with the step's rows). False when it needs the block manager."""
        room = len(seq.block_table) * self.block_size - seq.num_computed  # free slots of its tail and spare
        if not (self.local_decodes and seq.tail_private and room > 0):
            return False
        if seq.num_committed + seq.num_local_slots + 1 < seq.num_computed:
            self._advance.add(seq)  # a prefill chunk's commit: its full blocks join the prefix cache now
        if room <= self.spare_lookahead and not seq.request.num_unforked:  # a fork parent may hold no spare
            self._spare_wanted.append(seq)
            self._spare_due |= room == 1
        return True

    def decode(self, seq: Sequence) -> bool:
        """A one-token step through the Decode fast path; False when it cannot take it (see decode_token)."""
        if seq.num_local_slots:
            self._advance.add(seq)
        told = decode_token(seq)
        if told is None:
            return False
        seq.num_committed = seq.num_computed  # the ledger as of this call (undone for a refusal)
        seq.num_known_to_manager += told != NO_TOKEN
        self.free_estimate -= max(0, blocks_for(seq.num_computed + 1, self.block_size) - len(seq.block_table))
        self._decodes.append(seq)
        self._decode_tokens.append(told)
        return True

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Slots for the sequence's next num_tokens tokens (a chunk, or a decode off the fast path)."""
        self.free_estimate -= self.blocks_needed(seq, num_tokens)
        self._reserve(seq, num_tokens)

    def _reserve(self, seq: Sequence, num_tokens: int) -> None:
        if seq.status is SeqStatus.RUNNING:
            self._advance.add(seq)  # the commit of what it computed, and any slots it placed itself
        elif seq.num_committed < seq.num_computed:  # swapped in by this call (after the Advance that heads it)
            self._routes.append((CommitOp(seq.seq_id, seq.num_computed), []))
            seq.num_committed = seq.num_computed
        append = seq.token_ids[seq.num_known_to_manager : seq.num_computed + num_tokens]
        assert seq.num_computed + num_tokens <= len(seq.token_ids), f"reserve of {seq.seq_id}: tokens not known yet"
        self._routes.append((ReserveOp(seq.seq_id, num_tokens, append), [seq]))

    def _close_decodes(self) -> None:
        """The running sequences' Decode op, after their Reserves and before anything swapped in or admitted."""
        if self._decodes:
            self._routes.append((DecodeOp([s.seq_id for s in self._decodes], self._decode_tokens), self._decodes))
            self._decodes, self._decode_tokens = [], []

    def admit(self, seq: Sequence, token_ids: list[int], namespace: bytes, num_tokens: int, num_blocks: int) -> None:
        """A new sequence with its known tokens (prefix hits looked up), num_tokens of them computed this step."""
        self._close_decodes()
        self._routes.append((AdmitOp(seq.seq_id, token_ids, namespace, num_tokens), [seq]))
        self.free_estimate -= num_blocks

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """The children share the parent's blocks (they start with its table and ledger); each one's first write
        into the shared tail copies it."""
        self._advance.add(parent)  # a child's copy-on-write copies the tail slots the ledger has
        parent.tail_private = False  # shared until each child's first Decode copies it
        for child in children:
            child.num_known_to_manager, child.num_committed = parent.num_known_to_manager, parent.num_committed
            child.block_table = list(parent.block_table)
        self._routes += [(ForkOp(parent.seq_id, child.seq_id), [child]) for child in children]

    def swap_in(self, seq: Sequence) -> None:
        """Its blocks back from the CPU pool, and a slot for its next token."""
        self._close_decodes()
        self._routes.append((SwapInOp([seq.seq_id]), [seq]))
        self._reserve(seq, 1)

    def swap_out(self, seq: Sequence) -> None:
        """Its blocks to the CPU pool (preemption by swap)."""
        self._advance.add(seq)  # the swap copies the slots the ledger has
        self._routes.append((SwapOutOp([seq.seq_id]), [seq]))

    def free_now(self, seq: Sequence) -> None:
        """Frees its blocks in this call (preemption by recompute); the caller forgets its KV (`forget`)."""
        self._routes.append((FreeOp(seq.seq_id), [seq]))

    def send(self, local: list[Sequence], num_running: int) -> PlannedStep | None:
        """Sends the planned ops in one call, without waiting for the answer; None when there is nothing to send
        and no decode to run. A call made anyway takes spares for the decodes that would soon need one, while a
        block per running sequence stays free besides (blocks are taken a few steps early); so does a call that
        a decode at its last free slot forces."""
        self._close_decodes()
        routes = self._routes
        num_spares = min(len(self._spare_wanted), self.free_estimate - num_running)
        if not routes and not self._advance and not (self._spare_due and num_spares > 0):
            return self.unsent(local) if local else None
        if num_spares > 0:
            spares = self._spare_wanted[:num_spares]
            for seq in spares:
                self._advance.add(seq)  # the block manager checks the spare against the slots it knows
            routes.append((SpareOp([s.seq_id for s in spares]), spares))
        self._released += [op.seq_id for op, _ in routes if isinstance(op, FreeOp)]
        deferred = all(isinstance(op, SpareOp | FreeOp) for op, _ in routes)  # and the Advance: none shape a row
        ops = self._advance.take(routes)
        self._routes = []
        return PlannedStep(routes, self.port.send(ops), local, deferred)

    def unsent(self, local: list[Sequence]) -> PlannedStep:
        """A plan of decodes placed here only: no call, its answer the stats as they are."""
        return PlannedStep([], Answered(StepAnswer([], self.stats)), local)

    # ---- answers -------------------------------------------------------------------------------------

    def answered(self, planned: PlannedStep) -> list[tuple[Route, OpOutcome]]:
        """Each op of a planned call with its outcome, waited for. A deferred call's answer is not waited for
        (none here): it is applied by the next `settle`."""
        if planned.deferred:
            self._unsettled = planned
            return []
        answer = planned.answer.result()
        self.stats = answer.stats
        return list(zip(planned.routes, answer.outcomes, strict=True))

    def settle(self) -> None:
        """Applies a deferred call's answer (its spares join their tables) before anything else is planned or
        sent; its error, if any, is raised here."""
        planned, self._unsettled = self._unsettled, None
        if planned is not None:
            answer = planned.answer.result()
            self.stats = answer.stats
            for (_, seqs), outcome in zip(planned.routes, answer.outcomes, strict=True):
                self._take_deltas(seqs, outcome)

    def take_outcome(self, op: Op, seqs: list[Sequence], outcome: OpOutcome) -> list[Sequence]:
        """Applies one op's outcome to the mirror (the tables, and what the block manager now knows); returns
        the sequences it granted (a Decode may refuse some: committed, but told nothing and given nothing)."""
        self._take_deltas(seqs, outcome)
        match op:
            case DecodeOp():
                if outcome.refused_seq_ids:
                    refused = set(outcome.refused_seq_ids)
                    for seq, told in zip(seqs, op.token_ids, strict=True):
                        seq.num_known_to_manager -= seq.seq_id in refused and told != NO_TOKEN
                    seqs = [s for s in seqs if s.seq_id not in refused]
                for seq in seqs:
                    seq.tail_private = True  # a new tail block, or its own copy of a shared one
            case ReserveOp() if outcome.granted:
                seqs[0].num_known_to_manager = seqs[0].num_computed + op.num_tokens
                seqs[0].tail_private |= op.num_tokens > 0  # a shared tail written into was copied
            case AdmitOp() if outcome.granted:
                seq = seqs[0]
                seq.num_computed = seq.num_committed = outcome.num_cached_tokens  # prefix hits count as computed
                seq.num_known_to_manager = len(op.token_ids)
                seq.tail_private = True  # prefix hits are whole blocks: the tail is new
            case SwapOutOp() if outcome.granted:
                seqs[0].block_table = []
                seqs[0].tail_private = False
        return seqs

    def _take_deltas(self, seqs: list[Sequence], outcome: OpOutcome) -> None:
        if not outcome.deltas:  # most ops change no table: no index of their sequences
            return
        by_id = {s.seq_id: s for s in seqs}
        for delta in outcome.deltas:
            if (seq := by_id.get(delta.seq_id)) is not None:
                # a new list, never changed in place: a step's input holds the table it was sent with
                seq.block_table = seq.block_table[: delta.keep] + list(delta.append)
                self.table_version += 1

    # ---- frees and starting over ---------------------------------------------------------------------

    def free_later(self, seq: Sequence) -> None:
        """A finished sequence's blocks, freed with the next call (or `flush`). A running one's computed blocks
        join the prefix cache first; steps still in flight that write them run before any step that could hit
        them."""
        if seq.status is SeqStatus.RUNNING:
            self._advance.add(seq)
        if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
            self._frees.append(FreeOp(seq.seq_id))

    def flush(self) -> None:
        """Sends the waiting frees (and catch-ups) now, and waits for the answer (a cancelled request must not
        hold blocks until the next step)."""
        self.settle()
        if self._frees or self._advance:
            ops = self._advance.take([(op, []) for op in self._frees])
            self._frees = []
            self._released += [op.seq_id for op in ops if isinstance(op, FreeOp)]
            self.stats = self.port.step(ops).stats

    @staticmethod
    def forget(seq: Sequence) -> None:
        """The sequence holds no blocks any more (freed, or the block manager started over)."""
        seq.block_table = []
        seq.num_known_to_manager = seq.num_committed = seq.num_local_slots = 0
        seq.tail_private = False

    def take_released(self) -> list[int]:
        """The sequences freed since the last step, for the executor (a layout that keeps each sequence's KV
        apart gives their memory back)."""
        released, self._released = self._released, []
        return released

    def restart(self) -> None:
        """Drops every call not sent and every answer not applied: the block manager and the executor start over
        (a lost sidecar); the caller forgets every sequence's KV."""
        self._advance.clear()
        self._frees, self._released, self._unsettled = [], [], None

    def reset(self) -> None:
        """Empties the block manager (after a failed step: the prefix cache may point at KV never written)."""
        self.stats = self.port.reset()

    def resume(self, stats: BlockStats) -> None:
        """The block manager is back, empty, with these statistics (the sidecars were re-synchronised)."""
        self.stats = stats
