"""The engine end to end on a real (tiny, random-weight) model: scheduler, block-manager core, runner."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedserve.services.block_manager.contract import AdvanceOp, BlockStats, FreeOp, SpareOp
from pagedserve.services.common.errors import InvalidRequest, OutOfCapacity
from pagedserve.services.common.kv_geometry import blocks_for
from pagedserve.services.frontend.engine import Engine
from pagedserve.services.frontend.engine_loop import EngineLoop
from pagedserve.services.frontend.metrics import ServingMetrics
from pagedserve.services.frontend.request import GenerationParams, Request

EngineFactory = Callable[..., tuple[Engine, Any]]  # the make_engine fixture (tests/engine/conftest.py)

rng = random.Random(0)
PROMPTS = [[rng.randrange(2, 90) for _ in range(n)] for n in (3, 17, 9, 30, 1, 12)]


def run(engine: Engine, prompts: list[list[int]], params: GenerationParams) -> tuple[list[Request], int]:
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    peak_used = 0
    while engine.has_work:
        engine.step()
        peak_used = max(peak_used, engine.scheduler.stats.num_used_blocks)
        check_ledgers(engine, engine.scheduler.kv.port.manager)  # type: ignore[attr-defined]
    return requests, peak_used


def check_ledgers(engine: Engine, manager: Any) -> None:
    """Between engine steps: the block manager knows every running sequence's slots but the ones the scheduler
    placed itself, and those lie in blocks of the sequence's own (its tail block or its spare) that the manager
    has there. The manager's table may be one spare ahead while a deferred call's answer waits for the next plan."""
    bs = manager.block_size
    for seq in engine.scheduler.running:
        held = manager.seqs[seq.seq_id]
        assert held.num_slots == seq.num_computed - seq.num_local_slots, (seq.seq_id, held.num_slots, seq)
        table = [b.block_id for b in held.block_table]
        spare_unseen = engine.scheduler.kv.has_deferred_answer and table[:-1] == seq.block_table
        assert table == seq.block_table or spare_unseen, (seq.seq_id, table, seq.block_table)
        if seq.num_local_slots:
            assert seq.tail_private and seq.num_computed <= len(seq.block_table) * bs, seq.seq_id
            placed = held.block_table[held.num_slots // bs : blocks_for(seq.num_computed, bs)]
            assert all(block.ref_count == 1 for block in placed), seq.seq_id


def outputs(requests: list[Request]) -> list[list[list[int]]]:
    return [[s.output_token_ids for s in sorted(r.seqs, key=lambda s: s.index)] for r in requests]


def assert_no_leak(engine: Engine, manager: object) -> None:
    stats = manager.stats()  # type: ignore[attr-defined]
    assert stats.num_used_blocks == 0 and stats.num_sequences == 0
    manager.check_integrity()  # type: ignore[attr-defined]


GREEDY = GenerationParams(max_tokens=20, ignore_eos=True)


def test_greedy_batch_equals_hf_generate(make_engine: EngineFactory, tiny_llama_dir: object) -> None:
    from transformers import LlamaForCausalLM

    engine, manager = make_engine()
    requests, _ = run(engine, PROMPTS, GREEDY)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    for request in requests:
        ids = torch.tensor([request.prompt_token_ids])
        expected = hf.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0)
        assert request.seqs[0].output_token_ids == expected[0, ids.shape[1]:].tolist()
    assert_no_leak(engine, manager)


def test_decodes_into_an_own_tail_block_send_no_block_manager_op(make_engine: EngineFactory) -> None:
    """With 4-token blocks, three decodes in four go into a free slot of the sequence's own tail block: the
    scheduler places them and tells the block manager later (Advance). The tokens are those of the engine that
    sends every decode to the block manager, and the finished sequences leave it at least the same prefix cache
    (a finished sequence's last full block may be told only by the Advance before its Free)."""
    reference, reference_manager = make_engine(local_decodes=False)
    expected, _ = run(reference, PROMPTS, GREEDY)
    engine, manager = make_engine()
    got, _ = run(engine, PROMPTS, GREEDY)
    assert outputs(got) == outputs(expected)
    counts = engine.scheduler.kv.port.op_counts  # type: ignore[attr-defined]
    reference_counts = reference.scheduler.kv.port.op_counts  # type: ignore[attr-defined]
    # the reference's Advances only commit (before a Free or a prompt chunk); ours also tell the placed slots
    assert reference_counts["AdvanceOp"] < counts["AdvanceOp"]
    assert 0 < counts["DecodeOp"] <= reference_counts["DecodeOp"] // 2, (counts, reference_counts)
    assert manager.stats().num_cached_blocks >= reference_manager.stats().num_cached_blocks
    assert_no_leak(engine, manager)


def test_spare_blocks_let_most_steps_make_no_block_manager_call(make_engine: EngineFactory) -> None:
    """With 8-token blocks, a call takes a spare block for each decode within 7 slots of its table's end; the
    decodes enter their spares without an op, so far fewer steps call the block manager, and the tokens and
    the prefix cache left behind are those of the engine that takes no spares."""
    reference, reference_manager = make_engine(block_size=8, spare_lookahead=0)
    expected, _ = run(reference, PROMPTS, GREEDY)
    engine, manager = make_engine(block_size=8)
    got, _ = run(engine, PROMPTS, GREEDY)
    assert outputs(got) == outputs(expected)
    port, reference_port = engine.scheduler.kv.port, reference.scheduler.kv.port
    assert reference_port.op_counts["SpareOp"] == 0 < port.op_counts["SpareOp"]  # type: ignore[attr-defined]
    assert port.op_counts["DecodeOp"] < reference_port.op_counts["DecodeOp"]  # type: ignore[attr-defined]
    assert port.num_calls < reference_port.num_calls, (port.num_calls, reference_port.num_calls)  # type: ignore[attr-defined]
    assert manager.stats().num_cached_blocks >= reference_manager.stats().num_cached_blocks
    assert_no_leak(engine, manager)


def test_spares_are_taken_before_a_decode_needs_a_block_and_their_answers_are_not_waited_for(
        make_engine: EngineFactory, overlap: bool) -> None:
    """A decode about to take its table's last free slot forces the call that takes its spare, so a decoding
    sequence needs a Decode only where its prefill left it no free slot (at most once). A call of only an
    Advance, Spares and Frees shapes no row of its step: the step goes to the executor before the call's answer is
    read, which the next plan applies. The tokens are those of the engine without spares."""
    params = GenerationParams(max_tokens=40, ignore_eos=True)
    reference, _ = make_engine(block_size=8, spare_lookahead=0)
    expected, _ = run(reference, PROMPTS, params)
    engine, manager = make_engine(block_size=8)
    port, submit = engine.scheduler.kv.port, engine.executor.submit
    events: list[tuple[str, int]] = []  # ("send" | "answer" | "submit", call index or step id)
    spare_calls: list[int] = []  # the calls of only an Advance, Spares and Frees, Spares among them
    send = port.send

    def recording_send(ops: Any) -> Any:
        index = len([e for e in events if e[0] == "send"])
        events.append(("send", index))
        kinds = {type(op) for op in ops}
        if SpareOp in kinds and kinds <= {AdvanceOp, SpareOp, FreeOp}:
            spare_calls.append(index)
        pending = send(ops)

        class Recorded:
            def result(self) -> Any:
                events.append(("answer", index))
                return pending.result()

        return Recorded()

    def recording_submit(step: Any) -> Any:
        events.append(("submit", step.step_id))
        return submit(step)

    port.send = recording_send  # type: ignore[method-assign]
    engine.executor.submit = recording_submit  # type: ignore[method-assign]
    got, _ = run(engine, PROMPTS, params)
    assert outputs(got) == outputs(expected)
    assert port.op_counts["SpareOp"] > len(PROMPTS)  # type: ignore[attr-defined]  # spares all along
    assert port.op_counts["DecodeOp"] <= len(PROMPTS), port.op_counts  # type: ignore[attr-defined]
    assert len(spare_calls) >= 4
    for index in spare_calls:  # a step was sent between the call and the reading of its answer
        sent, answered = events.index(("send", index)), events.index(("answer", index))
        assert any(kind == "submit" for kind, _ in events[sent:answered]), (index, events[sent:answered + 1])
    assert_no_leak(engine, manager)


def test_steady_decode_steps_go_as_the_same_batch_and_keep_every_token(make_engine: EngineFactory,
                                                                       overlap: bool) -> None:
    """With overlapped steps, a step of decodes that are all the last step's sequences again (each decoding the
    token it sampled there, no block-manager op) names no sequence (`same_batch`): the executor's port fills in
    its held batch. Greedy and seeded samples (n = 2, a fork) are those of the engine that names every sequence;
    in lock step the inputs are known tokens, so no step goes that way."""
    params = [GREEDY, GenerationParams(max_tokens=20, temperature=0.8, seed=3, n=2, ignore_eos=True)]
    reference, _ = make_engine(block_size=8, repeat_batches=False)
    expected = [run(reference, PROMPTS, p)[0] for p in params]
    engine, manager = make_engine(block_size=8)
    submit, runner_execute = engine.executor.submit, engine.executor.runner.execute  # type: ignore[attr-defined]
    flagged: list[int] = []  # the sequences each unnamed step ran
    ran: dict[int, list[tuple[int, int, int]]] = {}  # step id -> (sequence, position, tokens) the runner got

    def recording_submit(step: Any) -> Any:
        running = submit(step)
        if step.same_batch and not step.sequences:
            flagged.append(step.step_id)
        return running

    def recording_execute(step: Any) -> Any:
        ran[step.step_id] = [(s.seq_id, s.start_position, len(s.token_ids)) for s in step.sequences]
        return runner_execute(step)

    engine.executor.submit = recording_submit  # type: ignore[method-assign]
    engine.executor.runner.execute = recording_execute  # type: ignore[attr-defined]
    got = [run(engine, PROMPTS, p)[0] for p in params]
    assert [outputs(g) for g in got] == [outputs(e) for e in expected]
    if not overlap:
        assert flagged == []
    else:
        assert len(flagged) > len(ran) // 2, (len(flagged), len(ran))  # most steps of this run
        for step_id in flagged:  # the last step's sequences again, each a token at its next position
            assert [(seq_id, p, 1) for seq_id, p, _ in ran[step_id]] == [
                (seq_id, p + n, 1) for seq_id, p, n in ran[step_id - 1]]
    assert_no_leak(engine, manager)


def test_a_quiet_plan_is_the_full_plan_without_the_pass(make_engine: EngineFactory) -> None:
    """A plan in a quiet stretch (every running sequence decoding into its own blocks, nothing to send) skips the
    pass over the running sequences: each one is checked against the full plan made right after it, which must
    find the same decodes, no op and no call, and the same number of quiet steps left. Greedy and seeded
    samples (a fork, n = 2) and requests that end at different lengths."""
    engine, manager = make_engine(block_size=8)
    scheduler = engine.scheduler
    quiet_plan = scheduler._plan_quiet
    checked = 0

    def checked_quiet_plan() -> Any:
        nonlocal checked
        planned = quiet_plan()
        if planned is not None:
            left = scheduler.fast.quiet_steps
            full = scheduler._plan_full()  # no side effect when the quiet plan is right: no op, no catch-up
            assert full is not None and full.routes == [] and not scheduler.kv.has_ops_due
            assert len(full.local) == len(planned.local) and all(map(lambda a, b: a is b, full.local, planned.local))
            assert scheduler.fast.quiet_steps == left
            checked += 1
        return planned

    scheduler._plan_quiet = checked_quiet_plan  # type: ignore[method-assign]
    params = [GenerationParams(max_tokens=30, ignore_eos=True),
              GenerationParams(max_tokens=21, temperature=0.8, seed=3, n=2, ignore_eos=True)]
    reference, _ = make_engine(block_size=8, local_decodes=False)  # every decode a block-manager op: never quiet
    expected = [run(reference, PROMPTS, p)[0] for p in params]
    got = [run(engine, PROMPTS, p)[0] for p in params]
    assert [outputs(g) for g in got] == [outputs(e) for e in expected]
    assert checked > 20, checked
    assert_no_leak(engine, manager)


# A bf16 cache only where its blocks are moved, not recomputed: a swap copies their bits, while a recompute (or a
# prefix hit's last chunk) computes them again in a batch of another shape, whose last fp32 bits may round a key
# to the other bf16 neighbour, and this random model's top two logprobs come within 0.002 of each other.
@pytest.mark.parametrize(("mode", "kv_dtype"), [("recompute", torch.float32), ("swap", torch.float32),
                                                ("swap", torch.bfloat16)], ids=["recompute", "swap", "swap_bf16_kv"])
def test_preemption_under_a_tiny_budget_keeps_greedy_output(make_engine: EngineFactory, mode: str,
                                                            kv_dtype: torch.dtype) -> None:
    reference, _ = run(make_engine(kv_dtype=kv_dtype)[0], PROMPTS, GREEDY)
    engine, manager = make_engine(num_blocks=24, cpu_blocks=64, preemption_mode=mode, kv_dtype=kv_dtype)
    runner = engine.executor.runner  # type: ignore[attr-defined]
    assert runner.kv_caches[0][0].dtype == runner.cpu_caches[0][0].dtype == kv_dtype
    requests, _ = run(engine, PROMPTS, GREEDY)
    assert outputs(requests) == outputs(reference)
    assert engine.scheduler.num_preemptions[mode] > 0
    assert_no_leak(engine, manager)


def test_chunked_prefill_keeps_output(make_engine: EngineFactory) -> None:
    reference, _ = run(make_engine()[0], PROMPTS, GREEDY)
    engine, manager = make_engine(max_num_batched_tokens=5)  # every prompt but the shortest is chunked
    requests, _ = run(engine, PROMPTS, GREEDY)
    assert outputs(requests) == outputs(reference)
    assert_no_leak(engine, manager)


def test_a_one_token_request_leaves_its_prompt_in_the_prefix_cache(make_engine: EngineFactory) -> None:
    engine, manager = make_engine()
    one = GenerationParams(max_tokens=1, ignore_eos=True)
    (cold,), _ = run(engine, [PROMPTS[3]], one)
    (warm,), _ = run(engine, [PROMPTS[3]], one)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 28
    assert warm.seqs[0].output_token_ids == cold.seqs[0].output_token_ids
    assert_no_leak(engine, manager)


def test_prefix_hit_output_equals_cold_output(make_engine: EngineFactory) -> None:
    engine, manager = make_engine()
    (cold,), _ = run(engine, [PROMPTS[3]], GREEDY)
    (warm,), _ = run(engine, [PROMPTS[3]], GREEDY)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 28  # 7 full blocks of 4, last token left
    assert warm.seqs[0].output_token_ids == cold.seqs[0].output_token_ids
    assert_no_leak(engine, manager)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32_kv", "bf16_kv"])
def test_parallel_samples_share_the_prompt_and_match_independent_seeded_requests(make_engine: EngineFactory,
                                                                                 kv_dtype: torch.dtype) -> None:
    params = GenerationParams(max_tokens=12, temperature=1.0, seed=1234, n=4, ignore_eos=True)
    engine, manager = make_engine(kv_dtype=kv_dtype)
    (request,), peak_shared = run(engine, [PROMPTS[3]], params)
    samples = outputs([request])[0]
    assert len({tuple(s) for s in samples}) > 1  # the samples diverge
    assert manager.stats().num_cow_copies >= 3  # the shared partial tail was copied on write
    assert engine.scheduler.fork_parents == []  # forked: no longer looked for each step
    for index, sample in enumerate(samples):  # sample i draws with seed + i, exactly like a lone request
        lone_engine, _ = make_engine(kv_dtype=kv_dtype)
        single = GenerationParams(max_tokens=12, temperature=1.0, seed=1234 + index, ignore_eos=True)
        (lone,), peak_lone = run(lone_engine, [PROMPTS[3]], single)
        assert lone.seqs[0].output_token_ids == sample
    assert peak_shared < 4 * peak_lone
    assert_no_leak(engine, manager)


def test_a_running_sequence_s_prompt_is_a_prefix_hit_for_a_later_request(make_engine: EngineFactory) -> None:
    """A prompt's full blocks join the prefix cache at the first decode after its prefill, though the decodes
    after it go into its own tail block without the block manager."""
    engine, manager = make_engine()
    first = engine.add_request("first", PROMPTS[3], GREEDY)
    for _ in range(2):  # its prefill, then its first decode (into its own tail block)
        engine.step()
    second = engine.add_request("second", PROMPTS[3], GREEDY)
    while engine.has_work:
        engine.step()
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 28  # 7 full blocks of 4
    assert outputs([first]) == outputs([second])
    assert_no_leak(engine, manager)


def test_a_fork_after_a_prompt_chunk_the_scheduler_placed_itself(make_engine: EngineFactory) -> None:
    """A 7-token prompt, 5 tokens a step: the first sample's second chunk is one token into its own tail block,
    placed without the block manager; the fork right after must tell it first (Advance), or the children's
    copy of the shared tail lacks that slot (NaN in a fresh cache) and their tokens differ from lone requests."""
    prompt = PROMPTS[3][:7]
    params = GenerationParams(max_tokens=6, temperature=1.0, seed=99, n=3, ignore_eos=True)
    engine, manager = make_engine(max_num_batched_tokens=5)
    (request,), _ = run(engine, [prompt], params)
    assert engine.scheduler.kv.port.op_counts["AdvanceOp"] > 0  # type: ignore[attr-defined]
    for index, sample in enumerate(outputs([request])[0]):
        lone = GenerationParams(max_tokens=6, temperature=1.0, seed=99 + index, ignore_eos=True)
        (single,), _ = run(make_engine(max_num_batched_tokens=5)[0], [prompt], lone)
        assert single.seqs[0].output_token_ids == sample, index
    assert_no_leak(engine, manager)


def test_a_final_only_request_gets_one_output_at_its_end_and_the_same_tokens(make_engine: EngineFactory) -> None:
    """A caller that reads a request's outputs at its end (a unary call, offline) gets no StepOutput before the
    step in which the request finishes; its samples, and the count of tokens generated, are a streaming
    request's."""
    params = GenerationParams(max_tokens=9, temperature=1.0, seed=99, n=3, ignore_eos=True)
    engine, manager = make_engine()
    streamed = engine.add_request("streamed", PROMPTS[3], params)
    final = engine.add_request("final", PROMPTS[3], params, final_only=True)
    short = engine.add_request("short", PROMPTS[1], GenerationParams(max_tokens=2, ignore_eos=True), final_only=True)
    seen: dict[str, list[list[object]]] = {"streamed": [], "final": [], "short": []}
    while engine.has_work:
        for output in engine.step():
            seen[output.request.request_id].append([output.request.finished, output.outputs])
    assert [finished for finished, _ in seen["final"]] == [True] and seen["final"][0][1] == []
    assert [finished for finished, _ in seen["short"]] == [True]
    assert len(seen["streamed"]) >= 9 and seen["streamed"][-1][0]
    assert outputs([final]) == outputs([streamed]) and len({tuple(s) for s in outputs([final])[0]}) > 1
    assert [len(s) for s in outputs([short])[0]] == [2]
    assert engine.scheduler.num_generated == 2 * 3 * 9 + 2
    assert_no_leak(engine, manager)


def test_same_seed_same_tokens_and_sampling_params_are_honoured(make_engine: EngineFactory) -> None:
    params = GenerationParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=20, seed=7, ignore_eos=True)
    first, _ = run(make_engine()[0], PROMPTS[:3], params)
    second, _ = run(make_engine()[0], PROMPTS[:3], params)
    assert outputs(first) == outputs(second)
    other, _ = run(make_engine()[0], PROMPTS[:3], GenerationParams(max_tokens=10, temperature=0.8, seed=8,
                                                                  ignore_eos=True))
    assert outputs(other) != outputs(first)


