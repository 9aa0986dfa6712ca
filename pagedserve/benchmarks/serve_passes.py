"""The workload passes `bench serve` runs against any client (serve.py's gRPC one, serve_openai.py's HTTP one):
the prompts cut from one passage, the main pass and the shared-prefix pass, and what each request looked like."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeVar

from .workloads import RequestSpec, sharegpt_like

T = TypeVar("T")

PASSAGE = (
    "The lighthouse keeper's log for the winter of that year survives in a county archive, and it reads less like "
    "a diary than like an inventory of weather. Each morning he noted the direction of the wind, the height of the "
    "swell, the colour of the sky at dawn and the number of ships that passed within sight of the lamp. On calm "
    "days the entries are short. On the days when the storms came in from the west they run to several pages, "
    "written in a careful hand that grows smaller as the paper runs out. He describes the sound of the sea "
    "striking the rocks below the tower as something felt in the floor before it was heard, and he records how "
    "the glass of the lantern room would shiver in its frame when the largest waves arrived. Historians who "
    "study coastal trade have used these notes to estimate how much cargo moved along the coast in a season, "
    "because he counted every sail and often named the vessels he recognised. Meteorologists have used them as "
    "well, comparing his observations of pressure and wind with the records of inland stations to reconstruct "
    "the paths of storms that no instrument at sea could measure. Wicks had to be trimmed every few hours, the "
    "brass polished, the oil carried up one hundred and twelve steps in the evening and the soot cleaned from "
    "the lens before sunrise, and in a hard winter the supply boat might not come for six weeks."
)


@dataclass
class Outcome:
    """One request as the client saw it (monotonic seconds)."""

    sent: float
    first: float = 0.0
    last: float = 0.0
    end: float = 0.0  # the stream's end (after the usage)
    num_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft_ms(self) -> float:
        return (self.first - self.sent) * 1000

    @property
    def e2e_ms(self) -> float:
        return (self.end - self.sent) * 1000

    @property
    def tpot_ms(self) -> float:
        return (self.last - self.first) * 1000 / (self.num_tokens - 1) if self.num_tokens > 1 else 0.0


class Generates(Protocol):
    """A client of the workload: Client (gRPC) or serve_openai.OpenAIClient (HTTP)."""

    def generate(self, ids: list[int], max_tokens: int, api_key: str, n: int = 1, seed: int = 0) -> Outcome: ...


def run_at(jobs: Sequence[tuple[float, Callable[[], T]]]) -> list[T]:
    """Starts each job on its own thread `delay` seconds from now (Poisson arrivals: a request does not wait for
    the one before); returns the results in job order, or raises naming the first job that failed."""
    results: dict[int, T] = {}
    errors: dict[int, BaseException] = {}

    def work(i: int, job: Callable[[], T]) -> None:
        try:
            results[i] = job()
        except BaseException as exc:  # reported below, on the caller's thread
            errors[i] = exc

    start = time.monotonic()
    threads = []
    for i, (delay, job) in enumerate(jobs):
        time.sleep(max(0.0, start + delay - time.monotonic()))
        threads.append(threading.Thread(target=work, args=(i, job), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(jobs)} requests failed; the first: {errors[min(errors)]!r}")
    return [results[i] for i in range(len(jobs))]


def progress(what: str, fields: dict[str, Any]) -> dict[str, Any]:
    print(f"bench serve: {what}: {json.dumps(fields)}", file=sys.stderr, flush=True)
    return fields


def cut(passage: list[int], offset: int, length: int) -> list[int]:
    return [passage[(offset + i) % len(passage)] for i in range(length)]


def pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main_pass(client: Generates, args: argparse.Namespace, prompts: list[list[int]],
              specs: list[RequestSpec]) -> tuple[dict[str, Any], list[Outcome]]:
    jobs = [(s.arrival_s, partial(client.generate, prompts[i], s.output_len, f"main-{i}"))
            for i, s in enumerate(specs)]
    start = time.monotonic()
    outcomes = run_at(jobs)
    duration = max(o.last for o in outcomes) - start
    tokens = sum(o.num_tokens for o in outcomes)
    ttft, tpot = [o.ttft_ms for o in outcomes], [o.tpot_ms for o in outcomes if o.num_tokens > 1]
    e2e = [o.e2e_ms for o in outcomes]
    good = sum(1 for o in outcomes if o.ttft_ms <= args.ttft_slo_ms and o.tpot_ms <= args.tpot_slo_ms)
    last_arrival = specs[-1].arrival_s
    return {
        "throughput_tok_s": round(tokens / duration, 2),
        "ttft_ms_p50": round(pct(ttft, 50), 1), "ttft_ms_p99": round(pct(ttft, 99), 1),
        "tpot_ms_p50": round(pct(tpot, 50), 1), "tpot_ms_p99": round(pct(tpot, 99), 1),
        "e2e_ms_p50": round(pct(e2e, 50), 1), "e2e_ms_p99": round(pct(e2e, 99), 1),
        "goodput_rps": round(good / duration, 4),
        "slo_attainment": round(good / len(outcomes), 3),
        "offered_rps": round(len(specs) / last_arrival, 3) if last_arrival > 0 else None,  # None: all at t=0
        "achieved_rps": round(len(specs) / duration, 3),
    }, outcomes


def shared_prefix_pass(client: Generates, args: argparse.Namespace, passage: list[int]) -> dict[str, Any]:
    """One tenant; the first half of every prompt is the same passage, the second half its own."""
    half, stride = args.prefix_prompt_len // 2, len(passage) // args.prefix_prompts
    common = cut(passage, len(passage) // 2 + 3, half)
    outcomes = [client.generate(common + cut(passage, 7 + stride * i, args.prefix_prompt_len - half),
                                args.prefix_max_tokens, "shared-prefix") for i in range(args.prefix_prompts)]
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    return {"prefill_tokens_saved_frac": round(sum(o.cached_tokens for o in outcomes) / prompt_tokens, 4),
            "shared_prefix_prompt_tokens": prompt_tokens}


def workload(args: argparse.Namespace, passage: list[int]) -> tuple[list[RequestSpec], list[list[int]]]:
    specs = sharegpt_like(args.num_requests, args.seed, max_total=2048, scale=args.scale,
                          request_rate=args.request_rate, burstiness=args.burstiness)
    # distinct starting offsets (and an API key each): no two main-pass requests share a cached block
    return specs, [cut(passage, 131 * i + args.seed, s.prompt_len) for i, s in enumerate(specs)]
