"""`pagedserve bench layouts`: the paged, virtual and static KV layouts on one runtime, at one KV budget.

Each layout runs the offline engine in process (the model on the executor thread) through three passes:
`trace`, a ShareGPT-shaped trace (benchmarks/workloads.py: lengths, arrivals; random prompt tokens, EOS
ignored so that outputs have the trace's lengths); `shared_prefix`, prompts that share a long prefix, all
but the first arriving once the first has its first token (paged reuses the prefix's blocks, the other
layouts compute it again); and `n4`, requests for four samples each (paged prefills the prompt once and
forks; the others prefill it four times). Per pass:

- `kv_waste_frac`: of the KV memory assigned to live sequences, summed over steps, the share holding no
  token (a block's empty tail; a static slot's unused length). A virtual block is the pages it commits, so
  its share is that of its committed pages (tests/engine/test_kv_layouts.py checks them equal each step).
- `page_faults`: the process's minor faults during the pass (getrusage: activations' fresh memory too);
  `kv_page_commits`: the KV pages the virtual layout committed (first writes), 0 for the preallocated pools.
- `kv_resident_mib_peak`: KV memory held: the pool for paged and static, committed pages for virtual;
  `kv_assigned_mib_peak`: the most of it assigned to live sequences at once (blocks in use; a shared block
  once), where sharing shows in bytes rather than as a fraction.
- `max_concurrent_seqs`, `num_preemptions`, `step_ms_p50` (one engine step), TTFT and TPOT percentiles from
  each request's arrival, `goodput_rps` (requests within both objectives per second of the pass),
  `tokens_computed` (prefill and decode tokens the model ran) and `prefix_cached_tokens`.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..services.executor.runner import kv_bytes_per_block
from ..services.executor.step_types import StepInput
from ..services.executor.virtual_kv import VirtualKV, os_page_size, transparent_hugepages
from ..services.frontend.llm import LLM
from ..services.frontend.ports import LocalExecutor, RunningStep
from ..services.frontend.request import GenerationParams, Request
from .report import emit
from .workloads import sharegpt_like

LAYOUTS = ("paged", "virtual", "static")
KEYS = ("kv_waste_frac", "page_faults", "kv_page_commits", "kv_resident_mib_peak", "kv_assigned_mib_peak",
        "max_concurrent_seqs",
        "step_ms_p50", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "goodput_rps",
        "num_preemptions", "tokens_computed", "prefix_cached_tokens")


@dataclass(frozen=True)
class Job:
    arrival_s: float
    prompt: list[int]
    params: GenerationParams
    after_first: bool = False  # arrives once the pass's first request has its first token (its prefix is cached)


class CountingExecutor:
    """The engine's executor port, counting the tokens each step computes."""

    def __init__(self, inner: LocalExecutor) -> None:
        self.inner, self.tokens = inner, 0

    def submit(self, step: StepInput) -> RunningStep:
        running = self.inner.submit(step)
        held = self.inner.held.batch
        if step.same_batch and not step.sequences and held is not None:  # the held batch again: a token each
            self.tokens += len(held[1])
        else:
            self.tokens += sum(len(s.token_ids) for s in step.sequences)
        return running


def build_passes(args: argparse.Namespace, vocab: int) -> dict[str, list[Job]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab - 1) for _ in range(n)]

    specs = sharegpt_like(args.num_requests, seed=args.seed, scale=args.scale,  # capped at max_model_len
                          max_total=round(args.max_model_len / args.scale), request_rate=args.request_rate)
    trace = [Job(s.arrival_s, tokens(s.prompt_len), GenerationParams(max_tokens=s.output_len, ignore_eos=True))
             for s in specs]
    prefix = tokens(args.prefix_len)
    shared = [Job(0.0, prefix + tokens(8), GenerationParams(max_tokens=args.prefix_max_tokens, ignore_eos=True),
                  after_first=i > 0) for i in range(args.prefix_prompts)]
    n4 = [Job(0.0, tokens(args.n4_prompt_len), GenerationParams(max_tokens=args.n4_max_tokens, temperature=1.0,
                                                               seed=i, n=4, ignore_eos=True))
          for i in range(args.n4_prompts)]
    return {"trace": trace, "shared_prefix": shared, "n4": n4}


