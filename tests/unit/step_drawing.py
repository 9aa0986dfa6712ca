"""Drawing the batches of ops (steps) that the stateful test hands to apply_step.

A valid step obeys the validator's rules: once a Create, Admit, Reserve, Decode or Spare names a sequence, no
later op of the step may name it (it is sealed), a sequence swapped in may not be swapped out in the same step,
no op but an Advance may name a sequence before its Spare, and a parent holding a spare is never forked. Valid
steps come in two shapes: the scheduler's (an Advance, frees and swap-outs, forks, commits, reserves and decodes,
swap-ins each followed by a reserve of the sequence, admissions, and spares) and any valid order. An invalid step
breaks one rule at a known op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from allocator_model import AllocatorModel
from hypothesis import event
from hypothesis import strategies as st

from pagedserve.services.block_manager.contract import (
    AdmitOp,
    AdvanceOp,
    CommitOp,
    CreateOp,
    DecodeOp,
    ForkOp,
    FreeOp,
    Op,
    ReserveOp,
    SpareOp,
    SwapInOp,
    SwapOutOp,
)

VOCAB = st.integers(0, 3)  # tiny: prompts repeat, so prefixes hit the cache
UNKNOWN_SEQ = 10**9
KINDS = ("create", "admit", "fork", "reserve", "reserve", "commit", "free", "swap_out", "swap_in", "decode", "spare")
SEALED_BY = {"create": "was created", "admit": "was admitted", "reserve": "reserved slots",
             "decode": "reserved slots (decode)", "spare": "was given a spare"}
NAMED_BEFORE_SPARE = "is named earlier in this step by an op other than an Advance"


def sealed_message(seq_id: int, why: str) -> str:
    return f"sequence {seq_id} {why} earlier in this step; no other op may name it until the next step"


@dataclass
class Shadow:
    """A sequence as a batch being drawn sees it, every earlier op of the batch assumed granted."""

    swapped: bool
    num_known: int
    num_slots: int
    num_computed: int
    sealed: str = ""  # why no later op of the batch may name it: "was created", "reserved slots", ...
    swapped_in: bool = False  # in this batch: it may not be swapped out again
    named: bool = False  # by an op of this batch other than an Advance: it may not be given a spare


class StepDrawer:
    """Draws prompts, fresh sequence ids and ops for the sequences the allocator model holds."""

    def __init__(self, model: AllocatorModel, namespaces: tuple[bytes, bytes]) -> None:
        self.model = model
        self.namespaces = namespaces
        self.next_seq_id = 0
        self.prompts: list[list[int]] = []  # recent prompts: drawn again, whole or cut, to hit the prefix cache

    def fresh_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    def prompt(self, data: st.DataObject) -> list[int]:
        bs = self.model.block_size
        reuse = data.draw(st.integers(0, 4), label="reuse a prompt") if self.prompts else 0
        if reuse == 1:  # the same prompt again: computed twice if both arrive before either is committed
            tokens = data.draw(st.sampled_from(self.prompts[-3:]), label="again")
        elif reuse > 1:
            base = data.draw(st.sampled_from(self.prompts), label="base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            tokens = base[:cut] + data.draw(st.lists(VOCAB, max_size=bs), label="tail")
        else:
            tokens = data.draw(st.lists(VOCAB, min_size=1, max_size=3 * bs + 1), label="prompt")
        tokens = tokens or [0]
        self.prompts = [*self.prompts[-15:], tokens]
        return tokens

    def subset(self, data: st.DataObject, ids: list[int], label: str) -> list[int]:
        return data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True), label=label)

    def shadows(self) -> dict[int, Shadow]:
        return {i: Shadow(s.cpu_table is not None, len(s.token_ids), s.num_slots, s.num_computed)
                for i, s in self.model.seqs.items()}

    def holds_spare(self, seq_id: int, s: Shadow) -> bool:
        """Whether the sequence holds a spare at this point of the batch: one it held before it (the batch gives
        a spare only in a Spare, which seals the sequence), unless an Advance took the slots into it."""
        held, bs = self.model.seqs.get(seq_id), self.model.block_size
        return (held is not None and held.cpu_table is None and not s.swapped and not s.swapped_in
                and len(held.table) * bs - s.num_slots >= bs)

    def can_spare(self, seq_id: int, s: Shadow) -> bool:
        """A Spare may name it here: no op but an Advance named it, it holds none, its partial tail is its own."""
        held, bs = self.model.seqs.get(seq_id), self.model.block_size
        if held is None or held.cpu_table is not None or s.named or s.sealed or s.swapped:
            return False
        return not self.holds_spare(seq_id, s) and (s.num_slots % bs == 0 or self.model.ref_count(held.table[-1]) == 1)

    def op(self, data: st.DataObject, shadows: dict[int, Shadow], kinds: tuple[str, ...] = KINDS) -> Op | None:
        """One op of the given kinds that is valid after the ops drawn so far (None if there is none);
        updates the shadows as if it were granted."""
        resident = sorted(i for i, s in shadows.items() if not s.swapped and not s.sealed)
        swapped = sorted(i for i, s in shadows.items() if s.swapped)
        swap_out = [i for i in resident if not shadows[i].swapped_in]
        possible = {"fork": [i for i in resident if not self.holds_spare(i, shadows[i])], "reserve": resident,
                    "commit": resident, "swap_out": swap_out, "decode": resident, "free": resident + swapped,
                    "swap_in": swapped, "spare": [i for i in resident if self.can_spare(i, shadows[i])]}
        kinds = tuple(k for k in kinds if possible.get(k, True))
        if not kinds:
            return None
        kind = data.draw(st.sampled_from(kinds), label="op")
        if kind in ("create", "admit"):
            tokens = self.prompt(data)
            seq_id = self.fresh_id()
            namespace = data.draw(st.sampled_from(self.namespaces), label="namespace")
            shadows[seq_id] = Shadow(False, len(tokens), 0, 0, sealed=SEALED_BY[kind], named=True)
            if kind == "create":
                return CreateOp(seq_id, tokens, namespace)
            return AdmitOp(seq_id, tokens, namespace, data.draw(st.integers(1, len(tokens) + 1), label="max_tokens"))
        if kind in ("swap_in", "swap_out", "decode", "spare"):
            seq_ids = self.subset(data, possible.get(kind, resident), "seqs")
            for seq_id in seq_ids:
                shadows[seq_id].swapped, shadows[seq_id].swapped_in = kind == "swap_out", kind == "swap_in"
                shadows[seq_id].sealed, shadows[seq_id].named = SEALED_BY.get(kind, ""), True
            if kind == "decode":
                return DecodeOp(seq_ids, data.draw(st.lists(VOCAB, min_size=len(seq_ids), max_size=len(seq_ids))))
            if kind == "spare":
                event(f"step: a spare for {len(seq_ids)} sequences")
                return SpareOp(seq_ids)
            return SwapInOp(seq_ids) if kind == "swap_in" else SwapOutOp(seq_ids)
        seq_id = data.draw(st.sampled_from(possible[kind]), label="seq")
        shadows[seq_id].named = True
        if kind == "free":
            del shadows[seq_id]
            return FreeOp(seq_id)
        if kind == "fork":
            child_id = self.fresh_id()
            shadows[child_id] = replace(shadows[seq_id])
            return ForkOp(seq_id, child_id)
        return self.commit_op(data, shadows[seq_id], seq_id) if kind == "commit" else (
            self.reserve_op(data, shadows[seq_id], seq_id))

    def commit_op(self, data: st.DataObject, s: Shadow, seq_id: int) -> CommitOp:
        s.num_computed = data.draw(st.integers(s.num_computed, s.num_slots), label="num_computed")
        return CommitOp(seq_id, s.num_computed)

    def reserve_op(self, data: st.DataObject, s: Shadow, seq_id: int) -> ReserveOp:
        append = data.draw(st.lists(VOCAB, max_size=2), label="append")
        s.num_known += len(append)
        num_tokens = data.draw(st.integers(0, s.num_known - s.num_slots), label="num_tokens")
        s.num_slots += num_tokens
        s.sealed = SEALED_BY["reserve"]
        return ReserveOp(seq_id, num_tokens, append, data.draw(st.booleans(), label="admission"))

    def advance_op(self, data: st.DataObject, shadows: dict[int, Shadow]) -> AdvanceOp | None:
        """The Advance that opens a step: slots some sequences' frontend placed in their own tail blocks and
        spares (their tokens all told), for sequences no op of the batch names yet."""
        candidates = [i for i, s in shadows.items() if not s.sealed and not s.named and self.model.local_room(i)]
        if not candidates:
            return None
        seq_ids = self.subset(data, candidates, "advanced")
        num_slots, num_tokens, token_ids = [], [], []
        for seq_id in seq_ids:
            s = shadows[seq_id]
            num_slots.append(data.draw(st.integers(0, self.model.local_room(seq_id)), label="num_slots"))
            untold = max(0, s.num_slots + num_slots[-1] - s.num_known)
            told = data.draw(st.lists(VOCAB, min_size=untold, max_size=untold + 1), label="told")
            num_tokens.append(len(told))
            token_ids += told
            s.num_known += len(told)
            s.num_slots = s.num_computed = s.num_slots + num_slots[-1]
        event(f"step: an advance of {len(seq_ids)} sequences")
        return AdvanceOp(seq_ids, num_slots, num_tokens, token_ids)

    def scheduler_batch(self, data: st.DataObject, shadows: dict[int, Shadow]) -> list[Op]:
        """A step shaped as the scheduler plans one: Advances, frees and swap-outs, forks, then per running
        sequence a reserve (after a commit) or a decode, then swap-ins each followed by a reserve of the
        sequence, then admissions, then spares (for sequences no other op names, Advanced ones among them); or
        the spares right after the Advance."""
        ops: list[Op | None] = []
        if data.draw(st.booleans(), label="advance"):
            ops.append(self.advance_op(data, shadows))
        spare_at = data.draw(st.sampled_from(["last", "last", "after the advance", "none"]), label="spare at")
        if spare_at == "after the advance":
            ops.append(self.op(data, shadows, ("spare",)))
        phases = ((("free", "swap_out"), 2), (("fork",), 1), (("commit", "reserve", "reserve", "decode"), 4))
        for kinds, most in phases:
            ops += [self.op(data, shadows, kinds) for _ in range(data.draw(st.integers(0, most), label="n"))]
        swap_in = self.op(data, shadows, ("swap_in",)) if data.draw(st.booleans(), label="swap in") else None
        if isinstance(swap_in, SwapInOp):
            ops.append(swap_in)
            for seq_id in swap_in.seq_ids:
                if data.draw(st.booleans(), label="commit first"):
                    ops.append(self.commit_op(data, shadows[seq_id], seq_id))
                ops.append(self.reserve_op(data, shadows[seq_id], seq_id))
        ops += [self.op(data, shadows, ("admit", "create")) for _ in range(data.draw(st.integers(0, 2)))]
        if spare_at == "last":
            ops.append(self.op(data, shadows, ("spare",)))
        return [op for op in ops if op is not None]

    def ops(self, data: st.DataObject, shadows: dict[int, Shadow], most: int, label: str) -> list[Op]:
        """Up to `most` valid ops in any order the validator accepts."""
        ops = [self.op(data, shadows) for _ in range(data.draw(st.integers(0, most), label=label))]
        return [op for op in ops if op is not None]

    def invalid_op(self, data: st.DataObject, shadows: dict[int, Shadow]) -> tuple[Op, str]:
        """An op the step validator must reject at its place in the batch, and the reason it must give for
        one that names a sequence sealed earlier in the batch ("" for the others)."""
        resident = sorted(i for i, s in shadows.items() if not s.swapped and not s.sealed)
        swapped = sorted(i for i, s in shadows.items() if s.swapped)
        sealed = sorted(i for i, s in shadows.items() if s.sealed)
        swapped_in = [i for i in resident if shadows[i].swapped_in]
        if swapped_in and data.draw(st.booleans(), label="swap out a sequence swapped in"):
            event("invalid_step: swap-out after a swap-in")
            seq_id = swapped_in[0]
            return SwapOutOp([seq_id]), f"sequence {seq_id} was swapped in earlier in this step; it can be swapped out"
        named = sorted(i for i, s in shadows.items() if s.named)
        if named and data.draw(st.integers(0, 3), label="spare a sequence named earlier") == 0:
            seq_id = data.draw(st.sampled_from(named), label="named")  # after a decode, reserve, fork, spare, ...
            event("invalid_step: a spare of a sequence named earlier")
            return SpareOp([seq_id]), f"sequence {seq_id} {NAMED_BEFORE_SPARE}"
        bs = self.model.block_size
        holders = [i for i in resident if self.holds_spare(i, shadows[i])]  # a spare held before the batch
        shared = [i for i in resident if not shadows[i].named and i in self.model.seqs and shadows[i].num_slots % bs
                  and self.model.ref_count(self.model.seqs[i].table[-1]) > 1]
        spare_cases = [(ForkOp(i, self.fresh_id()), f"sequence {i} holds a spare block", "a fork of its holder")
                       for i in holders[:1]]
        spare_cases += [(SpareOp([i]), f"sequence {i} holds a spare already", "a second one")
                        for i in holders[:1] if not shadows[i].named]
        spare_cases += [(SpareOp([i]), f"sequence {i}'s tail block is shared", "behind a shared tail")
                        for i in shared[:1]]
        if spare_cases and data.draw(st.integers(0, 2), label="a spare's misuse") == 0:
            bad, why, what = data.draw(st.sampled_from(spare_cases), label="spare misuse")
            event(f"invalid_step: a spare, {what}")
            return bad, why
        if sealed and data.draw(st.booleans(), label="name a sealed sequence"):
            other = [i for i in resident if not shadows[i].swapped_in][:1]  # valid in a swap-out and a decode
            seq_id = data.draw(st.sampled_from(sealed), label="sealed")
            choices = [FreeOp(seq_id), ForkOp(seq_id, self.fresh_id()), SwapOutOp([*other, seq_id]),
                       SwapInOp([seq_id]), CommitOp(seq_id, shadows[seq_id].num_computed), ReserveOp(seq_id, 0),
                       ReserveOp(seq_id, 1, [1]), DecodeOp([*other, seq_id], [1] * (len(other) + 1))]
            event(f"invalid_step: naming a sequence that {shadows[seq_id].sealed}")
            why = sealed_message(seq_id, shadows[seq_id].sealed)
            return data.draw(st.sampled_from(choices), label="invalid op"), why
        ns = self.namespaces[0]
        choices = [
            CreateOp(self.fresh_id(), [], ns), CreateOp(self.fresh_id(), [1, -1], ns),
            CreateOp(self.fresh_id(), [2**31], ns), CreateOp(self.fresh_id(), [1], b"short"),
            CreateOp(self.fresh_id(), [1], b"x" * 65), ForkOp(UNKNOWN_SEQ, self.fresh_id()),
            ReserveOp(UNKNOWN_SEQ, 0), CommitOp(UNKNOWN_SEQ, 0), FreeOp(UNKNOWN_SEQ), SwapOutOp([]),
            SwapInOp([UNKNOWN_SEQ]), DecodeOp([UNKNOWN_SEQ], [1]), DecodeOp([], [1]),
            AdvanceOp([UNKNOWN_SEQ], [0], [0], []), AdvanceOp([], [], [1], [5]),
            AdmitOp(self.fresh_id(), [1], ns, 0), AdmitOp(self.fresh_id(), [1], b"short", 1),
            AdmitOp(self.fresh_id(), [], ns, 1), SpareOp([UNKNOWN_SEQ]),
        ]
        if shadows:
            existing = data.draw(st.sampled_from(sorted(shadows)), label="existing")
            choices += [CreateOp(existing, [1], ns), AdmitOp(existing, [1], ns, 1),
                        ForkOp(resident[0], existing) if resident else FreeOp(-1)]
        for seq_id in resident[:2]:
            s = shadows[seq_id]
            choices += [
                ReserveOp(seq_id, s.num_known - s.num_slots + 1), ReserveOp(seq_id, -1),
                ReserveOp(seq_id, 0, [5, -3]), CommitOp(seq_id, s.num_slots + 1), SwapOutOp([seq_id, seq_id]),
                SwapInOp([seq_id]), DecodeOp([seq_id, seq_id], [1, 1]), DecodeOp([seq_id], [1, 2]),
                DecodeOp([seq_id], [-2]), AdvanceOp([seq_id], [0], [1], [-1]),
                AdvanceOp([seq_id] * 2, [0] * 2, [0] * 2, []),
            ]
            if s.num_computed > 0:
                choices.append(CommitOp(seq_id, s.num_computed - 1))
            if not s.named:
                choices.append(SpareOp([seq_id, seq_id]))  # duplicates
            held = self.model.seqs.get(seq_id)
            if held is None or held.cpu_table is not None:  # forked or swapped in by this batch: not its first op
                choices.append(AdvanceOp([seq_id], [0], [0], []))
                continue
            room = len(held.table) * self.model.block_size - held.num_slots
            # past its tail block (or not its first op)
            choices.append(AdvanceOp([seq_id], [room + 1], [room + 3], [1] * (room + 3)))
            if held.num_slots % self.model.block_size and self.model.ref_count(held.table[-1]) > 1:
                choices.append(AdvanceOp([seq_id], [1], [2], [1, 1]))  # into a shared tail block
                choices.append(SpareOp([seq_id]))  # behind a shared tail block
        for seq_id in swapped[:2]:
            choices += [ReserveOp(seq_id, 0), CommitOp(seq_id, 0), ForkOp(seq_id, self.fresh_id()),
                        SwapOutOp([seq_id]), SwapInOp([seq_id, seq_id]), DecodeOp([seq_id], [1]),
                        AdvanceOp([seq_id], [0], [0], []), SpareOp([seq_id])]
        event("invalid_step: malformed op")
        return data.draw(st.sampled_from(choices), label="invalid op"), ""