def test_stop_conditions(make_engine: EngineFactory) -> None:
    engine, manager = make_engine()
    (reference,), _ = run(engine, [PROMPTS[1]], GREEDY)
    tokens = reference.seqs[0].output_token_ids
    stop = GenerationParams(max_tokens=20, stop_token_ids=(tokens[4],), ignore_eos=True)
    (stopped,), _ = run(engine, [PROMPTS[1]], stop)
    first = tokens.index(tokens[4])
    assert stopped.seqs[0].output_token_ids == tokens[: first + 1]
    assert stopped.seqs[0].finish_reason is not None and stopped.seqs[0].finish_reason.value == "stop"
    (short,), _ = run(engine, [PROMPTS[1]], GenerationParams(max_tokens=3, ignore_eos=True))
    assert short.seqs[0].output_token_ids == tokens[:3] and short.seqs[0].finish_reason.value == "length"
    assert_no_leak(engine, manager)


def test_abort_frees_blocks_at_once(make_engine: EngineFactory) -> None:
    engine, manager = make_engine()
    engine.add_request("a", PROMPTS[3], GenerationParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], GenerationParams(max_tokens=50, ignore_eos=True, n=3))
    for _ in range(4):
        engine.step()
    assert manager.stats().num_used_blocks > 0
    engine.abort("a")
    engine.abort("b")
    assert not engine.has_work
    assert_no_leak(engine, manager)


