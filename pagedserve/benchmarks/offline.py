"""`pagedserve bench offline`: one offline batch through `pagedserve.LLM`, HF `generate()` and, with
`--peer vllm`, vLLM's CPU build: 64 distinct prompts x 128 new tokens, greedy, EOS ignored, CPU, fp32 or
(`--dtype bfloat16`) bf16 on every side. The peer runs twice a round: tuned as its CPU docs say (tcmalloc and
libiomp5 preloaded, threads on every core, none reserved) and as it starts by default; `ratio_vs_peer` is
against the faster of the two.

With `--serve`, the same batch also goes through `pagedserve serve` as unary gRPC calls (`serve_tok_s`,
`serve_vs_offline`). All sides get the same prompt token ids (tokenized once, with the model's tokenizer)
and are timed over the whole call, prefill included, after a small warm-up. HF runs one left-padded static
batch; vLLM runs in a subprocess under its own venv (benchmarks/peers/setup-vllm.sh) on an HF export of the same weights
(pagedserve/benchmarks/hf_export.py). Greedy outputs are compared, not asserted: fp32 on identical ids should
mostly agree, and where two near-tied logits meet, summation order alone can flip a token.

With `--repeats N` the sides take turns N times (ours, HF, then the peer in a fresh process), so a burst of
load elsewhere hits them alike; rates are medians, and `ratio_vs_peer` is the median of each round's own
ratio (`ratio_vs_peer_rounds`): single runs on a shared 2-core machine moved it between 0.88 and 1.08.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..kernels.linear_ops import bf16_path
from ..services.executor.options import KV_CACHE_DTYPES
from .executor import TEXTS, bench_hf, bench_ours
from .report import emit
from .vllm_peer import DEFAULT_VLLM_VENV, PEERS_DIR, tuned_preloads, vllm_python

# how each round over TEXTS is worded, so that every prompt is distinct
FRAMES = ["{text}", "Continue the text: {text}", "Read this, then go on.\n\n{text}", "Notes, part {round}: {text}"]


def prompt_texts(count: int) -> list[str]:
    texts = []
    for i in range(count):
        round_ = i // len(TEXTS)
        text = FRAMES[round_ % len(FRAMES)].format(text=TEXTS[i % len(TEXTS)], round=round_)
        texts.append(text if round_ < len(FRAMES) else f"{text} ({round_})")
    assert len(set(texts)) == count
    return texts


def run_ours(llm: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], int]:
    """Tokens/s, the generated ids, and the number of preemptions (0 unless the KV cache ran short)."""
    from ..services.frontend.request import GenerationParams

    params = GenerationParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, progress=False)
    elapsed = time.perf_counter() - start
    outputs = [list(r.outputs[0].token_ids) for r in results]
    assert all(len(o) == new_tokens for o in outputs)
    return len(prompts) * new_tokens / elapsed, outputs, sum(r.num_preemptions for r in results)


def run_hf(model: Any, pad_token_id: int, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """One left-padded static batch. EOS neither stops nor is masked (no `min_new_tokens`, which would
    forbid it): the same rule as `ignore_eos` on the other sides, so greedy outputs are comparable."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])  # [batch, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = copy.deepcopy(model.generation_config)
    # [], not None: None falls back to the model's EOS, which stops a sequence and pads the rest of it
    config.update(eos_token_id=[], max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # [batch, width + new]
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return len(prompts) * new_tokens / elapsed, out[:, width:].tolist()


def run_vllm(python: Path, hf_dir: Path, prompts: list[list[int]], new_tokens: int, kv_cache_mib: int, repeats: int,
             eager: bool, dtype: str, tuned: bool) -> dict[str, Any]:
    """benchmarks/peers/vllm_offline.py under the peer venv's python; its last JSON line is the result, plus
    the CPUs its worker's OpenMP threads were bound to (from its log).

    `tuned`: as vLLM's CPU docs say to run it at its best: tcmalloc and Intel's OpenMP preloaded, the OpenMP
    threads bound to every core with none reserved (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`). Otherwise its default on
    this machine: nothing preloaded but the libgomp vLLM preloads itself, and on a 2-core machine one CPU kept
    for its engine-core process."""
    with tempfile.TemporaryDirectory(prefix="pagedserve-offline-") as scratch:
        prompts_file = Path(scratch) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        cmd = [str(python), str(PEERS_DIR / "vllm_offline.py"), "--model", str(hf_dir), "--prompts", str(prompts_file),
               "--new-tokens", str(new_tokens), "--kv-cache-mib", str(kv_cache_mib), "--repeats", str(repeats),
               "--dtype", dtype, *(["--enforce-eager"] if eager else [])]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("LD_PRELOAD", None)
        preloaded, missing = tuned_preloads(python.parents[1]) if tuned else ([], [])
        if tuned:
            env |= {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **({"LD_PRELOAD": ":".join(preloaded)} if preloaded else {})}
        done = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"the vLLM runner failed (exit {done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    bound = re.search(r"core ids=\[([\d, ]*)\]", done.stdout + done.stderr)
    result["omp_cpus"] = [int(c) for c in bound.group(1).split(",") if c.strip()] if bound else None
    result["preloaded"], result["missing_preloads"] = [Path(p).name for p in preloaded], missing
    return result


def run_served(args: argparse.Namespace, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """The same batch through `pagedserve serve` (three processes, gRPC on loopback): every prompt as a unary
    Complete call at once, timed from the first call to the last answer; medians over --repeats."""
    import grpc

    from ..protos import inference_pb2 as pb
    from ..protos import inference_pb2_grpc as pb_grpc
    from ..services.common.processes import stop_service
    from .stack import start_stack

    flags = dict.fromkeys(("preemption_mode", "block_size", "ttft_slo_ms", "tpot_slo_ms"))
    # the executor gets the offline run's torch threads (all cores), not serve's default of all but one
    stack_args = argparse.Namespace(model=args.model, kv_cache_mib=args.kv_cache_mib, max_num_seqs=len(prompts),
                                    max_num_batched_tokens=2048, threads=torch.get_num_threads(),
                                    dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, **flags)
    with tempfile.TemporaryFile("w+") as log:
        stack = start_stack(stack_args, log)
        try:
            with grpc.insecure_channel(stack.address) as channel:
                stub = pb_grpc.InferenceStub(channel)

                def call(ids: list[int], tokens: int) -> Any:
                    params = pb.GenerationParameters(max_tokens=tokens, ignore_eos=True)
                    return stub.Complete.future(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), params=params),
                                                timeout=3600)

                for future in [call(p, 4) for p in prompts[:2]]:  # warm-up
                    future.result()
                rates, outputs = [], []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    futures = [call(p, new_tokens) for p in prompts]
                    outputs = [list(f.result().choices[0].token_ids) for f in futures]
                    rates.append(len(prompts) * new_tokens / (time.perf_counter() - start))
        finally:
            stop_service(stack, grace=60)
    assert all(len(o) == new_tokens for o in outputs)
    return statistics.median(rates), outputs


