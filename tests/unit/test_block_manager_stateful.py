"""Stateful test of BlockManager against a brute-force allocator model and a simulated KV cache.

Every rule calls the manager (directly or through `apply_step`), has the model check the answer and follow
it, plays the answer's copies and slot writes on a simulated KV cache, and then checks everything: integrity,
block tables, reference counts, the free queue's LRU order, the prefix index, stats, and that every sequence
reads its own KV back through its table. A refused or invalid request must change nothing. Each step is also
replayed in executor.proto's order (swap-outs, swap-ins, copy-on-write copies, then the forward pass's writes)
and must read back the same. Steps, valid and invalid, are drawn by step_drawing.StepDrawer; the model follows
a step op by op in step_following.run_step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from allocator_model import AllocatorModel, Key
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from kv_cache_sim import KVCacheSim
from step_drawing import UNKNOWN_SEQ, VOCAB, StepDrawer
from step_following import run_step

from pagedserve.services.block_manager.contract import AdmitOp, CommitOp, InvalidStep, Op, OpOutcome, SwapOutOp
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.block_manager.prefix_hash import block_hash, cache_namespace
from pagedserve.services.block_manager.step import apply_step
from pagedserve.services.common.kv_events import BlocksRemoved, BlocksStored

MONOTONIC = ("prefix_cache_queries", "prefix_cache_hits", "num_cow_copies", "num_swapped_out_blocks",
             "num_swapped_in_blocks", "num_evictions")


def namespaces(block_size: int) -> tuple[bytes, bytes]:
    """Two tenants of one model: same text, different cache namespaces."""
    a, b = (cache_namespace(model="m", tokenizer="t", chat_template="c", adapter="", kv_dtype="fp16",
                            block_size=block_size, tenant_salt=salt) for salt in (b"tenant-a", b"tenant-b"))
    return a, b


def checked_rule(**strategies: Any) -> Callable[[Callable[..., None]], Any]:
    """A rule after which the whole state is checked; `verified` tells teardown the state is sound."""

    def decorate(function: Callable[..., None]) -> Any:
        @functools.wraps(function)
        def run(self: BlockManagerMachine, **kwargs: Any) -> None:
            self.verified = False
            function(self, **kwargs)
            self.check()

        return rule(**strategies)(run)

    return decorate


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.verified = False

    @initialize(num_blocks=st.integers(6, 24), block_size=st.integers(2, 4), num_cpu_blocks=st.integers(0, 12),
                watermark=st.sampled_from([0.0, 0.1, 0.25]))
    def setup(self, num_blocks: int, block_size: int, num_cpu_blocks: int, watermark: float) -> None:
        self.manager = BlockManager(num_blocks, block_size, num_cpu_blocks, watermark)
        self.events = self.manager.record_kv_events()
        self.published: set[bytes] = set()  # the prefix index as a subscriber rebuilds it from the events
        self.model = AllocatorModel(num_blocks, block_size, num_cpu_blocks, watermark)
        self.kv = KVCacheSim(num_blocks, num_cpu_blocks, block_size)
        self.namespaces = namespaces(block_size)
        self.drawer = StepDrawer(self.model, self.namespaces)
        self.chained_keys: dict[Key, bytes] = {}
        self.last_stats = self.manager.stats()
        self.check()

    # ---- direct calls ----------------------------------------------------------------------------------

    @checked_rule(data=st.data())
    def create(self, data: st.DataObject) -> None:
        self.do_create(data)

    @checked_rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        """What the scheduler does with a new prompt: create, reserve the uncached rest (admission), commit."""
        seq_id = self.do_create(data)
        seq = self.model.seqs[seq_id]
        if self.do_reserve(seq_id, len(seq.token_ids) - seq.num_slots, [], admission=True):
            self.manager.commit(seq_id, seq.num_slots)
            self.model.commit(seq_id, seq.num_slots)

    @precondition(lambda self: self.model.resident_ids())
    @checked_rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """The decode fast path: per sequence, commit everything reserved, then reserve the sampled token."""
        seq_ids = self.drawer.subset(data, self.model.resident_ids(), "seqs")
        token_ids = data.draw(st.lists(VOCAB, min_size=len(seq_ids), max_size=len(seq_ids)), label="tokens")
        d = self.manager.decode(seq_ids, token_ids)
        self.kv.apply(self.model.decode(seq_ids, token_ids, set(), d.slot_mapping, d.copies, d.deltas,
                                        d.refused_seq_ids))
        event(f"decode: {len(d.refused_seq_ids)} refused")

    @precondition(lambda self: any(map(self.model.local_room, self.model.resident_ids())))
    @checked_rule(data=st.data())
    def local_decodes(self, data: st.DataObject) -> None:
        """Decodes the frontend placed itself in a sequence's own tail block, told by one advance."""
        seq_id = data.draw(st.sampled_from([i for i in self.model.resident_ids() if self.model.local_room(i)]))
        seq = self.model.seqs[seq_id]
        num_slots = data.draw(st.integers(0, self.model.local_room(seq_id)), label="num_slots")
        untold = max(0, seq.num_slots + num_slots - len(seq.token_ids))
        append = data.draw(st.lists(VOCAB, min_size=untold, max_size=untold + 1), label="append")
        self.manager.advance(seq_id, num_slots, append)
        self.kv.apply(self.model.advance(seq_id, num_slots, append))
        event(f"local_decodes: {num_slots} slots")

    @precondition(lambda self: self.spare_candidates())
    @checked_rule(data=st.data())
    def spare(self, data: st.DataObject) -> None:
        """Spares for some sequences, as the frontend asks for them: taken in order while blocks above the
        watermark last; a refused sequence is unchanged. Their next slots enter them (local_decodes, decode,
        reserve) and a swap-out gives them back."""
        seq_ids = self.drawer.subset(data, self.spare_candidates(), "seqs")
        self.do_spare(seq_ids)

    @precondition(lambda self: self.spare_candidates())
    @checked_rule(data=st.data())
    def spare_at_the_limit(self, data: st.DataObject) -> None:
        """Spares when the free blocks above the watermark are exactly as many as the sequences asking, or one
        fewer: a filler sequence takes the others first, so the last one asking is refused, or none is."""
        seq_ids = self.drawer.subset(data, self.spare_candidates(), "seqs")
        target = len(seq_ids) - data.draw(st.integers(0, 1), label="blocks short")
        take = self.model.budget(admission=True) - target
        if take > 0:
            filler, tokens = self.drawer.fresh_id(), [10**6 + self.drawer.next_seq_id] * (take * self.model.block_size)
            created = self.manager.create(filler, tokens, self.namespaces[0])
            self.model.create(filler, tokens, self.namespaces[0], created.num_cached_tokens, [created.delta])
            assert self.do_reserve(filler, len(tokens), [], admission=False)
        room = max(0, self.model.budget(admission=True))
        spares = self.do_spare(seq_ids)
        granted = [d is not None for d in spares]
        assert granted == [i < room for i in range(len(seq_ids))], f"spares {spares}, {room} blocks above the watermark"
        event(f"spare_at_the_limit: {'exactly' if room == target else 'missed'}, {granted.count(False)} refused")

    def spare_candidates(self) -> list[int]:
        return [i for i in self.model.resident_ids() if self.model.can_have_spare(i)]

    def do_spare(self, seq_ids: list[int]) -> list[Any]:
        before = self.snapshot()
        spares = self.manager.spare(seq_ids)
        assert len(spares) == len(seq_ids)
        self.kv.apply(self.model.spare(seq_ids, [d for d in spares if d is not None],
                                       [i for i, d in zip(seq_ids, spares, strict=True) if d is None]))
        if all(d is None for d in spares):
            assert self.snapshot() == before, "a refused spare changed the manager"
        event(f"spare: {sum(d is None for d in spares)} of {len(spares)} refused")
        return spares

    @checked_rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        tokens = self.drawer.prompt(data)
        namespace = data.draw(st.sampled_from(self.namespaces), label="namespace")
        max_tokens = data.draw(st.integers(1, len(tokens) + 1), label="max_tokens")
        seq_id = self.drawer.fresh_id()
        before = self.snapshot()
        a = self.manager.admit(seq_id, tokens, namespace, max_tokens)
        deltas = [a.delta] if a.delta is not None else []
        self.kv.apply(self.model.admit(seq_id, tokens, namespace, max_tokens, a.granted, a.num_cached_tokens,
                                       a.num_tokens, a.slot_mapping, deltas))
        if not a.granted:
            assert self.snapshot() == before, "a refused admit changed the manager"
        elif data.draw(st.booleans(), label="commit"):
            self.manager.commit(seq_id, a.num_cached_tokens + a.num_tokens)
            self.model.commit(seq_id, a.num_cached_tokens + a.num_tokens)
        event(f"admit: {'granted' if a.granted else 'refused'}")

    def fork_parents(self) -> list[int]:
        return [i for i in self.model.resident_ids() if not self.model.has_spare(i)]

    @precondition(lambda self: self.fork_parents())
    @checked_rule(data=st.data())
    def parallel_sample(self, data: st.DataObject) -> None:
        """Parallel sampling: fork a sequence, then decode parent and children (copy-on-write of the tail)."""
        parent_id = data.draw(st.sampled_from(self.fork_parents()), label="parent")
        seq_ids = [parent_id]
        for _ in range(data.draw(st.integers(1, 2), label="num_children")):
            seq_ids.append(self.drawer.fresh_id())
            self.model.fork(parent_id, seq_ids[-1], [self.manager.fork(parent_id, seq_ids[-1])])
        token_ids = data.draw(st.lists(VOCAB, min_size=len(seq_ids), max_size=len(seq_ids)), label="tokens")
        d = self.manager.decode(seq_ids, token_ids)
        self.kv.apply(self.model.decode(seq_ids, token_ids, set(), d.slot_mapping, d.copies, d.deltas,
                                        d.refused_seq_ids))
        event(f"parallel_sample: {len(d.copies)} copies")

    @checked_rule(data=st.data())
    def pressure(self, data: st.DataObject) -> None:
        self.do_pressure(data)

    @precondition(lambda self: self.model.resident_ids())
    @checked_rule(data=st.data())
    def preempt_and_resume(self, data: st.DataObject) -> None:
        """Preemption by swapping: victims go to the CPU, another sequence runs (evicting cached prefixes),
        finishes, and the victims come back (reusing what is still cached, copying the rest)."""
        victims = self.drawer.subset(data, self.model.resident_ids(), "victims")
        if self.do_swap(victims, out=True):
            seq_id = self.do_pressure(data)
            self.manager.free(seq_id)
            self.model.free(seq_id)
            self.do_swap(victims, out=False)

    @precondition(lambda self: self.model.swapped_ids())
    @checked_rule(data=st.data())
    def swap_in_at_the_limit(self, data: st.DataObject) -> None:
        seq_ids = self.drawer.subset(data, self.model.swapped_ids(), "seqs")
        self.do_swap_in_at_the_limit(seq_ids, data.draw(st.integers(0, 1), label="blocks short"))

    @checked_rule(data=st.data())
    def twins(self, data: st.DataObject) -> None:
        """One prompt admitted twice in one step (computed twice: one copy joins the prefix cache, the other
        stays private), committed, preempted together, and resumed together at the limit."""
        tokens, namespace = self.drawer.prompt(data), data.draw(st.sampled_from(self.namespaces), label="namespace")
        twins = [self.drawer.fresh_id(), self.drawer.fresh_id()]
        if all(o.granted for o in self.do_step([AdmitOp(i, tokens, namespace, len(tokens)) for i in twins])):
            self.do_step([CommitOp(i, len(tokens)) for i in twins])
            if self.do_step([SwapOutOp(twins)])[0].granted:
                self.do_swap_in_at_the_limit(twins, data.draw(st.integers(0, 1), label="blocks short"))

    def do_swap_in_at_the_limit(self, seq_ids: list[int], short: int) -> None:
        """A swap-in when the free blocks above the watermark are exactly what it needs, or one fewer: a filler
        sequence (that hits no cached block) takes the others first."""

        def room() -> int:  # free blocks above the watermark less what the swap-in needs
            filled, reuse, revived = self.model.swap_in_plan(seq_ids)
            return self.model.budget(admission=True) - (len(filled) - len(reuse) + len(revived))

        spare = min(room() + short, len(self.model.free_order))
        if spare > 0:
            filler, tokens = self.drawer.fresh_id(), [10**6 + self.drawer.next_seq_id] * (spare * self.model.block_size)
            created = self.manager.create(filler, tokens, self.namespaces[0])
            self.model.create(filler, tokens, self.namespaces[0], created.num_cached_tokens, [created.delta])
            assert self.do_reserve(filler, len(tokens), [], admission=False)
        at_the_limit = room() == -short
        granted = self.do_swap(seq_ids, out=False)  # the model checks the answer
        event(f"swap_in_at_the_limit: {'exactly' if at_the_limit else 'missed'}, {'granted' if granted else 'refused'}")

    def do_pressure(self, data: st.DataObject) -> int:
        """Memory pressure: a new sequence takes up to every free block, evicting cached prefixes."""
        bs, num_free = self.model.block_size, len(self.model.free_order)
        num_tokens = bs * data.draw(st.integers(1, max(1, num_free)), label="num_blocks")
        tokens = data.draw(st.lists(VOCAB, min_size=num_tokens, max_size=num_tokens), label="tokens")
        seq_id = self.drawer.fresh_id()
        namespace = data.draw(st.sampled_from(self.namespaces), label="namespace")
        created = self.manager.create(seq_id, tokens, namespace)
        self.model.create(seq_id, tokens, namespace, created.num_cached_tokens, [created.delta])
        self.do_reserve(seq_id, num_tokens - created.num_cached_tokens, [], admission=False)
        return seq_id

    def do_create(self, data: st.DataObject) -> int:
        tokens = self.drawer.prompt(data)
        namespace = data.draw(st.sampled_from(self.namespaces), label="namespace")
        seq_id = self.drawer.fresh_id()
        created = self.manager.create(seq_id, tokens, namespace)
        self.model.create(seq_id, tokens, namespace, created.num_cached_tokens, [created.delta])
        event("create: prefix hit" if created.num_cached_tokens else "create: no hit")
        return seq_id

    def do_reserve(self, seq_id: int, num_tokens: int, append: list[int], admission: bool) -> bool:
        before = self.snapshot()
        r = self.manager.reserve(seq_id, num_tokens, append, admission)
        deltas = [r.delta] if r.delta is not None else []
        effects = self.model.reserve(seq_id, num_tokens, append, admission, r.granted, r.slot_mapping, r.copies,
                                     deltas)
        if not r.granted:
            assert self.snapshot() == before, "a refused reservation changed the manager"
        event(f"reserve: {'granted' if r.granted else 'refused'}{' with copy-on-write' if r.copies else ''}")
        self.kv.apply(effects)
        return r.granted

    @precondition(lambda self: self.fork_parents())
    @checked_rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = data.draw(st.sampled_from(self.fork_parents()), label="parent")
        child_id = self.drawer.fresh_id()
        self.model.fork(parent_id, child_id, [self.manager.fork(parent_id, child_id)])

    @precondition(lambda self: self.model.resident_ids())
    @checked_rule(data=st.data())
    def reserve(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.model.resident_ids()), label="seq")
        seq = self.model.seqs[seq_id]
        append = data.draw(st.lists(VOCAB, max_size=2), label="append")
        num_tokens = data.draw(st.integers(0, len(seq.token_ids) + len(append) - seq.num_slots), label="num_tokens")
        self.do_reserve(seq_id, num_tokens, append, data.draw(st.booleans(), label="admission"))

    @precondition(lambda self: self.model.resident_ids())
    @checked_rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self.model.resident_ids()), label="seq")
        seq = self.model.seqs[seq_id]
        num_computed = data.draw(st.integers(seq.num_computed, seq.num_slots), label="num_computed")
        self.manager.commit(seq_id, num_computed)
        self.model.commit(seq_id, num_computed)

    @precondition(lambda self: self.model.seqs)
    @checked_rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.model.seqs)), label="seq")
        self.manager.free(seq_id)
        self.model.free(seq_id)

    @precondition(lambda self: self.model.resident_ids())
    @checked_rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        self.do_swap(self.drawer.subset(data, self.model.resident_ids(), "seqs"), out=True)

    @precondition(lambda self: self.model.swapped_ids())
    @checked_rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        self.do_swap(self.drawer.subset(data, self.model.swapped_ids(), "seqs"), out=False)

    def do_swap(self, seq_ids: list[int], out: bool) -> bool:
        before = self.snapshot()
        result = self.manager.swap_out(seq_ids) if out else self.manager.swap_in(seq_ids)
        follow = self.model.swap_out if out else self.model.swap_in
        self.kv.apply(follow(seq_ids, result.granted, result.copies, result.deltas))
        if not result.granted:
            assert self.snapshot() == before, "a refused swap changed the manager"
        event(f"swap_{'out' if out else 'in'}: {'granted' if result.granted else 'refused'}")
        return result.granted

    @checked_rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """Direct misuse raises ValueError and changes nothing."""
        resident, swapped = self.model.resident_ids(), self.model.swapped_ids()
        calls: list[tuple[str, Callable[[], object]]] = [
            ("reserve unknown", lambda: self.manager.reserve(UNKNOWN_SEQ, 0)),
            ("create empty", lambda: self.manager.create(self.drawer.fresh_id(), [], self.namespaces[0])),
            ("swap_out duplicates", lambda: self.manager.swap_out(resident[:1] * 2)),
            ("admit no tokens", lambda: self.manager.admit(self.drawer.fresh_id(), [1], self.namespaces[0], 0)),
            ("decode unknown", lambda: self.manager.decode([UNKNOWN_SEQ], [1])),
            ("advance unknown", lambda: self.manager.advance(UNKNOWN_SEQ, 0)),
            ("spare unknown", lambda: self.manager.spare([*self.spare_candidates()[:1], UNKNOWN_SEQ])),
        ]
        candidates = self.spare_candidates()
        if candidates:  # a valid sequence first: the bad one after it must still leave it unchanged
            calls.append(("spare duplicates", lambda: self.manager.spare([candidates[0], candidates[0]])))
        holders = [i for i in resident if self.model.has_spare(i)]
        if holders:
            calls += [
                ("spare twice", lambda: self.manager.spare([*candidates[:1], holders[0]])),
                ("fork a spare's holder", lambda: self.manager.fork(holders[0], self.drawer.fresh_id())),
            ]
        if resident:
            r_id = resident[0]
            r_seq = self.model.seqs[r_id]
            calls += [
                ("reserve too many", lambda: self.manager.reserve(r_id, len(r_seq.token_ids) - r_seq.num_slots + 1)),
                ("commit past slots", lambda: self.manager.commit(r_id, r_seq.num_slots + 1)),
                ("fork into existing", lambda: self.manager.fork(r_id, r_id)),
                ("create existing", lambda: self.manager.create(r_id, [1], self.namespaces[0])),
                ("admit existing", lambda: self.manager.admit(r_id, [1], self.namespaces[0], 1)),
                ("decode mismatched", lambda: self.manager.decode([r_id], [1, 2])),
                ("decode duplicates", lambda: self.manager.decode([r_id, r_id], [1, 1])),
                ("decode one unknown", lambda: self.manager.decode([r_id, UNKNOWN_SEQ], [1, 1])),
                ("swap_in resident", lambda: self.manager.swap_in([r_id])),
                ("advance past the tail block", lambda: self.manager.advance(
                    r_id, len(r_seq.table) * self.model.block_size - r_seq.num_slots + 1, [1] * 99)),
                ("advance leaving three slots untold", lambda: self.manager.advance(
                    r_id, len(r_seq.table) * self.model.block_size - r_seq.num_slots,
                    [1] * max(0, len(r_seq.table) * self.model.block_size - len(r_seq.token_ids) - 3))),
            ]
            shared = [i for i in resident if self.model.seqs[i].num_slots % self.model.block_size
                      and self.model.ref_count(self.model.seqs[i].table[-1]) > 1]
            if shared:
                calls.append(("advance into a shared tail", lambda: self.manager.advance(shared[0], 1, [1, 1])))
                calls.append(("spare behind a shared tail", lambda: self.manager.spare([*candidates[:1], shared[0]])))
        if swapped:
            s_id = swapped[0]
            calls += [
                ("reserve swapped", lambda: self.manager.reserve(s_id, 0)),
                ("fork swapped", lambda: self.manager.fork(s_id, self.drawer.fresh_id())),
                ("commit swapped", lambda: self.manager.commit(s_id, 0)),
                ("swap_out swapped", lambda: self.manager.swap_out([s_id])),
                ("decode swapped", lambda: self.manager.decode([*resident[:1], s_id], [1] * (1 + len(resident[:1])))),
                ("advance swapped", lambda: self.manager.advance(s_id, 0)),
                ("spare swapped", lambda: self.manager.spare([*self.spare_candidates()[:1], s_id])),
            ]
        name, call = data.draw(st.sampled_from(calls), label="misuse")
        event(f"misuse: {name}")
        if name == "swap_out duplicates" and not resident:
            return
        if name == "advance leaving three slots untold" and (
                not self.model.local_room(resident[0])
                or len(r_seq.table) * self.model.block_size - len(r_seq.token_ids) < 3):
            return  # its own tail block has no room for three slots past its known tokens
        before = self.snapshot()
        try:
            call()
        except ValueError:
            pass
        else:
            raise AssertionError(f"{name}: no ValueError")
        assert self.snapshot() == before, f"{name}: raised but changed the manager"

    # ---- apply_step ------------------------------------------------------------------------------------

    @checked_rule(data=st.data())
    def step_as_scheduled(self, data: st.DataObject) -> None:
        self.do_step(self.drawer.scheduler_batch(data, self.drawer.shadows()), "the scheduler's order")

    @checked_rule(data=st.data())
    def step_in_any_order(self, data: st.DataObject) -> None:
        self.do_step(self.drawer.ops(data, self.drawer.shadows(), 6, "num_ops"), "any order")

    @precondition(lambda self: self.model.swapped_ids())
    @checked_rule(data=st.data())
    def step_around_a_swap_in(self, data: st.DataObject) -> None:
        """Any valid order around a swap-in: later ops may decode the sequence (skipped if the swap-in was
        refused), swap others out while the cpu blocks it freed are held back, or take blocks freed before it."""
        shadows = self.drawer.shadows()
        ops = [*self.drawer.ops(data, shadows, 2, "before"), self.drawer.op(data, shadows, ("swap_in",)),
               *self.drawer.ops(data, shadows, 3, "after")]
        self.do_step([op for op in ops if op is not None], "any order around a swap-in")

    def do_step(self, ops: list[Op], shape: str = "") -> list[OpOutcome]:
        """A valid step: the model follows it, and the executor's order reads back the same as op order."""
        outcomes, wrong_as_executor = run_step(self.manager, self.model, self.kv, ops)
        assert not wrong_as_executor, f"{ops} reads back otherwise in the executor's order:\n" + "\n".join(
            wrong_as_executor[:10])
        if shape:
            event(f"step in {shape}: {len(ops) // 3 * 3}+ ops, {sum(not o.granted for o in outcomes)} refused")
        return outcomes

    @checked_rule(data=st.data())
    def invalid_step(self, data: st.DataObject) -> None:
        """A batch with one malformed op, or one naming a sequence sealed earlier in the batch, raises
        InvalidStep naming that op and applies nothing, not even the valid ops (an Advance among them: then a
        Spare of a sequence it names and a later op names too is one of the malformed)."""
        shadows = self.drawer.shadows()
        advance = self.drawer.advance_op(data, shadows) if data.draw(st.booleans(), label="advance first") else None
        ops: list[Op] = [advance] if advance is not None else []
        ops += self.drawer.ops(data, shadows, 3, "before")
        bad, why = self.drawer.invalid_op(data, shadows)
        index, ops = len(ops), [*ops, bad, *self.drawer.ops(data, shadows, 2, "after")]
        before = self.snapshot()
        try:
            apply_step(self.manager, ops)
        except InvalidStep as error:
            message = str(error)
        else:
            raise AssertionError(f"InvalidStep not raised for {ops}")
        assert message.startswith(f"ops[{index}].") and why in message, f"{ops}: {message}"
        assert self.snapshot() == before, "an invalid step changed the manager"

    # ---- checks ----------------------------------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        m = self.manager
        seqs = tuple(
            (i, tuple(s.token_ids), s.num_slots, s.num_computed, m.block_table(i), s.cpu_table, tuple(s.block_hashes))
            for i, s in sorted(m.seqs.items())
        )
        return (m.stats(), seqs, [b.block_id for b in m.pool.free_queue], sorted(m.pool.cached),
                m.cpu_pool.free_ids(), list(m.cpu_pool.ref_counts))

    def chained_key(self, key: Key) -> bytes:
        """The manager's key for a model identity: H(parent key, block tokens), the namespace at the root."""
        if key not in self.chained_keys:
            namespace, tokens = key
            bs = self.model.block_size
            parent = namespace if len(tokens) == bs else self.chained_key((namespace, tokens[:-bs]))
            self.chained_keys[key] = block_hash(parent, tokens[-bs:])
        return self.chained_keys[key]

    def check(self) -> None:
        m, model = self.manager, self.model
        m.check_integrity()
        model.check()
        assert sorted(m.seqs) == sorted(model.seqs)
        for seq_id, seq in model.seqs.items():
            state = m.get(seq_id)
            assert (state.token_ids, state.num_slots, state.num_computed) == (
                seq.token_ids, seq.num_slots, seq.num_computed), f"seq {seq_id}"
            assert m.block_table(seq_id) == seq.table, f"seq {seq_id}: table {m.block_table(seq_id)} != {seq.table}"
            assert state.cpu_table == seq.cpu_table, f"seq {seq_id}: cpu table {state.cpu_table} != {seq.cpu_table}"
            assert state.block_hashes == [self.chained_key(k) for k in seq.keys], f"seq {seq_id}: block keys"
        assert [b.ref_count for b in m.pool.blocks] == [model.ref_count(b) for b in range(model.num_blocks)]
        assert m.cpu_pool.ref_counts == [model.cpu_ref_count(c) for c in range(model.num_cpu_blocks)]
        assert [b.block_id for b in m.pool.free_queue] == model.free_order, "free queue is not in LRU order"
        assert {b.block_id: b.block_hash for b in m.pool.blocks if b.block_hash is not None} == {
            b: self.chained_key(k) for b, k in model.block_key.items()}, "prefix index differs from the model's"
        stats = m.stats()
        assert {k: getattr(stats, k) for k in model.expected_stats()} == model.expected_stats()
        assert stats.num_free_blocks + stats.num_used_blocks == stats.num_total_blocks
        for name in MONOTONIC:
            assert getattr(stats, name) >= getattr(self.last_stats, name), f"{name} went down"
        self.last_stats = stats
        self.check_kv_events()
        wrong = self.kv.mismatches(model)
        assert not wrong, "KV read back through the block tables is wrong:\n" + "\n".join(wrong[:10])
        self.verified = True

    def check_kv_events(self) -> None:
        """Whatever path changed the index (admission, commit, decode, swap-in, eviction), its events say so:
        replayed, they give the index's keys; a batch with events is numbered one past the last."""
        before = self.events.sequence
        batch = self.events.take_batch()
        assert batch.sequence == before + (1 if batch.events else 0) and batch.epoch == self.manager.instance_id
        for change in batch.events:
            if isinstance(change, BlocksStored):
                assert not self.published & set(change.block_hashes), "stored a key the index already held"
                self.published |= set(change.block_hashes)
            elif isinstance(change, BlocksRemoved):
                assert set(change.block_hashes) <= self.published, "removed a key the index did not hold"
                self.published -= set(change.block_hashes)
            else:
                self.published.clear()
        assert self.published == set(self.manager.pool.cached), "the KV events differ from the prefix index"
        snapshot = self.manager.kv_snapshot()
        assert (snapshot.sequence, snapshot.block_hashes) == (batch.sequence, self.published)

    def teardown(self) -> None:
        if not self.verified:  # a rule failed: leave its error alone
            return
        for seq_id in sorted(self.model.seqs):
            self.manager.free(seq_id)
            self.model.free(seq_id)
        self.check()
        stats = self.manager.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
        assert stats.num_sequences == 0 and not self.manager.seqs
        assert stats.num_free_cpu_blocks == stats.num_cpu_blocks, "cpu blocks leaked"


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerStateful = BlockManagerMachine.TestCase