def test_requests_that_can_never_fit_are_rejected_up_front(make_engine: EngineFactory) -> None:
    engine, _ = make_engine(num_blocks=24)
    with pytest.raises(InvalidRequest, match="context"):
        engine.add_request("long", [5] * 300, GREEDY)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        engine.add_request("long2", [5] * 200, GenerationParams(max_tokens=100))
    with pytest.raises(OutOfCapacity, match="needs up to"):
        engine.add_request("big", [5] * 100, GenerationParams(max_tokens=100))
    with pytest.raises(InvalidRequest, match="n: must be"):
        engine.add_request("many", [5], GenerationParams(n=64))
    with pytest.raises(InvalidRequest, match="token id 500"):
        engine.add_request("vocab", [500], GREEDY)
    assert not engine.has_work


def test_parallel_samples_with_a_cached_prompt_equal_a_cold_run(make_engine: EngineFactory) -> None:
    """A prefix hit must not let the first sample's prefill run past the fork point."""
    params = GenerationParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    engine, manager = make_engine()
    (cold,), _ = run(engine, [PROMPTS[3]], params)
    engine.add_request("warm", PROMPTS[3], params)
    requests = [engine.scheduler.requests["warm"]]
    while engine.has_work:
        engine.step()
    assert requests[0].num_cached_tokens > 0 and outputs(requests) == outputs([cold])
    assert_no_leak(engine, manager)


