"""Stateful test of BlockManager against a brute-force allocator model and a simulated KV cache.

Every rule calls the manager (directly or through `apply_step`), has the model check the answer and follow
it, plays the answer's copies and slot writes on a simulated KV cache, and then checks everything: integrity,
block tables, reference counts, the free queue's LRU order, the prefix index, stats, and that every sequence
reads its own KV back through its table. A refused or invalid request must change nothing. Each step is also
replayed in executor.proto's order (swap-outs, swap-ins, copy-on-write copies, then the forward pass's writes)
and must read back the same. Within a step, from its first op that may copy or swap (HOLDS_BACK), freed blocks
are handed out only after the step; the model holds them back likewise.

Valid steps obey the validator's rules: once a Create, Admit, Reserve or Decode names a sequence, no later op of
the step may name it (it is sealed), and a sequence swapped in may not be swapped out in the same step. They come
in two shapes: the scheduler's (frees and swap-outs, forks, commits, reserves and decodes, swap-ins each followed
by a reserve of the sequence, admissions) and any valid order. Invalid steps break one rule at a known op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from allocator_model import NO_EFFECTS, AllocatorModel, Effects, Key, KVCacheSim
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.block_manager.prefix_hash import block_hash, cache_namespace
from pagedserve.services.block_manager.step import (
    AdmitOp,
    CommitOp,
    CreateOp,
    DecodeOp,
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
HOLDS_BACK = (ReserveOp, DecodeOp, SwapOutOp, SwapInOp)  # from the first of these, freed blocks wait for the next step
KINDS = ("create", "admit", "fork", "reserve", "reserve", "commit", "free", "swap_out", "swap_in", "decode")
SEALED_BY = {"create": "was created", "admit": "was admitted", "reserve": "reserved slots",
             "decode": "reserved slots (decode)"}
MONOTONIC = ("prefix_cache_queries", "prefix_cache_hits", "num_cow_copies", "num_swapped_out_blocks",
             "num_swapped_in_blocks", "num_evictions")


def namespaces(block_size: int) -> tuple[bytes, bytes]:
    """Two tenants of one model: same text, different cache namespaces."""
    a, b = (cache_namespace(model="m", tokenizer="t", chat_template="c", adapter="", kv_dtype="fp16",
                            block_size=block_size, tenant_salt=salt) for salt in (b"tenant-a", b"tenant-b"))
    return a, b


def sealed_message(seq_id: int, why: str) -> str:
    return f"sequence {seq_id} {why} earlier in this step; no other op may name it until the next step"


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


@dataclass
class Shadow:
    """A sequence as a batch being drawn sees it, every earlier op of the batch assumed granted."""

    swapped: bool
    num_known: int
    num_slots: int
    num_computed: int
    sealed: str = ""  # why no later op of the batch may name it: "was created", "reserved slots", ...
    swapped_in: bool = False  # in this batch: it may not be swapped out again


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
        self.chained_keys: dict[Key, bytes] = {}
        self.last_stats = self.manager.stats()
        self.check()

    # ---- drawing ---------------------------------------------------------------------------------------

    def fresh_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    def draw_prompt(self, data: st.DataObject) -> list[int]:
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

    def draw_subset(self, data: st.DataObject, ids: list[int], label: str) -> list[int]:
        return data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True), label=label)

    def shadows(self) -> dict[int, Shadow]:
        return {i: Shadow(s.cpu_table is not None, len(s.token_ids), s.num_slots, s.num_computed)
                for i, s in self.model.seqs.items()}

    def draw_op(self, data: st.DataObject, shadows: dict[int, Shadow], kinds: tuple[str, ...] = KINDS) -> Op | None:
        """One op of the given kinds that is valid after the ops drawn so far (None if there is none);
        updates the shadows as if it were granted."""
        resident = sorted(i for i, s in shadows.items() if not s.swapped and not s.sealed)
        swapped = sorted(i for i, s in shadows.items() if s.swapped)
        swap_out = [i for i in resident if not shadows[i].swapped_in]
        possible = {"fork": resident, "reserve": resident, "commit": resident, "swap_out": swap_out,
                    "decode": resident, "free": resident + swapped, "swap_in": swapped}
        kinds = tuple(k for k in kinds if possible.get(k, True))
        if not kinds:
            return None
        kind = data.draw(st.sampled_from(kinds), label="op")
        if kind in ("create", "admit"):
            tokens = self.draw_prompt(data)
            seq_id = self.fresh_id()
            namespace = data.draw(st.sampled_from(self.namespaces), label="namespace")
            shadows[seq_id] = Shadow(False, len(tokens), 0, 0, sealed=SEALED_BY[kind])
            if kind == "create":
                return CreateOp(seq_id, tokens, namespace)
            return AdmitOp(seq_id, tokens, namespace, data.draw(st.integers(1, len(tokens) + 1), label="max_tokens"))
        if kind in ("swap_in", "swap_out", "decode"):
            seq_ids = self.draw_subset(data, possible.get(kind, resident), "seqs")
            for seq_id in seq_ids:
                shadows[seq_id].swapped, shadows[seq_id].swapped_in = kind == "swap_out", kind == "swap_in"
                shadows[seq_id].sealed = SEALED_BY.get(kind, "")
            if kind == "decode":
                return DecodeOp(seq_ids, data.draw(st.lists(VOCAB, min_size=len(seq_ids), max_size=len(seq_ids))))
            return SwapInOp(seq_ids) if kind == "swap_in" else SwapOutOp(seq_ids)
        seq_id = data.draw(st.sampled_from(possible[kind]), label="seq")
        if kind == "free":
            del shadows[seq_id]
            return FreeOp(seq_id)
        if kind == "fork":
            child_id = self.fresh_id()
            shadows[child_id] = replace(shadows[seq_id])
            return ForkOp(seq_id, child_id)
        return self.draw_commit(data, shadows[seq_id], seq_id) if kind == "commit" else (
            self.draw_reserve(data, shadows[seq_id], seq_id))

    def draw_commit(self, data: st.DataObject, s: Shadow, seq_id: int) -> CommitOp:
        s.num_computed = data.draw(st.integers(s.num_computed, s.num_slots), label="num_computed")
        return CommitOp(seq_id, s.num_computed)

    def draw_reserve(self, data: st.DataObject, s: Shadow, seq_id: int) -> ReserveOp:
        append = data.draw(st.lists(VOCAB, max_size=2), label="append")
        s.num_known += len(append)
        num_tokens = data.draw(st.integers(0, s.num_known - s.num_slots), label="num_tokens")
        s.num_slots += num_tokens
        s.sealed = SEALED_BY["reserve"]
        return ReserveOp(seq_id, num_tokens, append, data.draw(st.booleans(), label="admission"))

    def draw_scheduler_batch(self, data: st.DataObject, shadows: dict[int, Shadow]) -> list[Op]:
        """A step shaped as the scheduler plans one: frees and swap-outs, forks, then per running sequence a
        reserve (after a commit) or a decode, then swap-ins each followed by a reserve of the sequence, then
        admissions."""
        ops: list[Op | None] = []
        phases = ((("free", "swap_out"), 2), (("fork",), 1), (("commit", "reserve", "reserve", "decode"), 4))
        for kinds, most in phases:
            ops += [self.draw_op(data, shadows, kinds) for _ in range(data.draw(st.integers(0, most), label="n"))]
        swap_in = self.draw_op(data, shadows, ("swap_in",)) if data.draw(st.booleans(), label="swap in") else None
        if isinstance(swap_in, SwapInOp):
            ops.append(swap_in)
            for seq_id in swap_in.seq_ids:
                if data.draw(st.booleans(), label="commit first"):
                    ops.append(self.draw_commit(data, shadows[seq_id], seq_id))
                ops.append(self.draw_reserve(data, shadows[seq_id], seq_id))
        ops += [self.draw_op(data, shadows, ("admit", "create")) for _ in range(data.draw(st.integers(0, 2)))]
        return [op for op in ops if op is not None]

    def draw_ops(self, data: st.DataObject, shadows: dict[int, Shadow], most: int, label: str) -> list[Op]:
        """Up to `most` valid ops in any order the validator accepts."""
        ops = [self.draw_op(data, shadows) for _ in range(data.draw(st.integers(0, most), label=label))]
        return [op for op in ops if op is not None]

    def draw_invalid_op(self, data: st.DataObject, shadows: dict[int, Shadow]) -> tuple[Op, str]:
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
            AdmitOp(self.fresh_id(), [1], ns, 0), AdmitOp(self.fresh_id(), [1], b"short", 1),
            AdmitOp(self.fresh_id(), [], ns, 1),
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
                DecodeOp([seq_id], [-1]),
            ]
            if s.num_computed > 0:
                choices.append(CommitOp(seq_id, s.num_computed - 1))
        for seq_id in swapped[:2]:
            choices += [ReserveOp(seq_id, 0), CommitOp(seq_id, 0), ForkOp(seq_id, self.fresh_id()),
                        SwapOutOp([seq_id]), SwapInOp([seq_id, seq_id]), DecodeOp([seq_id], [1])]
        event("invalid_step: malformed op")
        return data.draw(st.sampled_from(choices), label="invalid op"), ""

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
        seq_ids = self.draw_subset(data, self.model.resident_ids(), "seqs")
        token_ids = data.draw(st.lists(VOCAB, min_size=len(seq_ids), max_size=len(seq_ids)), label="tokens")
        d = self.manager.decode(seq_ids, token_ids)
        self.kv.apply(self.model.decode(seq_ids, token_ids, set(), d.slot_mapping, d.copies, d.deltas,
                                        d.refused_seq_ids))
        event(f"decode: {len(d.refused_seq_ids)} refused")

    @checked_rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        tokens = self.draw_prompt(data)
        namespace = data.draw(st.sampled_from(self.namespaces), label="namespace")
        max_tokens = data.draw(st.integers(1, len(tokens) + 1), label="max_tokens")
        seq_id = self.fresh_id()
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

    @precondition(lambda self: self.model.resident_ids())
    @checked_rule(data=st.data())
    def parallel_sample(self, data: st.DataObject) -> None:
        """Parallel sampling: fork a sequence, then decode parent and children (copy-on-write of the tail)."""
        parent_id = data.draw(st.sampled_from(self.model.resident_ids()), label="parent")
        seq_ids = [parent_id]
        for _ in range(data.draw(st.integers(1, 2), label="num_children")):
            seq_ids.append(self.fresh_id())
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
        victims = self.draw_subset(data, self.model.resident_ids(), "victims")
        if self.do_swap(victims, out=True):
            seq_id = self.do_pressure(data)
            self.manager.free(seq_id)
            self.model.free(seq_id)
            self.do_swap(victims, out=False)

    @precondition(lambda self: self.model.swapped_ids())
    @checked_rule(data=st.data())
    def swap_in_at_the_limit(self, data: st.DataObject) -> None:
        seq_ids = self.draw_subset(data, self.model.swapped_ids(), "seqs")
        self.do_swap_in_at_the_limit(seq_ids, data.draw(st.integers(0, 1), label="blocks short"))

    @checked_rule(data=st.data())
    def twins(self, data: st.DataObject) -> None:
        """One prompt admitted twice in one step (computed twice: one copy joins the prefix cache, the other
        stays private), committed, preempted together, and resumed together at the limit."""
        tokens, namespace = self.draw_prompt(data), data.draw(st.sampled_from(self.namespaces), label="namespace")
        twins = [self.fresh_id(), self.fresh_id()]
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
            filler, tokens = self.fresh_id(), [10**6 + self.next_seq_id] * (spare * self.model.block_size)
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
        seq_id = self.fresh_id()
        namespace = data.draw(st.sampled_from(self.namespaces), label="namespace")
        created = self.manager.create(seq_id, tokens, namespace)
        self.model.create(seq_id, tokens, namespace, created.num_cached_tokens, [created.delta])
        self.do_reserve(seq_id, num_tokens - created.num_cached_tokens, [], admission=False)
        return seq_id

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
        self.do_swap(self.draw_subset(data, self.model.resident_ids(), "seqs"), out=True)

    @precondition(lambda self: self.model.swapped_ids())
    @checked_rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        self.do_swap(self.draw_subset(data, self.model.swapped_ids(), "seqs"), out=False)

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
            ("create empty", lambda: self.manager.create(self.fresh_id(), [], self.namespaces[0])),
            ("swap_out duplicates", lambda: self.manager.swap_out(resident[:1] * 2)),
            ("admit no tokens", lambda: self.manager.admit(self.fresh_id(), [1], self.namespaces[0], 0)),
            ("decode unknown", lambda: self.manager.decode([UNKNOWN_SEQ], [1])),
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
            ]
        if swapped:
            s_id = swapped[0]
            calls += [
                ("reserve swapped", lambda: self.manager.reserve(s_id, 0)),
                ("fork swapped", lambda: self.manager.fork(s_id, self.fresh_id())),
                ("commit swapped", lambda: self.manager.commit(s_id, 0)),
                ("swap_out swapped", lambda: self.manager.swap_out([s_id])),
                ("decode swapped", lambda: self.manager.decode([*resident[:1], s_id], [1] * (1 + len(resident[:1])))),
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
    def step_as_scheduled(self, data: st.DataObject) -> None:
        self.do_step(self.draw_scheduler_batch(data, self.shadows()), "the scheduler's order")

    @checked_rule(data=st.data())
    def step_in_any_order(self, data: st.DataObject) -> None:
        self.do_step(self.draw_ops(data, self.shadows(), 6, "num_ops"), "any order")

    @precondition(lambda self: self.model.swapped_ids())
    @checked_rule(data=st.data())
    def step_around_a_swap_in(self, data: st.DataObject) -> None:
        """Any valid order around a swap-in: later ops may decode the sequence (skipped if the swap-in was
        refused), swap others out while the cpu blocks it freed are held back, or take blocks freed before it."""
        shadows = self.shadows()
        ops = [*self.draw_ops(data, shadows, 2, "before"), self.draw_op(data, shadows, ("swap_in",)),
               *self.draw_ops(data, shadows, 3, "after")]
        self.do_step([op for op in ops if op is not None], "any order around a swap-in")

    def do_step(self, ops: list[Op], shape: str = "") -> list[OpOutcome]:
        """A valid step: the model follows it, and the executor's order reads back the same as op order."""
        outcomes, wrong_as_executor = self.run_step(ops)
        assert not wrong_as_executor, f"{ops} reads back otherwise in the executor's order:\n" + "\n".join(
            wrong_as_executor[:10])
        if shape:
            event(f"step in {shape}: {len(ops) // 3 * 3}+ ops, {sum(not o.granted for o in outcomes)} refused")
        return outcomes

    def run_step(self, ops: list[Op]) -> tuple[list[OpOutcome], list[str]]:
        """Applies a valid batch and follows it op by op; returns what an executor running the step's copies
        and swaps before its writes reads back wrongly (nothing, when op order and executor order agree)."""
        kv_before = self.kv.clone()
        outcomes = apply_step(self.manager, ops)
        assert len(outcomes) == len(ops)
        refused: set[int] = set()
        step_effects = []
        for op, outcome in zip(ops, outcomes, strict=True):
            if isinstance(op, HOLDS_BACK) and self.model.held is None:
                self.model.hold_back()
            effects = self.follow(op, outcome, refused)
            self.kv.apply(effects)  # op by op: the bookkeeping itself must be exact
            step_effects.append(effects)
        self.model.end_step()
        kv_before.apply_step_as_executor(step_effects)
        return outcomes, kv_before.mismatches(self.model)

    def follow(self, op: Op, outcome: OpOutcome, refused: set[int]) -> Effects:
        """Checks one op's outcome against the model (with the step's refusal cascade) and follows it."""
        if not outcome.granted:
            assert not (outcome.deltas or outcome.slot_mapping or outcome.copies or outcome.swap_out
                        or outcome.swap_in), f"refused {op} returned work: {outcome}"
        assert isinstance(op, SwapOutOp) or not outcome.swap_out, f"{op} returned swap-out copies"
        assert isinstance(op, SwapInOp) or not outcome.swap_in, f"{op} returned swap-in copies"
        assert isinstance(op, ReserveOp | DecodeOp) or not outcome.copies, f"{op} returned copy-on-write copies"
        assert isinstance(op, DecodeOp) or not outcome.refused_seq_ids
        if isinstance(op, FreeOp):
            refused.discard(op.seq_id)
            assert outcome.granted
            if op.seq_id in self.model.seqs:
                self.model.free(op.seq_id)
            return NO_EFFECTS
        if isinstance(op, DecodeOp):  # per sequence: blocked ones count as refused, the others decode
            assert outcome.granted
            effects = self.model.decode(list(op.seq_ids), list(op.token_ids), refused & set(op.seq_ids),
                                        outcome.slot_mapping, outcome.copies, outcome.deltas,
                                        outcome.refused_seq_ids)
            refused |= set(outcome.refused_seq_ids)
            return effects
        subjects = {op.parent_seq_id, op.child_seq_id} if isinstance(op, ForkOp) else (
            set(op.seq_ids) if isinstance(op, SwapOutOp | SwapInOp) else {op.seq_id})
        if refused & subjects:
            assert not outcome.granted, f"{op} applied after an earlier op on its sequence was refused"
            refused |= subjects
            return NO_EFFECTS
        effects = NO_EFFECTS
        match op:
            case CreateOp():
                assert outcome.granted
                self.model.create(op.seq_id, list(op.token_ids), op.cache_namespace, outcome.num_cached_tokens,
                                  outcome.deltas)
            case AdmitOp():
                effects = self.model.admit(op.seq_id, list(op.token_ids), op.cache_namespace, op.max_tokens,
                                           outcome.granted, outcome.num_cached_tokens, len(outcome.slot_mapping),
                                           outcome.slot_mapping, outcome.deltas)
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
        return effects

    @checked_rule(data=st.data())
    def invalid_step(self, data: st.DataObject) -> None:
        """A batch with one malformed op, or one naming a sequence sealed earlier in the batch, raises
        InvalidStep naming that op and applies nothing, not even the valid ops."""
        shadows = self.shadows()
        ops = self.draw_ops(data, shadows, 3, "before")
        bad, why = self.draw_invalid_op(data, shadows)
        index, ops = len(ops), [*ops, bad, *self.draw_ops(data, shadows, 2, "after")]
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
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerStateful = BlockManagerMachine.TestCase

