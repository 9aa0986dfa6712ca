"""`pagedserve bench serve --peer vllm`: one client, one random workload, against pagedserve (over its OpenAI HTTP
API and over gRPC) and against vLLM's OpenAI-compatible server run as its CPU docs say, at each concurrency.

The workload is the shape of vLLM's own `bench serve --dataset-name random`: `--num-requests` prompts of
`--input-len` tokens, `--output-len` tokens each, greedy, EOS ignored, all sent at once with at most C in flight for
each C of `--max-concurrency`. Prompts are cut from a fixed passage and each opens with a token pair of its own, and
every pass has prompts of its own: no prompt shares a cached block with another, on either side (vLLM caches
prefixes across requests by default, whoever sends them).

Both servers run for the whole benchmark: pagedserve's pod (one stack, `--dtype`) and vLLM's OpenAI server on the
same weights (hf_export.py) and dtype, tuned as bench offline's peer is (tcmalloc and libiomp5 preloaded, no CPU
reserved) with a KV space of `--peer-kv-cache-mib`. Each round runs every side (the pod over HTTP, over gRPC, the
peer) at every level, one pass at a time, in an order reversed every other round (`--repeats` rounds; keys are
medians, and each ratio the median of the rounds' own ratios). Both at their best with the same memory: the pod
gets the peer's KV budget (unless `--kv-cache-mib`, or with `--peer-url`) and, like the tuned peer, every core for
its model (`--threads`, default the core count; serve's own default keeps one core for the frontend and sidecar,
safer on a shared machine and slower here). Each side serves one short request before the first round. Over HTTP
the prompt goes as text (the token ids decoded; each server tokenizes it again) and the times are taken at the SSE
events with text, as serve_openai.py does; over gRPC as token ids.

`--peer-url URL` takes a server already running as the peer instead (another engine, or vLLM started by hand).

Keys: `sides.<side>.c<C>` (sides `pagedserve_http`, `pagedserve_grpc`, `peer_http`) with `throughput_tok_s`,
`ttft_ms_p50/p99`, `tpot_ms_p50/p99`, `e2e_ms_p50`; then per concurrency `<side>_vs_peer_c<C>`: throughput, TTFT p50
and TPOT p50 as ratios to the peer's (the target: throughput >= 1.0, TTFT and TPOT <= 1.0), with the rounds'
throughput ratios in `<side>_vs_peer_c<C>_rounds`. Where the benchmark started the server, each pass also gives
the CPU its processes spent per generated token, `<role>_cpu_ms_per_token` (user + system time from /proc): the
pod's `frontend`, `executor` and `block_manager` (its `supervisor` too), vLLM's `server` (the API server) and its
`workers` (the engine core): what each door costs the host, beside what it costs the clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from ..services.common.processes import ServiceProcess, stop_service
from ..services.executor.model.registry import resolve_model
from ..services.executor.model.tokenizer import load_tokenizer
from .hf_export import export_hf
from .serve_openai import OpenAIClient
from .serve_passes import PASSAGE, Generates, Outcome, cut, pct, progress
from .stack import free_port, start_stack
from .vllm_peer import DEFAULT_VLLM_VENV, tuned_preloads, vllm_python

VLLM_START_TIMEOUT_S = 900.0  # its first start compiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--peer vllm (serve_peer.py)")
    group.add_argument("--peer", choices=["vllm"],
                       help="the random workload against pagedserve (HTTP and gRPC) and vLLM's OpenAI server")
    group.add_argument("--peer-url", metavar="URL",
                       help="instead of starting vLLM: an OpenAI-compatible server already running as the peer")
    group.add_argument("--max-concurrency", default="8,64", help="requests in flight, comma-separated")
    group.add_argument("--input-len", type=int, default=128)
    group.add_argument("--output-len", type=int, default=128)
    group.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                       help="the pod's weights (with --peer, vLLM's too)")
    group.add_argument("--peer-venv", type=Path, default=DEFAULT_VLLM_VENV)
    group.add_argument("--peer-kv-cache-mib", type=int, default=4096, help="vLLM's KV space")
    group.add_argument("--repeats", type=int, default=1,
                       help="rounds of every side at every level, both servers up (medians; per-round ratios)")


def concurrencies(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise SystemExit(f"bench serve: --max-concurrency must list positive integers; got {text!r}")
    return values


def random_prompts(passage: list[int], count: int, length: int, first: int = 0) -> list[list[int]]:
    """Prompts `first` .. `first + count - 1`, each opening with a token pair of its own: no two share a block, so
    no server's prefix cache (vLLM's is on by default, and knows no tenants) serves one from another."""
    tokens = sorted(set(passage))
    return [[tokens[k % len(tokens)], tokens[k // len(tokens) % len(tokens)], *cut(passage, 97 * k + 11, length - 2)]
            for k in range(first, first + count)]


def run_concurrent(client: Generates, prompts: Sequence[list[int]], output_len: int, concurrency: int,
                   label: str) -> dict[str, Any]:
    """Every prompt sent at once, at most `concurrency` in flight; the pass's keys."""
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda ip: client.generate(ip[1], output_len, f"{label}-{ip[0]}"),
                                 enumerate(prompts)))
    return pass_keys(outcomes, start)