def test_parallel_samples_of_a_one_token_prompt(make_engine: EngineFactory) -> None:
    params = GenerationParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    engine, manager = make_engine()
    (request,), _ = run(engine, [[7]], params)
    samples = outputs([request])[0]
    for index, sample in enumerate(samples):
        (lone,), _ = run(make_engine()[0], [[7]], GenerationParams(max_tokens=6, temperature=1.0, seed=11 + index,
                                                                  ignore_eos=True))
        assert lone.seqs[0].output_token_ids == sample
    assert_no_leak(engine, manager)


class LostAnswer:
    """A block manager that dies while it answers (stands in for the process killed mid-call, which
    tests/integration/test_faults.py does for real but cannot time to one call)."""

    def result(self) -> None:
        raise ConnectionError("the block manager is gone")


class InProcessSidecars:
    """The engine's sidecars in process, for the engine loop's recovery: a sync resets both, as `Sidecars.sync`
    does over gRPC (the executor's Reset drops the tokens it kept for the next step)."""

    def __init__(self, engine: Engine, manager: Any) -> None:
        self.runner, self.manager = engine.executor.runner, manager  # type: ignore[attr-defined]

    def sync(self) -> BlockStats:
        self.runner.last_sampled.clear()
        self.manager.reset()
        return self.manager.stats()  # type: ignore[no-any-return]

    def probe(self) -> None:
        pass

    def check_block_manager(self) -> None:
        pass