def run_pass(llm: LLM, jobs: list[Job], args: argparse.Namespace) -> dict[str, Any]:
    engine = llm.engine
    local = engine.executor
    assert isinstance(local, LocalExecutor), "the benchmark runs the model in process"
    counter = CountingExecutor(local)
    engine.executor = counter
    scheduler = engine.scheduler
    runner = local.runner
    virtual = runner.sequence_kv if isinstance(runner.sequence_kv, VirtualKV) else None
    commits_before = virtual.num_page_commits if virtual else 0
    if virtual:
        virtual.peak_committed_bytes = virtual.committed_bytes
    preemptions_before = sum(scheduler.num_preemptions.values())
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    requests: list[Request] = []
    pending = sorted((j for j in jobs if not j.after_first), key=lambda j: j.arrival_s)
    later = [j for j in jobs if j.after_first]
    step_ms: list[float] = []
    assigned = holding = 0.0
    max_running = max_used = 0
    start = time.monotonic()
    while pending or later or engine.has_work:
        now = time.monotonic() - start
        if later and requests and requests[0].metrics.first_token is not None:
            pending = sorted([*pending, *(Job(now, j.prompt, j.params) for j in later)], key=lambda j: j.arrival_s)
            later = []
        while pending and pending[0].arrival_s <= now:
            job = pending.pop(0)
            requests.append(engine.add_request(f"bench-{len(requests)}-{id(job)}", job.prompt, job.params))
        if not engine.has_work:
            time.sleep(min(0.01, max(0.0, pending[0].arrival_s - now)))
            continue
        t0 = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        stats = scheduler.stats
        assigned += stats.num_used_blocks
        holding += stats.num_used_blocks * stats.kv_utilization
        max_running = max(max_running, len(scheduler.running))
        max_used = max(max_used, stats.num_used_blocks)
    elapsed = time.monotonic() - start
    engine.executor = local
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    ttft = [(r.metrics.first_token - r.metrics.arrival) * 1e3 for r in requests if r.metrics.first_token]
    tpot = [t for t in map(_tpot_ms, requests) if t is not None]
    good = sum(1 for r in requests if r.metrics.first_token
               and (r.metrics.first_token - r.metrics.arrival) * 1e3 <= args.ttft_slo_ms
               and (_tpot_ms(r) or 0.0) <= args.tpot_slo_ms)
    per_block = kv_bytes_per_block(runner.config, runner.block_size, runner.kv_dtype)
    # virtual: the pages it committed; paged and static: the pool, allocated (and touched) at startup
    resident = virtual.peak_committed_bytes if virtual else runner.num_blocks * per_block
    return {
        "kv_waste_frac": round(1 - holding / assigned, 4) if assigned else 0.0,
        "page_faults": faults,
        "kv_page_commits": virtual.num_page_commits - commits_before if virtual else 0,
        "kv_resident_mib_peak": round(resident / 2**20, 2),
        "kv_assigned_mib_peak": round(max_used * per_block / 2**20, 2),
        "max_concurrent_seqs": max_running,
        "step_ms_p50": round(statistics.median(step_ms), 2),
        "ttft_ms_p50": _percentile(ttft, 50),
        "ttft_ms_p99": _percentile(ttft, 99),
        "tpot_ms_p50": _percentile(tpot, 50),
        "tpot_ms_p99": _percentile(tpot, 99),
        "goodput_rps": round(good / elapsed, 3),
        "num_preemptions": sum(scheduler.num_preemptions.values()) - preemptions_before,
        "tokens_computed": counter.tokens,
        "prefix_cached_tokens": sum(r.num_cached_tokens for r in requests),
        "seconds": round(elapsed, 1),
    }


