"""The engine loop counts every request as it leaves the engine, in the serving metrics the exporter reads:
finished (stop or length), cancelled (abort) and failed with a step (error)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from pagedserve.services.frontend.engine import Engine
from pagedserve.services.frontend.engine_loop import EngineLoop, Event
from pagedserve.services.frontend.metrics import ServingMetrics
from pagedserve.services.frontend.request import GenerationParams, StepOutput

EngineFactory = Callable[..., tuple[Engine, Any]]  # the make_engine fixture (tests/engine/conftest.py)
PROMPT = list(range(3, 20))


async def drain(events: asyncio.Queue[Event]) -> tuple[int, Event]:
    """Waits for the end of a request's stream: the tokens it got, and how it ended (None, or an exception)."""
    num_tokens = 0
    while isinstance(event := await asyncio.wait_for(events.get(), 60), StepOutput):
        num_tokens += sum(len(output.new_token_ids) for output in event.outputs)
    return num_tokens, event


async def scenario(loop: EngineLoop, metrics: ServingMetrics) -> None:
    params = GenerationParams(max_tokens=4, ignore_eos=True)
    for events in [loop.submit(f"finished-{i}", PROMPT, params, b"") for i in range(2)]:
        assert await drain(events) == (4, None)

    cancelled = loop.submit("cancelled", PROMPT, GenerationParams(max_tokens=200, ignore_eos=True), b"")
    assert isinstance(await asyncio.wait_for(cancelled.get(), 60), StepOutput)  # its first token came
    loop.abort("cancelled")
    deadline = time.monotonic() + 30
    while metrics.totals().requests_ended["abort"] == 0:  # a cancelled stream gets no end: the client left
        assert time.monotonic() < deadline, "the cancelled request was never counted"
        await asyncio.sleep(0.01)

    def broken(step: object) -> None:
        raise RuntimeError("the executor broke")

    loop.engine.executor.runner.execute = broken  # type: ignore[attr-defined]
    for events in [loop.submit(f"failed-{i}", PROMPT, params, b"") for i in range(2)]:
        _, end = await drain(events)
        assert isinstance(end, RuntimeError)


def test_the_engine_loop_counts_finished_cancelled_and_failed_requests(make_engine: EngineFactory) -> None:
    engine, _ = make_engine()
    metrics = ServingMetrics(ttft_slo_ms=1e6, tpot_slo_ms=1e6)
    loop = EngineLoop(engine, metrics, max_waiting_requests=8)
    loop.start()
    try:
        asyncio.run(scenario(loop, metrics))
    finally:
        loop.stop()
    totals = metrics.totals()
    assert totals.requests_ended == {"stop": 0, "length": 2, "abort": 1, "error": 2}
    assert totals.num_requests_finished == metrics.num_requests_finished == 2
    assert totals.e2e_latency.count == 5 and totals.num_prompt_tokens == 5 * len(PROMPT)
    assert totals.time_to_first_token.count >= 3  # the finished and the cancelled ones; a failed one may have none
    assert totals.inter_token_latency.count >= 2 * 3  # 3 gaps in each finished one, maybe some in the cancelled one
    assert metrics.snapshot()["finished_rps"] * 60 == 2  # only the finished ones enter the window