def pass_keys(outcomes: Sequence[Outcome], start: float) -> dict[str, Any]:
    ttft, tpot = [o.ttft_ms for o in outcomes], [o.tpot_ms for o in outcomes if o.num_tokens > 1]
    tokens = sum(o.num_tokens for o in outcomes)
    return {"throughput_tok_s": round(tokens / (max(o.end for o in outcomes) - start), 2),
            "ttft_ms_p50": round(pct(ttft, 50), 1), "ttft_ms_p99": round(pct(ttft, 99), 1),
            "tpot_ms_p50": round(pct(tpot, 50), 1), "tpot_ms_p99": round(pct(tpot, 99), 1),
            "e2e_ms_p50": round(pct([o.e2e_ms for o in outcomes], 50), 1), "completion_tokens": tokens}


@contextmanager
def vllm_server(args: argparse.Namespace, log: Any) -> Iterator[tuple[str, int]]:
    """vLLM's OpenAI server (`vllm serve`) on a loopback port, tuned; its base URL once /health answers 200, and
    its PID."""

    python, port = vllm_python(args.peer_venv), free_port()
    hf_dir = export_hf(args.model)
    preloaded, missing = tuned_preloads(args.peer_venv)
    if missing:
        progress("vllm preloads missing", {"missing": missing})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "LD_PRELOAD": ":".join(preloaded)}
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--dtype", args.dtype,
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--max-model-len", str(max(args.input_len + args.output_len + 16, 256)),
           "--kv-cache-memory-bytes", str(args.peer_kv_cache_mib << 20)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, VLLM_START_TIMEOUT_S)
        yield url, proc.pid
    finally:
        stop_service(ServiceProcess(proc, url), grace=30)


POD_ROLES = ("frontend", "executor", "block-manager")


