"""A streaming caller that falls behind the engine gets the steps it missed as one chunk per sample (fewer,
larger messages from a loaded server), with the same tokens, logprobs and text as a caller that kept up; with
stop strings it still gets them token by token, so that nothing after a stop string is sent. A stream interval
sends the first token at once, then a chunk every that many steps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from tiny_model import VOCAB

from pagedserve.services.executor.model.registry import resolve_model
from pagedserve.services.executor.model.tokenizer import load_tokenizer
from pagedserve.services.executor.step_types import ExecutorInfo
from pagedserve.services.frontend.engine import Engine
from pagedserve.services.frontend.engine_loop import EngineLoop
from pagedserve.services.frontend.generation import Backend, Chunk, Serving, Usage
from pagedserve.services.frontend.metrics import ServingMetrics
from pagedserve.services.frontend.request import GenerationParams, StepOutput

EngineFactory = Callable[..., tuple[Engine, Any]]  # the make_engine fixture (tests/engine/conftest.py)
PROMPT = list(range(40, 57))
PARAMS = GenerationParams(max_tokens=12, temperature=1.0, seed=5, n=2, ignore_eos=True)


async def read(serving: Serving, request_id: str, stop: tuple[str, ...] = (), behind: bool = False) -> list[Chunk]:
    """The request's chunks; `behind`: after the first, nothing is read until the engine has finished it."""
    stream = serving.generate(request_id, PROMPT, PARAMS, b"", stop=stop, want_logprobs=True)
    chunks = [await anext(stream)]
    if behind:
        deadline = time.monotonic() + 60
        while serving.backend.loop.engine.request(request_id) is not None:  # still in the engine
            assert time.monotonic() < deadline, "the request never finished"
            await asyncio.sleep(0.01)
    *body, last = chunks + [item async for item in stream]
    # the usage comes last: alone, or on the last chunk when the engine's end came with it
    assert isinstance(last, Usage) or last.usage is not None
    assert all(isinstance(chunk, Chunk) and chunk.usage is None for chunk in body)
    return [*body, last] if isinstance(last, Chunk) else body


def by_sample(chunks: list[Chunk]) -> dict[int, tuple[list[int], list[float], str, str | None]]:
    """Each sample's tokens, logprobs, text and how it ended, however they were cut into chunks."""
    samples: dict[int, tuple[list[int], list[float], str, str | None]] = {}
    for chunk in chunks:
        tokens, logprobs, text, _ = samples.get(chunk.index, ([], [], "", None))
        reason = chunk.finish_reason.value if chunk.finish_reason else None
        samples[chunk.index] = ([*tokens, *chunk.token_ids], [*logprobs, *chunk.logprobs], text + chunk.text, reason)
    return samples


def serving_on(make_engine: EngineFactory, stream_interval: int = 1) -> tuple[Serving, EngineLoop, Any]:
    engine, manager = make_engine()
    loop = EngineLoop(engine, ServingMetrics(ttft_slo_ms=1e6, tpot_slo_ms=1e6), max_waiting_requests=8,
                      stream_interval=stream_interval)
    info = ExecutorInfo("tiny", "digest", "float32", "cpu", VOCAB, 256, 4, 256, 0, (), "torch")
    serving = Serving()
    serving.attach(Backend(loop, load_tokenizer(resolve_model("smollm2-135m")), info))
    return serving, loop, manager


def test_a_caller_that_falls_behind_gets_the_missed_steps_joined(make_engine: EngineFactory) -> None:
    serving, loop, manager = serving_on(make_engine)

    async def scenario() -> tuple[list[Chunk], list[Chunk], list[Chunk]]:
        kept_up = await read(serving, "kept-up")
        behind = await read(serving, "behind", behind=True)
        with_stop = await read(serving, "with-stop", stop=("never in this text",), behind=True)
        return kept_up, behind, with_stop

    loop.start()
    try:
        kept_up, behind, with_stop = asyncio.run(scenario())
    finally:
        loop.stop()
    expected = by_sample(kept_up)
    assert sorted(expected) == [0, 1] and expected[0][0] != expected[1][0]  # the two samples diverge
    for tokens, logprobs, text, reason in expected.values():
        assert len(tokens) == len(logprobs) == 12 and reason == "length"
        assert text == serving.backend.tokenizer.decode(tokens, skip_special_tokens=True)
    # seeded samples: the same tokens, logprobs and text whether read as they came or all at once at the end
    assert by_sample(behind) == expected
    # behind: the first event's two chunks (one token each), then the other eleven of each sample in one chunk
    assert [len(chunk.token_ids) for chunk in behind] == [1, 1, 11, 11]
    assert by_sample(with_stop) == expected
    assert [len(chunk.token_ids) for chunk in with_stop] == [1] * 24  # stop strings: token by token
    assert manager.stats().num_used_blocks == 0


def test_a_stream_interval_sends_the_first_token_at_once_then_a_chunk_every_n_steps(
    make_engine: EngineFactory,
) -> None:
    chunks: dict[int, list[Chunk]] = {}
    for interval in (1, 4):
        serving, loop, manager = serving_on(make_engine, interval)
        loop.start()
        try:
            chunks[interval] = asyncio.run(read(serving, f"every-{interval}"))
        finally:
            loop.stop()
        assert manager.stats().num_used_blocks == 0
    assert by_sample(chunks[4]) == by_sample(chunks[1])  # seeded: the same samples, cut differently
    # 12 tokens of each of two samples: the first step's at once, then 4 steps at a time, the last 3 at the end
    assert [(chunk.index, len(chunk.token_ids)) for chunk in chunks[4]] == [
        (0, 1), (1, 1), (0, 4), (1, 4), (0, 4), (1, 4), (0, 3), (1, 3)]


def test_outputs_held_for_the_stream_interval_reach_the_caller_before_a_failure(make_engine: EngineFactory) -> None:
    """Tokens the engine recorded are the caller's even when a failed step ends the request while they wait for
    the stream interval: they come first, then the error."""
    engine, manager = make_engine()
    loop = EngineLoop(engine, ServingMetrics(ttft_slo_ms=1e6, tpot_slo_ms=1e6), max_waiting_requests=8,
                      stream_interval=1000)

    async def scenario() -> tuple[int, int, object]:
        events = loop.submit("held", PROMPT, GenerationParams(max_tokens=200, ignore_eos=True), b"")
        first = await asyncio.wait_for(events.get(), 60)  # the first token comes at once
        assert isinstance(first, StepOutput)
        request = first.request
        deadline = time.monotonic() + 60
        while len(request.seqs[0].output_token_ids) < 6:  # a few more recorded, held for the interval
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert events.empty()

        def broken(step: object) -> None:
            raise RuntimeError("the executor broke")

        loop.engine.executor.runner.execute = broken  # type: ignore[attr-defined]
        received = sum(len(o.new_token_ids) for o in first.outputs)
        while isinstance(event := await asyncio.wait_for(events.get(), 60), StepOutput):
            received += sum(len(o.new_token_ids) for o in event.outputs)
        return received, len(request.seqs[0].output_token_ids), event

    loop.start()
    try:
        received, recorded, end = asyncio.run(scenario())
    finally:
        loop.stop()
    assert isinstance(end, RuntimeError) and received == recorded >= 6
    assert manager.stats().num_used_blocks == 0