def greedy_match(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, float]:
    """The fraction of prompts whose outputs are equal, and the mean fraction of tokens before they part."""
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) / len(a)
              for a, b in zip(ours, theirs, strict=True)]
    return equal / len(ours), statistics.fmean(prefix)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--model", default="smollm2-135m", help="a registered name, .gguf file or HF directory")
    parser.add_argument("--prompts", type=int, default=64, help="distinct prompts, all in one batch")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="KV budget of pagedserve and of vLLM")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the weights' dtype on every side (vLLM's default for this model is bfloat16)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="pagedserve's (bfloat16: a bf16 cache under fp32 weights; the greedy matches say"
                             " what it changed); the peer's follows --dtype")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds in which every side runs once, alternated; medians are reported")
    parser.add_argument("--serve", action="store_true",
                        help="also run the batch through `pagedserve serve` (unary gRPC calls) and compare")
    parser.add_argument("--peer", choices=["vllm"], help="also run this engine (in its own venv)")
    parser.add_argument("--peer-venv", type=Path, default=DEFAULT_VLLM_VENV)
    parser.add_argument("--peer-eager", action="store_true", help="vLLM without torch.compile")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ..services.executor.model.registry import resolve_model
    from ..services.frontend.llm import LLM

    peer_python = vllm_python(args.peer_venv) if args.peer == "vllm" else None  # fail before minutes of work
    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=args.prompts, max_num_batched_tokens=2048,
              kv_cache_mib=args.kv_cache_mib, kv_cache_dtype=args.kv_cache_dtype)
    prompts = [list(llm.tokenizer.encode(t, add_special_tokens=False)) for t in prompt_texts(args.prompts)]
    source = resolve_model(args.model)
    hf_kwargs: dict[str, Any] = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    folder = source.path.parent if source.kind == "gguf" else source.path
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype), local_files_only=True,
                                              **hf_kwargs).eval()
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0

    bench_ours(llm, prompts[:2], 4)  # warm-up
    bench_hf(hf, llm.tokenizer, prompts[:2], 4)
    run_peer = None  # one run of the peer on the batch, in a process of its own
    if peer_python is not None:
        from .hf_export import export_hf

        run_peer = functools.partial(run_vllm, peer_python, export_hf(args.model), prompts, args.new_tokens,
                                     args.kv_cache_mib, 1, args.peer_eager, args.dtype)
    ours_rates, hf_rates, peer_runs = [], [], []
    for _ in range(args.repeats):  # alternate, so a burst of load elsewhere hits every side alike
        rate, ours, preemptions = run_ours(llm, prompts, args.new_tokens)
        ours_rates.append(rate)
        rate, theirs = run_hf(hf, pad, prompts, args.new_tokens)
        hf_rates.append(rate)
        if run_peer is not None:  # processes of their own each round: ours and HF sit idle meanwhile
            peer_runs.append({"tuned": run_peer(tuned=True), "default": run_peer(tuned=False)})
    tok_s, hf_tok_s = statistics.median(ours_rates), statistics.median(hf_rates)
    match_hf, prefix_hf = greedy_match(ours, theirs)
    result: dict[str, Any] = {
        "tok_s": round(tok_s, 1), "hf_tok_s": round(hf_tok_s, 1), "ratio_vs_hf": round(tok_s / hf_tok_s, 3),
        "greedy_match_vs_hf": round(match_hf, 3), "greedy_prefix_vs_hf": round(prefix_hf, 3),
    }
    if args.serve:
        serve_tok_s, served = run_served(args, prompts, args.new_tokens)
        result |= {"serve_tok_s": round(serve_tok_s, 1), "serve_vs_offline": round(serve_tok_s / tok_s, 3),
                   "serve_executor_threads": torch.get_num_threads(),
                   "greedy_match_serve_vs_offline": round(greedy_match(served, ours)[0], 3)}
    if peer_runs:
        result |= peer_keys(peer_runs, ours_rates, ours, theirs)
    result |= {
        "model": args.model, "prompts": len(prompts), "new_tokens": args.new_tokens,
        "prompt_tokens_mean": round(statistics.fmean(map(len, prompts)), 1), "dtype": args.dtype, "device": "cpu",
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(), "num_preemptions": preemptions, "repeats": args.repeats,
        "python": sys.version.split()[0], "kernel_backend": llm.info.kernel_backend,
        "kv_cache_dtype": llm.info.cache_dtype,
        **({"bf16_path": bf16_path()} if args.dtype == "bfloat16" else {}),  # AMX, AVX-512-BF16, or a fallback
    }
    return result