def process_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of `root` and every process under it, by role: a pod's processes by the
    command they run, with what runs under each (the root is the `supervisor`); any other server's root as
    `server` and everything under it as `workers` (vLLM's engine core and the model's processes)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    spent_by_pid: dict[int, float] = {}
    argv_of: dict[int, list[bytes]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        pid = int(entry.name)
        parent[pid], argv_of[pid] = int(fields[1]), argv
        spent_by_pid[pid] = (int(fields[11]) + int(fields[12])) / tick
    is_pod = b"pagedserve" in argv_of.get(root, []) and b"serve" in argv_of.get(root, [])
    spent: dict[str, float] = {}
    for pid, seconds in spent_by_pid.items():
        line, role = pid, None  # walk up to the root: the first pod role met on the way names the process
        while line != root and line in parent and line > 1:
            role = role or next((r for r in POD_ROLES if r.encode() in argv_of[line]), None)
            line = parent[line]
        if line != root:
            continue
        if not is_pod:
            role = "server" if pid == root else "workers"
        elif pid == root or role is None:
            role = "supervisor"
        key = role.replace("-", "_")
        spent[key] = spent.get(key, 0.0) + seconds
    return spent


def wait_http(url: str, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer 200 within {timeout} s")


def run_peer(args: argparse.Namespace, grpc_client: Callable[[str], Generates]) -> dict[str, Any]:
    """`grpc_client(address)`: serve.py's gRPC client."""

    levels = concurrencies(args.max_concurrency)
    wall_start, load_start = time.monotonic(), round(os.getloadavg()[0], 2)
    if not args.peer_url:
        vllm_python(args.peer_venv)  # fail before minutes of work
    if args.kv_cache_mib is None and not args.peer_url:
        args.kv_cache_mib = args.peer_kv_cache_mib
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    tokenizer = load_tokenizer(resolve_model(args.model))
    passage = list(tokenizer.encode(PASSAGE, add_special_tokens=False))
    with tempfile.TemporaryFile("w+") as pod_log, tempfile.TemporaryFile("w+") as peer_log, ExitStack() as servers:
        try:
            http_port = free_port()
            stack = start_stack(args, pod_log, http_port=http_port)
            servers.callback(stop_service, stack, 60)
            peer_url, peer_pid = (args.peer_url, None) if args.peer_url else servers.enter_context(
                vllm_server(args, peer_log))
            clients = {"pagedserve_http": OpenAIClient(f"http://127.0.0.1:{http_port}", tokenizer, None, None),
                       "pagedserve_grpc": grpc_client(stack.address),
                       "peer_http": OpenAIClient(peer_url, tokenizer, args.api_key if args.peer_url else None, None)}
            roots = {"pagedserve_http": stack.proc.pid, "pagedserve_grpc": stack.proc.pid, "peer_http": peer_pid}
            rounds = [one_round(clients, roots, passage, args, levels, r) for r in range(args.repeats)]
        except BaseException:
            _print_tail(pod_log, "the pod")
            _print_tail(peer_log, "the peer")
            raise
    sides = {side: {f"c{c}": median_keys([r[side][f"c{c}"] for r in rounds]) for c in levels} for side in clients}
    result: dict[str, Any] = {"peer": args.peer_url or "vllm", "sides": sides}
    for side in ("pagedserve_http", "pagedserve_grpc"):
        for c in levels:
            per_round = [ratios(r[side][f"c{c}"], r["peer_http"][f"c{c}"]) for r in rounds]
            result[f"{side}_vs_peer_c{c}"] = median_keys(per_round)
            result[f"{side}_vs_peer_c{c}_rounds"] = [r["throughput"] for r in per_round]
    result.update(pod_flags={"threads": args.threads, "kv_cache_mib": args.kv_cache_mib},
                  peer_kv_cache_mib=None if args.peer_url else args.peer_kv_cache_mib, repeats=args.repeats,
                  model=args.model, dtype=args.dtype, num_requests=args.num_requests, input_len=args.input_len,
                  output_len=args.output_len, max_concurrency=levels, wall_s=round(time.monotonic() - wall_start, 1),
                  load_avg_1m={"start": load_start, "end": round(os.getloadavg()[0], 2)})
    return result


def one_round(clients: dict[str, Generates], roots: dict[str, int | None], passage: list[int],
              args: argparse.Namespace, levels: list[int], number: int) -> dict[str, dict[str, Any]]:
    """Every side at every level, the sides in turn (reversed every other round: no side always goes first); each
    pass on prompts of its own, and each side warmed by a short request the first time. `roots`: each side's
    server process where known, whose CPU per token each pass reports."""
    order = list(clients) if number % 2 == 0 else list(reversed(clients))
    result: dict[str, dict[str, Any]] = {}
    for side in order:
        if number == 0:
            clients[side].generate(random_prompts(passage, 1, 16, first=10**6)[0], 4, f"{side}-warm")
        result[side] = {}
        for i, c in enumerate(levels):
            prompts = random_prompts(passage, args.num_requests, args.input_len,
                                     first=(number * len(levels) + i) * args.num_requests)
            root = roots[side]
            before = process_cpu_s(root) if root is not None else {}
            keys = run_concurrent(clients[side], prompts, args.output_len, c, f"{side}-r{number}-c{c}")
            if root is not None:
                after = process_cpu_s(root)
                keys |= {f"{role}_cpu_ms_per_token": round((after[role] - before.get(role, 0.0)) * 1000
                                                           / max(1, keys["completion_tokens"]), 3) for role in after}
            result[side][f"c{c}"] = progress(f"round {number + 1} {side} c{c}", keys)
    return result


def median_keys(passes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {key: round(statistics.median(p[key] for p in passes), 3) for key in passes[0]}


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    def over(key: str) -> float:
        return round(ours[key] / theirs[key], 3) if theirs[key] else float("inf")

    return {"throughput": over("throughput_tok_s"), "ttft_p50": over("ttft_ms_p50"), "tpot_p50": over("tpot_ms_p50")}


def _print_tail(log: Any, who: str) -> None:
    log.seek(0)
    print(f"{who}'s last output:\n{log.read()[-4000:]}", file=sys.stderr)

