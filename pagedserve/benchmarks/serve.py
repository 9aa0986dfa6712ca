"""`pagedserve bench serve`: the whole pod under a serving workload, against HF transformers `generate()`.

Starts `pagedserve serve` as a child process on a free loopback port (or targets `--address`), then:
1. Main pass: a ShareGPT-shaped trace (lengths scaled down for a CPU, Poisson or gamma arrivals), one
   client thread per request streaming `Generate` with EOS ignored. Every request has its own API key, so
   the prefix cache cannot help it: throughput, client-side TTFT and TPOT, goodput against both SLOs.
2. Shared-prefix pass: prompts whose first half is one passage, sent one after another by one tenant;
   the share of prompt tokens the prefix cache spared from recomputation.
3. Parallel-sampling pass: peak blocks of one n=4 request vs the same prompt as 4 requests that cannot
   share (four API keys, hence four cache salts), from Status polled every 10 ms.
4. Leaked blocks once the pod is idle; then the stack stops and the same main-pass requests run through
   HF `generate()` in static batches (arrival order, left-padded, greedy, each batch until its longest
   output is done; only each request's own output counts as useful).

Prompts are cut from a fixed English passage (tokenized by the pod) at a distinct offset per request.

With `--openai-url`, the same main and shared-prefix passes run against any OpenAI-compatible server
(serve_openai.py): no stack is started, and nothing that needs pagedserve's gRPC Status or HF runs.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from ..protos import inference_pb2 as pb
from ..protos import inference_pb2_grpc as pb_grpc
from ..services.common.processes import stop_service
from . import serve_peer
from .report import emit
from .serve_passes import PASSAGE, Outcome, cut, main_pass, progress, run_at, shared_prefix_pass, workload
from .stack import start_stack
from .workloads import RequestSpec

HF_PAD_ID = 0  # masked out; any id in the vocabulary does


class Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.run_id = secrets.token_hex(4)  # in every API key: a rerun against the same pod starts cold

    def generate(self, ids: list[int], max_tokens: int, api_key: str, n: int = 1, seed: int = 0) -> Outcome:
        params = pb.GenerationParameters(max_tokens=max_tokens, ignore_eos=True, n=n, seed=seed,
                                         temperature=1.0 if n > 1 else 0.0)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), params=params)
        outcome = Outcome(time.monotonic())
        for chunk in self.stub.Generate(request, timeout=1800, metadata=[("x-api-key", f"{self.run_id}-{api_key}")]):
            if chunk.token_ids:
                outcome.last = time.monotonic()
                outcome.first = outcome.first or outcome.last
                outcome.num_tokens += len(chunk.token_ids)
            if chunk.HasField("usage"):
                outcome.prompt_tokens = chunk.usage.prompt_tokens
                outcome.cached_tokens = chunk.usage.cached_prompt_tokens
        outcome.end = time.monotonic()
        if outcome.num_tokens != max_tokens * n:
            raise RuntimeError(f"asked for {max_tokens * n} tokens, got {outcome.num_tokens}")
        return outcome

    def status(self) -> pb.StatusResponse:
        return self.stub.Status(pb.StatusRequest(), timeout=30)

    def wait_idle(self, timeout: float = 60.0) -> pb.StatusResponse:
        deadline = time.monotonic() + timeout
        while (status := self.status()).num_running or status.num_waiting or status.num_swapped:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the pod is still busy after {timeout}s: {status}")
            time.sleep(0.02)
        return status


class BlockMonitor(threading.Thread):
    """Polls Status in the background: (time, used blocks, cached blocks), every `interval` seconds."""

    def __init__(self, address: str, interval: float) -> None:
        super().__init__(name="block-monitor", daemon=True)
        self.client, self.interval = Client(address), interval
        self.samples: list[tuple[float, int, int]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                status = self.client.status()
                self.samples.append((time.monotonic(), status.num_used_blocks, status.num_cached_blocks))
            except grpc.RpcError:
                pass
            self.stopping.wait(self.interval)

    def peak(self, start: float, end: float) -> int:
        return max((used for t, used, _ in self.samples if start <= t <= end), default=0)


# ---- the passes -------------------------------------------------------------------------------------


def parallel_sampling_pass(client: Client, monitor: BlockMonitor, args: argparse.Namespace,
                           passage: list[int]) -> dict[str, Any]:
    """Peak used blocks: one n=4 request alone, then the same prompt as 4 concurrent unshareable requests."""
    ratios, peaks = [], []
    for i in range(args.n4_prompts):
        prompt = cut(passage, 11 + 97 * i, args.n4_prompt_len)
        peak = []
        for label, jobs in (
            ("n4", [(0.0, partial(client.generate, prompt, args.n4_max_tokens, f"n4-{i}", n=4, seed=i))]),
            ("x4", [(0.0, partial(client.generate, prompt, args.n4_max_tokens, f"x4-{i}-{j}", seed=i + j))
                    for j in range(4)]),
        ):
            client.wait_idle()
            start = time.monotonic()
            run_at(jobs)
            client.wait_idle()
            time.sleep(3 * monitor.interval)  # at least one sample after the end
            peak.append(monitor.peak(start, time.monotonic()))
            assert peak[-1] > 0, f"no block usage seen during the {label} run: is Status polled?"
        peaks.append(peak)
        ratios.append(peak[0] / peak[1])
    return {"parallel_sampling_block_ratio": round(statistics.mean(ratios), 4),
            "parallel_sampling_peaks": [{"n4": a, "four_requests": b} for a, b in peaks]}


def hf_pass(args: argparse.Namespace, prompts: list[list[int]], specs: list[RequestSpec]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from ..services.executor.model.registry import resolve_model

    # the executor's thread count: an OpenMP team as wide as the machine stalls at every barrier when
    # anything else runs (see the executor's --threads), which would slow HF down for no reason of its own
    torch.set_num_threads(args.hf_threads or args.threads or max(1, (os.cpu_count() or 2) - 1))
    source = resolve_model(args.model)
    kwargs: dict[str, Any] = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    folder = source.path.parent if source.kind == "gguf" else source.path
    device = torch.device(getattr(args, "device", "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the executor's default on each
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device, **kwargs).eval()
    load_s = time.perf_counter() - start

    def generate(batch: list[list[int]], new_tokens: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[HF_PAD_ID] * (width - len(p)) + p for p in batch], device=device)  # left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=HF_PAD_ID)
        assert out.shape[1] == width + new_tokens

    generate([prompts[0][:8]], 2)  # warm-up
    size = args.hf_batch_size
    start = time.perf_counter()
    for first in range(0, len(prompts), size):
        generate(prompts[first : first + size], max(s.output_len for s in specs[first : first + size]))
    elapsed = time.perf_counter() - start
    useful = sum(s.output_len for s in specs)
    computed = sum(len(specs[i : i + size]) * max(s.output_len for s in specs[i : i + size])
                   for i in range(0, len(specs), size))
    return {"hf_throughput_tok_s": round(useful / elapsed, 2), "hf_pass_s": round(elapsed, 1),
            "hf_load_s": round(load_s, 1), "hf_useful_token_frac": round(useful / computed, 3),
            "hf_threads": torch.get_num_threads(), "hf_batch_size": size}


def plot(path: Path, outcomes: list[Outcome], samples: list[tuple[float, int, int]],
         spans: dict[str, tuple[float, float]], t0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tpot, ax_blocks) = plt.subplots(3, 1, figsize=(9, 10))
    ax_ttft.hist([o.ttft_ms for o in outcomes], bins=30, color="tab:blue")
    ax_ttft.set(title="time to first token (main pass)", xlabel="ms", ylabel="requests")
    ax_tpot.hist([o.tpot_ms for o in outcomes if o.num_tokens > 1], bins=30, color="tab:orange")
    ax_tpot.set(title="time per output token (main pass)", xlabel="ms", ylabel="requests")
    times = [t - t0 for t, _, _ in samples]
    ax_blocks.plot(times, [u for _, u, _ in samples], label="used", lw=0.8)
    ax_blocks.plot(times, [c for _, _, c in samples], label="cached (free, reusable)", lw=0.8)
    for i, (name, (start, end)) in enumerate(spans.items()):
        ax_blocks.axvspan(start - t0, end - t0, alpha=0.1, color=f"C{i + 2}", label=name)
    ax_blocks.set(title="KV blocks over time", xlabel="s", ylabel="blocks")
    ax_blocks.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the command -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--plot", type=Path, help="write TTFT/TPOT histograms and block usage to this PNG")
    parser.add_argument("--address", help="a running pod (HOST:PORT) instead of starting one; --model must match")
    parser.add_argument("--openai-url", metavar="URL",
                        help="an OpenAI-compatible server (http://HOST:PORT[/v1]) instead of a pod: the main and "
                             "shared-prefix passes over streamed /v1/completions; --model gives the prompts' tokenizer")
    parser.add_argument("--openai-model", help="the model name to send with --openai-url (default: its first)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="with --openai-url: the bearer key of every request (default: $OPENAI_API_KEY; without "
                             "one each request sends a label of its own, a tenant of its own on a keyless pagedserve)")
    parser.add_argument("--model", default="smollm2-135m", help="registered name, HF directory or .gguf file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, help="requests of the main pass (default 32; --peer: 64)")
    parser.add_argument("--scale", type=float, default=0.15, help="ShareGPT lengths times this")
    parser.add_argument("--request-rate", type=float, default=4.0, help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson, < 1 burstier")
    parser.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=300.0)
    parser.add_argument("--prefix-prompts", type=int, default=16)
    parser.add_argument("--prefix-prompt-len", type=int, default=128)
    parser.add_argument("--prefix-max-tokens", type=int, default=8)
    parser.add_argument("--n4-prompts", type=int, default=2)
    parser.add_argument("--n4-prompt-len", type=int, default=256)
    parser.add_argument("--n4-max-tokens", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--hf-threads", type=int, help="torch threads for HF (default: the executor's)")
    stack = parser.add_argument_group("the pod (ignored with --address)")
    stack.add_argument("--kv-cache-mib", type=int)
    stack.add_argument("--block-size", type=int)
    stack.add_argument("--max-num-seqs", type=int)
    stack.add_argument("--max-num-batched-tokens", type=int)
    stack.add_argument("--preemption-mode", choices=["recompute", "swap"])
    stack.add_argument("--reserve-growth", action=argparse.BooleanOptionalAction,
                       help="serve's growth reserve (default: serve's, on)")
    stack.add_argument("--threads", type=int, help="the executor's torch threads (default: serve's)")
    stack.add_argument("--device", default="cpu", help="the executor's device (cuda: the Triton kernels in bf16)")
    serve_peer.add_arguments(parser)


@dataclass
class PodRun:
    result: dict[str, Any]
    specs: list[RequestSpec]
    prompts: list[list[int]]
    outcomes: list[Outcome]  # of the main pass
    monitor: BlockMonitor
    spans: dict[str, tuple[float, float]]  # pass -> (start, end), monotonic


def run_pod_passes(address: str, args: argparse.Namespace) -> PodRun:
    client, monitor = Client(address), BlockMonitor(address, 0.1)
    passage = list(client.stub.Tokenize(pb.TokenizeRequest(text=PASSAGE), timeout=60).token_ids)
    block_size = client.stub.ListModels(pb.ListModelsRequest(), timeout=60).models[0].block_size
    specs, prompts = workload(args, passage)
    spans: dict[str, tuple[float, float]] = {}
    monitor.start()
    try:
        start = time.monotonic()
        result, outcomes = main_pass(client, args, prompts, specs)
        spans["main"] = (start, time.monotonic())
        progress("main pass", result)
        client.wait_idle()
        start = time.monotonic()
        result.update(progress("shared-prefix pass", shared_prefix_pass(client, args, passage)))
        spans["shared prefix"] = (start, time.monotonic())
        monitor.interval, start = 0.01, time.monotonic()
        result.update(progress("n=4 pass", parallel_sampling_pass(client, monitor, args, passage)))
        spans["n=4"] = (start, time.monotonic())
        status = client.wait_idle()
    finally:
        monitor.stopping.set()
        monitor.join()
    result.update(num_preemptions=status.num_preemptions_recompute + status.num_preemptions_swap,
                  prefix_hit_rate=round(status.prefix_hit_rate, 4), leaked_blocks=status.num_used_blocks,
                  block_size=block_size, num_total_blocks=status.num_total_blocks)
    return PodRun(result, specs, prompts, outcomes, monitor, spans)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.peer or args.peer_url:
        args.num_requests = args.num_requests or 64
        return serve_peer.run_peer(args, Client)  # the random workload against pagedserve and a peer server
    args.num_requests = args.num_requests or 32
    if args.openai_url:
        from .serve_openai import run_openai  # the same passes over HTTP (serve_passes.py)

        return run_openai(args)
    wall_start, load_start = time.monotonic(), round(os.getloadavg()[0], 2)
    if args.address is not None:
        pod = run_pod_passes(args.address, args)
    else:
        with tempfile.TemporaryFile("w+") as log:
            stack = start_stack(args, log)
            progress("serving", {"address": stack.address, "start_s": round(time.monotonic() - wall_start, 1)})
            try:
                pod = run_pod_passes(stack.address, args)
            except BaseException:
                stop_service(stack, grace=60)
                log.seek(0)
                print(f"the pod's last output:\n{log.read()[-4000:]}", file=sys.stderr)
                raise
            finally:
                stop_service(stack, grace=60)
    result, specs, spans = pod.result, pod.specs, pod.spans
    load_before_hf = os.getloadavg()[0]
    hf_start = time.monotonic()
    result.update(progress("HF pass", hf_pass(args, pod.prompts, specs)))
    result["throughput_ratio_vs_hf"] = round(result["throughput_tok_s"] / result["hf_throughput_tok_s"], 3)
    if args.plot:
        plot(args.plot, pod.outcomes, pod.monitor.samples, spans, spans["main"][0])
    result.update(
        model=args.model, num_requests=len(specs), request_rate=args.request_rate, burstiness=args.burstiness,
        scale=args.scale, input_mean=round(statistics.mean(s.prompt_len for s in specs), 1),
        output_mean=round(statistics.mean(s.output_len for s in specs), 1),
        output_tokens=sum(s.output_len for s in specs), ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
        wall_s=round(time.monotonic() - wall_start, 1),
        # where the wall time went; the machine's load shows how much the numbers may be disturbed
        phase_s={"stack_start": round(spans["main"][0] - wall_start, 1),
                 **{name: round(end - start, 1) for name, (start, end) in spans.items()},
                 "stack_stop": round(hf_start - max(end for _, end in spans.values()), 1),
                 "hf_load": result.pop("hf_load_s"), "hf": result.pop("hf_pass_s")},
        load_avg_1m={"start": load_start, "before_hf": round(load_before_hf, 2),
                     "end": round(os.getloadavg()[0], 2)},
    )
    return result


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
