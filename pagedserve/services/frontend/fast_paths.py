"""The scheduler's two fast paths for the steady decode stretch, where most steps of a busy server are.

- **Quiet plans.** A full plan that finds every running sequence decoding into a free slot of its own blocks,
  and nothing to send to the block manager, also knows for how many more steps that holds (`start_quiet`):
  while each sequence has a free slot past the ones planned and its tokens stay short of its length limit. Until
  then, and while nothing else changes (the same running sequences; the scheduler checks that nothing waits,
  nothing is swapped, no free, catch-up or fork is due), a plan skips the pass over the running sequences
  (`quiet_plan`): the full plan would find the same decodes and no op.
- **Repeated batches.** A step whose decodes are the last step's sequences again, in the same order, each
  decoding the token it sampled there and sampling the next, with no table changed since the last rows were
  built, is sent with no rows (`same_batch`): the executor's port fills them in from the batch it holds, one
  position on, each slot by the slot rule over the table it holds (`repeat` does the rows' bookkeeping only).
"""

from __future__ import annotations

import operator

from .request import SeqStatus, Sequence


class FastPaths:
    def __init__(self, block_size: int, max_model_len: int, spare_lookahead: int, repeat_batches: bool) -> None:
        """`spare_lookahead`: the KV client's (0: no spares); `repeat_batches`: whether the executor's port holds
        the last batch, so that a step may name none."""
        self.block_size, self.max_model_len = block_size, max_model_len
        self.spare_lookahead, self.repeat_batches = spare_lookahead, repeat_batches
        self.quiet_steps = 0  # plans to come that need no pass over the running sequences
        self._quiet_running: list[Sequence] = []  # the running sequences they are about
        self._last_batch: list[Sequence] = []  # the last step's sequences if every one sampled, else empty
        self._rows_table_version = -1  # the KV client's table version the last step's rows carried

    def reset(self) -> None:
        """Forgets the last batch and any quiet stretch (the sidecars start over)."""
        self._last_batch, self.quiet_steps = [], 0

    # ---- quiet plans ---------------------------------------------------------------------------------

    def quiet_plan(self, running: list[Sequence]) -> list[Sequence] | None:
        """The decodes of a plan in a quiet stretch (every running sequence, each into its own blocks), or None
        when no stretch holds for `running`. The caller has checked that nothing else is to be planned."""
        quiet = self._quiet_running
        if not self.quiet_steps or len(running) != len(quiet) or not all(map(operator.is_, running, quiet)):
            return None
        self.quiet_steps -= 1
        return list(running)

    def start_quiet(self, local: list[Sequence], running: list[Sequence]) -> None:
        """After a full plan that sent nothing: a quiet stretch starts when `local`, its decodes placed here, is
        every running sequence."""
        if local and len(local) == len(running):
            self.quiet_steps, self._quiet_running = self._quiet_steps_after(local), list(running)

    def stop_quiet(self) -> None:
        """A full plan runs: the stretch, if any, is over."""
        self.quiet_steps = 0

    def _quiet_steps_after(self, local: list[Sequence]) -> int:
        """How many plans after this one find `local` decoding into its own blocks with nothing to send: while
        each has a free slot past the ones planned (a step takes one), and its known tokens (each step adds one,
        sampled or pending) stay short of its length limit (the scheduler's target length). With spares, the
        stretch ends one slot earlier: the plan after it finds the tightest sequence at its last free slot, which
        forces the call that takes its spare (else it would need a Decode a step later)."""
        block_size, max_model_len = self.block_size, self.max_model_len
        margin = 2 if self.spare_lookahead else 1
        room = min(len(s.block_table) * block_size - s.num_computed for s in local) - margin
        to_limit = min(min(s.request.max_len, max_model_len) - len(s.token_ids) - s.num_pending for s in local) - 1
        return max(0, min(room, to_limit))

    # ---- repeated batches ----------------------------------------------------------------------------

    def repeats(self, local: list[Sequence], table_version: int) -> bool:
        """Whether a step of only `local` decodes (no block-manager op) is the last step's batch again: the same
        sequences in the same order, every one of which sampled there, each decoding the token it sampled
        (LAST_SAMPLED) and sampling the next, and no table changed since (`SentInputs.repeats`' condition,
        known without rows)."""
        last = self._last_batch
        if not self.repeat_batches or table_version != self._rows_table_version or not local \
                or len(local) != len(last) or not all(map(operator.is_, local, last)):
            return False
        finished = SeqStatus.FINISHED
        for seq in local:
            start, num_known = seq.num_computed, len(seq.token_ids)
            if seq.status is finished or start < num_known or start + 1 != num_known + seq.num_pending:
                return False
        return True

    @staticmethod
    def repeat(local: list[Sequence]) -> None:
        """`step_rows.add_decodes`' bookkeeping for a batch that `repeats`, without its rows."""
        for seq in local:
            seq.num_computed += 1
            seq.num_local_slots += 1
            seq.num_pending += 1

    def rows_sent(self, sampled: list[Sequence], num_rows: int, table_version: int) -> None:
        """A step was built with rows (carrying every table as of `table_version`); `sampled` is its sequences
        that sample: the next step may repeat it only if every row sampled."""
        self._rows_table_version = table_version
        self._last_batch = sampled if len(sampled) == num_rows else []
