"""Stateful test of BlockManager against a brute-force allocator model and a simulated KV cache.

Every rule calls the manager (directly or through `apply_step`), has the model check the answer and follow
it, plays the answer's copies and slot writes on a simulated KV cache, and then checks everything: integrity,
block tables, reference counts, the free queue's LRU order, the prefix index, stats, and that every sequence
reads its own KV back through its table. A refused or invalid request must change nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from allocator_model import NO_EFFECTS, AllocatorModel, Effects, KVCacheSim
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.block_manager.prefix_hash import cache_namespace
from pagedserve.services.block_manager.step import (
    CommitOp,
    CreateOp,
    ForkOp,
    FreeOp,
    InvalidStep,
    Op,
    OpOutcome,
    ReserveOp,
    SwapInOp,
    SwapOutOp,
    apply_step,
)

VOCAB = st.integers(0, 3)  # tiny: prompts repeat, so prefixes hit the cache
UNKNOWN_SEQ = 10**9
MONOTONIC = ("prefix_cache_queries", "prefix_cache_hits", "num_cow_copies", "num_swapped_out_blocks",
             "num_swapped_in_blocks", "num_evictions")


def namespaces(block_size: int) -> tuple[bytes, bytes]:
    return tuple(  # type: ignore[return-value]
        cache_namespace(model="m", tokenizer="t", chat_template="c", adapter="", kv_dtype="fp16",
                        block_size=block_size, tenant_salt=salt)
        for salt in (b"tenant-a", b"tenant-b")
    )


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


class Shadow:
    """A sequence as a batch being drawn sees it (every earlier op of the batch assumed granted)."""

    def __init__(self, swapped: bool, num_known: int, num_slots: int, num_computed: int) -> None:
        self.swapped, self.num_known, self.num_slots, self.num_computed = swapped, num_known, num_slots, num_computed


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.verified = False
        self.next_seq_id = 0
        self.prompts: list[list[int]] = []

    @initialize(num_blocks=st.integers(6, 24), block_size=st.integers(2, 4), num_cpu_blocks=st.integers(0, 12),
                watermark=st.sampled_from([0.0, 0.1, 0.25]))
    def setup(self, num_blocks: int, block_size: int, num_cpu_blocks: int, watermark: float) -> None:
        self.manager = BlockManager(num_blocks, block_size, num_cpu_blocks, watermark)
        self.model = AllocatorModel(num_blocks, block_size, num_cpu_blocks, watermark)
        self.kv = KVCacheSim(num_blocks, num_cpu_blocks, block_size)
        self.namespaces = namespaces(block_size)
        self.last_stats = self.manager.stats()
        self.check()

    # ---- drawing ---------------------------------------------------------------------------------------

    def fresh_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        bs = self.model.block_size
        if self.prompts and data.draw(st.integers(0, 3), label="reuse a prompt") > 0:
            base = data.draw(st.sampled_from(self.prompts), label="base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            tokens = base[:cut] + data.draw(st.lists(VOCAB, max_size=bs), label="tail")
        else:
            tokens = data.draw(st.lists(VOCAB, min_size=1, max_size=3 * bs + 1), label="prompt")
        tokens = tokens or [0]
        self.prompts = [*self.prompts[-15:], tokens]
        return tokens

    def draw_subset(self, data: st.DataObject, ids: list[int], label: str) -> list[int]:
        return data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True), label=label)

    def shadows(self) -> dict[int, Shadow]:
        return {i: Shadow(s.cpu_table is not None, len(s.token_ids), s.num_slots, s.num_computed)
                for i, s in self.model.seqs.items()}

    def draw_op(self, data: st.DataObject, shadows: dict[int, Shadow]) -> Op:
        """One valid op given the shadows, which it updates as if granted."""
        resident = sorted(i for i, s in shadows.items() if not s.swapped)
        swapped = sorted(i for i, s in shadows.items() if s.swapped)
        kinds = ["create"] + (["fork", "reserve", "reserve", "commit", "swap_out"] if resident else [])
        kinds += ["free"] if shadows else []
        kinds += ["swap_in"] if swapped else []
        kind = data.draw(st.sampled_from(kinds), label="op")
        if kind == "create":
            tokens = self.draw_prompt(data)
            seq_id = self.fresh_id()
            shadows[seq_id] = Shadow(False, len(tokens), 0, 0)  # any cached prefix only adds slots later
            return CreateOp(seq_id, tokens, data.draw(st.sampled_from(self.namespaces), label="namespace"))
        if kind == "free":
            seq_id = data.draw(st.sampled_from(sorted(shadows)), label="seq")
            del shadows[seq_id]
            return FreeOp(seq_id)
        if kind == "swap_in":
            seq_ids = self.draw_subset(data, swapped, "seqs")
            for seq_id in seq_ids:
                shadows[seq_id].swapped = False
            return SwapInOp(seq_ids)
        if kind == "swap_out":
            seq_ids = self.draw_subset(data, resident, "seqs")
            for seq_id in seq_ids:
                shadows[seq_id].swapped = True
            return SwapOutOp(seq_ids)
        seq_id = data.draw(st.sampled_from(resident), label="seq")
        shadow = shadows[seq_id]
        if kind == "fork":
            child_id = self.fresh_id()
            shadows[child_id] = Shadow(False, shadow.num_known, shadow.num_slots, shadow.num_computed)
            return ForkOp(seq_id, child_id)
        if kind == "commit":
            num_computed = data.draw(st.integers(shadow.num_computed, shadow.num_slots), label="num_computed")
            shadow.num_computed = num_computed
            return CommitOp(seq_id, num_computed)
        append = data.draw(st.lists(VOCAB, max_size=2), label="append")
        shadow.num_known += len(append)
        num_tokens = data.draw(st.integers(0, shadow.num_known - shadow.num_slots), label="num_tokens")
        shadow.num_slots += num_tokens
        return ReserveOp(seq_id, num_tokens, append, data.draw(st.booleans(), label="admission"))

    def draw_invalid_op(self, data: st.DataObject, shadows: dict[int, Shadow]) -> Op:
        """An op the step validator must reject, given the shadows at its place in the batch."""
        resident = sorted(i for i, s in shadows.items() if not s.swapped)
        swapped = sorted(i for i, s in shadows.items() if s.swapped)
        ns = self.namespaces[0]
        choices: list[Op] = [
            CreateOp(self.fresh_id(), [], ns), CreateOp(self.fresh_id(), [1, -1], ns),
            CreateOp(self.fresh_id(), [2**31], ns), CreateOp(self.fresh_id(), [1], b"short"),
            CreateOp(self.fresh_id(), [1], b"x" * 65), ForkOp(UNKNOWN_SEQ, self.fresh_id()),
            ReserveOp(UNKNOWN_SEQ, 0), CommitOp(UNKNOWN_SEQ, 0), FreeOp(UNKNOWN_SEQ), SwapOutOp([]),
            SwapInOp([UNKNOWN_SEQ]),
        ]
        if shadows:
            existing = data.draw(st.sampled_from(sorted(shadows)), label="existing")
            choices += [CreateOp(existing, [1], ns), ForkOp(resident[0], existing) if resident else FreeOp(-1)]
        for seq_id in resident[:2]:
            s = shadows[seq_id]
            choices += [
                ReserveOp(seq_id, s.num_known - s.num_slots + 1), ReserveOp(seq_id, -1),
                ReserveOp(seq_id, 0, [5, -3]), CommitOp(seq_id, s.num_slots + 1), SwapOutOp([seq_id, seq_id]),
                SwapInOp([seq_id]),
            ]
            if s.num_computed > 0:
                choices.append(CommitOp(seq_id, s.num_computed - 1))
        for seq_id in swapped[:2]:
            choices += [ReserveOp(seq_id, 0), CommitOp(seq_id, 0), ForkOp(seq_id, self.fresh_id()),
                        SwapOutOp([seq_id]), SwapInOp([seq_id, seq_id])]
        return data.draw(st.sampled_from(choices), label="invalid op")

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
        """One decode step: append the sampled token, reserve its slot, commit everything reserved."""
        seq_id = data.draw(st.sampled_from(self.model.resident_ids()), label="seq")
        seq = self.model.seqs[seq_id]
        num_tokens = len(seq.token_ids) + 1 - seq.num_slots
        if self.do_reserve(seq_id, num_tokens, [data.draw(VOCAB, label="token")], admission=False):
            self.manager.commit(seq_id, seq.num_slots)
            self.model.commit(seq_id, seq.num_slots)

    def do_create(self, data: st.DataObject) -> int:
        tokens = self.draw_prompt(data)
        namespace = data.draw(st.sampled_from(self.namespaces), label="namespace")
        seq_id = self.fresh_id()
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

    @precondition(lambda self: self.model.resident_ids())
    @checked_rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = data.draw(st.sampled_from(self.model.resident_ids()), label="parent")
        child_id = self.fresh_id()
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
        seq_ids = self.draw_subset(data, self.model.resident_ids(), "seqs")
        before = self.snapshot()
        result = self.manager.swap_out(seq_ids)
        self.kv.apply(self.model.swap_out(seq_ids, result.granted, result.copies, result.deltas))
        if not result.granted:
            assert self.snapshot() == before, "a refused swap-out changed the manager"
        event(f"swap_out: {'granted' if result.granted else 'refused'}")

    @precondition(lambda self: self.model.swapped_ids())
    @checked_rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq_ids = self.draw_subset(data, self.model.swapped_ids(), "seqs")
        before = self.snapshot()
        result = self.manager.swap_in(seq_ids)
        self.kv.apply(self.model.swap_in(seq_ids, result.granted, result.copies, result.deltas))
        if not result.granted:
            assert self.snapshot() == before, "a refused swap-in changed the manager"
        event(f"swap_in: {'granted' if result.granted else 'refused'}")

    @checked_rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        """Direct misuse raises ValueError and changes nothing."""
        resident, swapped = self.model.resident_ids(), self.model.swapped_ids()
        calls: list[tuple[str, Callable[[], object]]] = [
            ("reserve unknown", lambda: self.manager.reserve(UNKNOWN_SEQ, 0)),
            ("create empty", lambda: self.manager.create(self.fresh_id(), [], self.namespaces[0])),
            ("swap_out duplicates", lambda: self.manager.swap_out(resident[:1] * 2)),
        ]
        if resident:
            r_id = resident[0]
            r_seq = self.model.seqs[r_id]
            calls += [
                ("reserve too many", lambda: self.manager.reserve(r_id, len(r_seq.token_ids) - r_seq.num_slots + 1)),
                ("commit past slots", lambda: self.manager.commit(r_id, r_seq.num_slots + 1)),
                ("fork into existing", lambda: self.manager.fork(r_id, r_id)),
                ("create existing", lambda: self.manager.create(r_id, [1], self.namespaces[0])),
                ("swap_in resident", lambda: self.manager.swap_in([r_id])),
            ]
        if swapped:
            s_id = swapped[0]
            calls += [
                ("reserve swapped", lambda: self.manager.reserve(s_id, 0)),
                ("fork swapped", lambda: self.manager.fork(s_id, self.fresh_id())),
                ("commit swapped", lambda: self.manager.commit(s_id, 0)),
                ("swap_out swapped", lambda: self.manager.swap_out([s_id])),
            ]
        name, call = data.draw(st.sampled_from(calls), label="misuse")
        if name == "swap_out duplicates" and not resident:
            return
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
    def step(self, data: st.DataObject) -> None:
        shadows = self.shadows()
        ops = [self.draw_op(data, shadows) for _ in range(data.draw(st.integers(1, 4), label="num_ops"))]
        kv_before = self.kv.clone()
        outcomes = apply_step(self.manager, ops)
        assert len(outcomes) == len(ops)
        refused: set[int] = set()
        step_effects = []
        for op, outcome in zip(ops, outcomes, strict=True):
            effects = self.follow(op, outcome, refused)
            self.kv.apply(effects)  # op by op: the bookkeeping itself must be exact
            step_effects.append(effects)
        event(f"step: {sum(not o.granted for o in outcomes)} refused")
        as_executor = kv_before
        as_executor.apply_step_as_executor(step_effects)
        if as_executor.mismatches(self.model):  # see test_step_*_hazard: copies run before the step's writes
            event("step: executor order differs (intra-step hazard)")

    def follow(self, op: Op, outcome: OpOutcome, refused: set[int]) -> Effects:
        """Checks one op's outcome against the model (with the step's refusal cascade) and follows it."""
        if not outcome.granted:
            assert not (outcome.deltas or outcome.slot_mapping or outcome.copies or outcome.swap_out
                        or outcome.swap_in), f"refused {op} returned work: {outcome}"
        if isinstance(op, FreeOp):
            refused.discard(op.seq_id)
            assert outcome.granted
            if op.seq_id in self.model.seqs:
                self.model.free(op.seq_id)
            return NO_EFFECTS
        subjects = {op.parent_seq_id, op.child_seq_id} if isinstance(op, ForkOp) else (
            set(op.seq_ids) if isinstance(op, SwapOutOp | SwapInOp) else {op.seq_id})
        if refused & subjects:
            assert not outcome.granted, f"{op} applied after an earlier op on its sequence was refused"
            refused |= subjects
            return NO_EFFECTS
        if not isinstance(op, SwapOutOp):
            assert not outcome.swap_out
        if not isinstance(op, SwapInOp):
            assert not outcome.swap_in
        effects = NO_EFFECTS
        match op:
            case CreateOp():
                assert outcome.granted
                self.model.create(op.seq_id, list(op.token_ids), op.cache_namespace, outcome.num_cached_tokens,
                                  outcome.deltas)
            case ForkOp():
                assert outcome.granted
                self.model.fork(op.parent_seq_id, op.child_seq_id, outcome.deltas)
            case ReserveOp():
                effects = self.model.reserve(op.seq_id, op.num_tokens, list(op.append_token_ids), op.admission,
                                             outcome.granted, outcome.slot_mapping, outcome.copies, outcome.deltas)
            case CommitOp():
                assert outcome.granted
                self.model.commit(op.seq_id, op.num_computed_tokens)
            case SwapOutOp():
                effects = self.model.swap_out(list(op.seq_ids), outcome.granted, outcome.swap_out, outcome.deltas)
            case SwapInOp():
                effects = self.model.swap_in(list(op.seq_ids), outcome.granted, outcome.swap_in, outcome.deltas)
        if not outcome.granted:
            refused |= subjects
        else:
            assert isinstance(op, ReserveOp) or not outcome.copies, f"{op} returned copy-on-write copies"
        return effects

    @checked_rule(data=st.data())
    def invalid_step(self, data: st.DataObject) -> None:
        """A batch with one malformed op raises InvalidStep and applies nothing, not even the valid ops."""
        shadows = self.shadows()
        ops = [self.draw_op(data, shadows) for _ in range(data.draw(st.integers(0, 2), label="ops before"))]
        ops.append(self.draw_invalid_op(data, shadows))
        ops += [self.draw_op(data, shadows) for _ in range(data.draw(st.integers(0, 2), label="ops after"))]
        before = self.snapshot()
        try:
            apply_step(self.manager, ops)
        except InvalidStep:
            pass
        else:
            raise AssertionError(f"InvalidStep not raised for {ops}")
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
        assert [b.ref_count for b in m.pool.blocks] == [model.ref_count(b) for b in range(model.num_blocks)]
        assert m.cpu_pool.ref_counts == [model.cpu_ref_count(c) for c in range(model.num_cpu_blocks)]
        assert [b.block_id for b in m.pool.free_queue] == model.free_order, "free queue is not in LRU order"
        assert {b.block_id for b in m.pool.blocks if b.block_hash is not None} == set(model.block_key)
        stats = m.stats()
        assert {k: getattr(stats, k) for k in model.expected_stats()} == model.expected_stats()
        assert stats.num_free_blocks + stats.num_used_blocks == stats.num_total_blocks
        for name in MONOTONIC:
            assert getattr(stats, name) >= getattr(self.last_stats, name), f"{name} went down"
        self.last_stats = stats
        wrong = self.kv.mismatches(model)
        assert not wrong, "KV read back through the block tables is wrong:\n" + "\n".join(wrong[:10])
        self.verified = True

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
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerStateful = BlockManagerMachine.TestCase