def peer_keys(peer_runs: list[dict[str, dict[str, Any]]], ours_rates: list[float], ours: list[list[int]],
              theirs: list[list[int]]) -> dict[str, Any]:
    """The peer's figures, tuned and default, with the ratio against the faster of the two in each round."""
    tuned, default = peer_runs[-1]["tuned"], peer_runs[-1]["default"]
    best_rates = [max(run["tuned"]["tok_s"], run["default"]["tok_s"]) for run in peer_runs]
    # each round's own ratio, then their median: side by side, as the sides ran minutes apart
    round_ratios = [rate / best for rate, best in zip(ours_rates, best_rates, strict=True)]
    match_peer, prefix_peer = greedy_match(ours, tuned["token_ids"])
    return {
        "peer": "vllm",
        "peer_tok_s_tuned": round(statistics.median(run["tuned"]["tok_s"] for run in peer_runs), 1),
        "peer_tok_s_default": round(statistics.median(run["default"]["tok_s"] for run in peer_runs), 1),
        "peer_tok_s": round(statistics.median(best_rates), 1),
        "ratio_vs_peer": round(statistics.median(round_ratios), 3),
        "ratio_vs_peer_rounds": [round(r, 3) for r in round_ratios],
        "greedy_match_vs_peer": round(match_peer, 3), "greedy_prefix_vs_peer": round(prefix_peer, 3),
        "greedy_match_peer_vs_hf": round(greedy_match(tuned["token_ids"], theirs)[0], 3),
        "greedy_match_peer_tuned_vs_default": round(greedy_match(tuned["token_ids"], default["token_ids"])[0], 3),
        "peer_version": tuned["vllm_version"], "peer_torch": tuned["torch_version"],
        "peer_enforce_eager": tuned["enforce_eager"],
        "peer_omp_cpus_tuned": tuned["omp_cpus"], "peer_omp_cpus_default": default["omp_cpus"],
        "peer_preloaded_tuned": tuned["preloaded"], "peer_missing_preloads": tuned["missing_preloads"],
    }


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