def _tpot_ms(request: Request) -> float | None:
    m = request.metrics
    num_out = max(len(s.output_token_ids) for s in request.seqs)
    if m.first_token is None or m.finished is None or num_out < 2:
        return None
    return (m.finished - m.first_token) * 1e3 / (num_out - 1)


def _percentile(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))], 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    passes: dict[str, list[Job]] | None = None
    for layout in args.layouts:
        block_size = args.virtual_block_size if layout == "virtual" else args.block_size
        with LLM(args.model, kv_layout=layout, block_size=block_size, kv_cache_mib=args.kv_cache_mib,
                 max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, executor="thread", threads=args.threads,
                 dtype="float32", device="cpu") as llm:
            info = llm.info
            if passes is None:
                passes = build_passes(args, info.vocab_size)
            result[layout] = {"block_size": info.block_size, "num_blocks": info.num_blocks}
            for name, jobs in passes.items():
                result[layout][name] = run_pass(llm, jobs, args)
    assert passes is not None
    trace = passes["trace"]
    result["setup"] = {
        "model": args.model, "kv_cache_mib": args.kv_cache_mib, "max_model_len": args.max_model_len,
        "page_size": os_page_size(), "transparent_hugepages": transparent_hugepages(),
        "trace_requests": len(trace), "trace_prompt_mean": round(statistics.mean(len(j.prompt) for j in trace), 1),
        "trace_output_mean": round(statistics.mean(j.params.max_tokens for j in trace), 1),
        "request_rate": args.request_rate, "seed": args.seed,
    }
    return result


def plot(path: Path, result: dict[str, Any], layouts: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ("kv_waste_frac", "max_concurrent_seqs", "ttft_ms_p50", "tpot_ms_p50", "goodput_rps", "tokens_computed")
    passes = ("trace", "shared_prefix", "n4")
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    width = 0.8 / len(layouts)
    for ax, key in zip(axes.flat, shown, strict=True):
        for i, layout in enumerate(layouts):
            values = [result[layout][p][key] for p in passes]
            ax.bar([x + i * width for x in range(len(passes))], values, width, label=layout)
        ax.set_xticks([x + width * (len(layouts) - 1) / 2 for x in range(len(passes))], passes)
        ax.set_title(key)
    axes.flat[0].legend()
    setup = result["setup"]
    fig.suptitle(f"KV layouts: {setup['model']}, {setup['kv_cache_mib']} MiB of KV,"
                 f" max_model_len {setup['max_model_len']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--plot", type=Path, help="write bar charts of the main keys to this PNG")
    parser.add_argument("--model", default="smollm2-135m", help="registered name, HF directory or .gguf file")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.2, help="ShareGPT lengths times this")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--max-model-len", type=int, default=512, help="the context; a static slot's length")
    parser.add_argument("--kv-cache-mib", type=int, default=96, help="the KV budget of every layout")
    parser.add_argument("--block-size", type=int, default=16, help="paged block size")
    parser.add_argument("--virtual-block-size", type=int, default=16,
                        help="tokens per virtual page (a whole number of OS pages per layer's K)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--ttft-slo-ms", type=float, default=10000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=600.0)
    parser.add_argument("--prefix-prompts", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=192)
    parser.add_argument("--prefix-max-tokens", type=int, default=8)
    parser.add_argument("--n4-prompts", type=int, default=2)
    parser.add_argument("--n4-prompt-len", type=int, default=128)
    parser.add_argument("--n4-max-tokens", type=int, default=16)


def main(args: argparse.Namespace) -> None:
    result = run(args)
    if args.plot:
        plot(args.plot, result, args.layouts)
    if not args.json:  # one table per pass, then the JSON line
        for name in ("trace", "shared_prefix", "n4"):
            print(f"{name}:\n{'':>22}" + "".join(f"{layout:>12}" for layout in args.layouts))
            for key in KEYS:
                print(f"{key:>22}" + "".join(f"{result[layout][name][key]:>12}" for layout in args.layouts))
    emit(result, args, table=False)