@pytest.mark.parametrize("in_answer", [False, True], ids=["between-steps", "in-answer"])
@pytest.mark.parametrize("after_steps", [1, 7, 15])
def test_starting_over_after_a_lost_sidecar_keeps_every_output(make_engine: EngineFactory, after_steps: int,
                                                               in_answer: bool) -> None:
    """What the engine loop does when a sidecar is lost, in process: the steps in flight are void, every
    sequence is recomputed from the tokens it has, both sidecars start empty; outputs (greedy and seeded
    samples, n > 1) are as without the loss, and no token is delivered twice or lost, also when the block
    manager is lost while the engine collects a step (its tokens are recorded, then the answer fails)."""
    params = [GREEDY, GenerationParams(max_tokens=20, temperature=0.8, seed=3, n=2, ignore_eos=True)]
    reference, _ = run(make_engine()[0], PROMPTS, params[0])
    sampled_reference, _ = run(make_engine()[0], PROMPTS[:2], params[1])
    engine, manager = make_engine()
    requests = [engine.add_request(f"r{i}", p, params[0]) for i, p in enumerate(PROMPTS)]
    requests += [engine.add_request(f"s{i}", p, params[1]) for i, p in enumerate(PROMPTS[:2])]
    delivered: dict[int, list[int]] = {}
    for _ in range(after_steps):
        for output in engine.step():
            for o in output.outputs:
                delivered.setdefault(o.seq_id, []).extend(o.new_token_ids)
    if in_answer:
        send = engine.scheduler.kv.port.send
        engine.scheduler.kv.port.send = lambda ops: (send(ops), LostAnswer())[1]  # type: ignore[method-assign]
        with pytest.raises(ConnectionError):
            for _ in range(20):  # up to the next step that calls the block manager (with spares, not every step)
                for output in engine.step():
                    for o in output.outputs:
                        delivered.setdefault(o.seq_id, []).extend(o.new_token_ids)
        engine.scheduler.kv.port.send = send  # type: ignore[method-assign]
        for output in engine.take_undelivered():
            for o in output.outputs:
                delivered.setdefault(o.seq_id, []).extend(o.new_token_ids)
    loop = EngineLoop(engine, ServingMetrics(ttft_slo_ms=1000.0, tpot_slo_ms=100.0), max_waiting_requests=64,
                      sidecars=InProcessSidecars(engine, manager))
    loop.lose_sidecar(ConnectionError("the block manager is gone"))  # the lost steps' tokens are never seen
    loop.resync()
    assert loop.down_since is None and loop.num_recoveries == 1
    while engine.has_work:
        for output in engine.step():
            for o in output.outputs:
                delivered.setdefault(o.seq_id, []).extend(o.new_token_ids)
    assert outputs(requests[:len(PROMPTS)]) == outputs(reference)
    assert outputs(requests[len(PROMPTS):]) == outputs(sampled_reference)
    for request in requests:  # each token delivered once, in order
        for seq in request.seqs:
            assert delivered[seq.seq_id] == seq.output_token_ids
    assert_no_leak(engine, manager)


def test_swap_without_a_swap_pool_is_refused(make_engine: EngineFactory) -> None:
    with pytest.raises(ValueError, match="needs a CPU swap pool"):
        make_engine(preemption_mode="swap", cpu_blocks=0)
