"""`pagedserve bench executor`: generation throughput of our engine vs HF transformers `generate()`, and
the cost of one decode step against its own matmuls.

For batch sizes 1, 8 and 32, the same prompts (a fixed set of short texts) and the same number of new
tokens (EOS ignored) run through `pagedserve.LLM` (paged KV cache, continuous batching; the torch path on
the CPU, the Triton kernels with `--device cuda`) and through HF `generate()` on the same weights (greedy,
one left-padded static batch). Tokens/s is
generated tokens over the wall time of the whole call, prefill included, measured side by side in one
process with the same torch thread count, alternating the two sides `--repeats` times (medians reported).
Every torch op of the benchmark (HF's too) runs on the LLM's step thread, so that the process has one OpenMP
pool, as the executor service does: with two pools on two cores every parallel region waits for a wake-up
(ports.LocalExecutor).

The decode step (`--decode-seqs` sequences, 64 by default, each `--decode-context` tokens into its context):
the whole `ModelRunner.execute` of one greedy decode step (batch building, forward, logits, sampling) against
the same linear layers alone (every layer's fused QKV, O, fused gate/up and down projections, and the LM head,
with the step's shapes), the two timed alternately (medians). Their ratio is what the step costs beyond its
GEMMs: attention, norms, rotary, activations, sampling, Python (docs/performance.md). `--decode-breakdown`
times its parts; on the cpu backend those of its decode forward (services/executor/model/cpu_decode.py), where
the rotary embedding and the cache write are part of "attention". Under fp32 weights on the CPU the step is
also timed over a bf16 cache (`--kv-cache-dtype`: half the bytes attention reads), alternated with the fp32
one: `decode_step_over_matmul_64_bfloat16_kv`, `kv_step_ratio_bf16_over_fp32`.

`--decode-bound` asks how far the step is from what this machine allows: the same step at context 1 (everything
but attention's reads of the cache: `decode_step_over_matmul_64_context1`), the bytes of keys and values the
step's attention reads (`kv_read_mb_64`), and the rate at which torch reads a buffer far larger than the
caches (`stream_read_gb_s`). `decode_step_bound_over_matmul_64` (and `_bfloat16_kv`) is the context-1 ratio
plus the time those bytes take at that rate, over the matmuls: the step if attention cost only its reads,
none of them overlapped with the GEMMs (which keep every core busy); `decode_step_over_bound_64` is the step over
that bound, measured in the same run (target <= 1.05).

`--prefill-prompts N` times a prefill step of N prompts of 128 tokens (4: the 512 tokens of `serve`'s default
budget) the same way, against its linear layers at N x 128 rows (the LM head at N; the gate/up layer with its
SiLU * up where the backend fuses them, as the step runs it): `prefill_step_ms_512`,
`prefill_matmul_ms_512`, `prefill_tok_s_512` (prompt tokens a second) and `prefill_step_over_matmul_512`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import statistics
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..services.executor.options import KERNEL_BACKENDS, KV_CACHE_DTYPES
from .report import emit

TEXTS = [
    "The history of the printing press begins", "Write a short poem about the sea.", "def quicksort(items):",
    "Explain why the sky is blue in simple words.", "Once upon a time, in a small village,",
    "The three laws of thermodynamics are", "List five uses of a paperclip:", "In 1969, the first humans",
    "A good breakfast should include", "Translate to French: The cat sleeps on the warm windowsill.",
    "The main causes of the French Revolution were", "import numpy as np\n\n# compute the mean of", "Dear team,",
    "Photosynthesis converts", "The best way to learn a new language is", "Q: What is 17 times 23?\nA:",
]


def _prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    return [tokenizer.encode(TEXTS[i % len(TEXTS)], add_special_tokens=False) for i in range(batch)]


def bench_ours(llm: Any, prompts: list[list[int]], new_tokens: int) -> float:
    from ..services.frontend.request import GenerationParams

    params = GenerationParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, progress=False)
    elapsed = time.perf_counter() - start
    assert all(len(r.outputs[0].token_ids) == new_tokens for r in results)
    return len(prompts) * new_tokens / elapsed


def bench_hf(model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return len(prompts) * new_tokens / elapsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the Triton kernels)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kernel-backend", choices=KERNEL_BACKENDS,
                        help="as the executor's (default: triton on a GPU, else cpu where it builds)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="the LLM's KV cache (the decode step is also timed over the other one)")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side; medians are reported")
    parser.add_argument("--decode-seqs", type=int, default=64, help="sequences of the timed decode step (0: skip)")
    parser.add_argument("--decode-context", type=int, default=80,
                        help="tokens each sequence of the decode step attends to (64 prompts x 128 new tokens"
                             " average ~75)")
    parser.add_argument("--prefill-prompts", type=int, default=0,
                        help="prompts of 128 tokens in the timed prefill step (0: skip)")
    parser.add_argument("--decode-breakdown", action="store_true",
                        help="also time the decode step's parts (matmuls, attention, norms, ...): decode_breakdown_ms")
    parser.add_argument("--decode-bound", action="store_true",
                        help="also time the step at context 1 and this machine's streaming read rate: the step's"
                             " bound if attention only read the cache (decode_step_bound_over_matmul_N)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ..services.executor.model.registry import resolve_model
    from ..services.frontend.llm import LLM
    from ..services.frontend.ports import LocalExecutor

    batches = [int(b) for b in args.batches.split(",")]
    # in process: the decode-step timing below runs the LLM's own model on a runner of its own
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(batches), max_num_batched_tokens=2048,
              executor="thread", kernel_backend=args.kernel_backend, kv_cache_dtype=args.kv_cache_dtype)
    source = resolve_model(args.model)
    hf_kwargs: dict[str, Any] = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    folder = source.path.parent if source.kind == "gguf" else source.path
    executor = llm.engine.executor
    assert isinstance(executor, LocalExecutor), f"the LLM's executor is {type(executor).__name__}"
    on_model_thread = executor.call

    def load_hf() -> Any:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype), **hf_kwargs).to(
            args.device).eval()
    hf = on_model_thread(load_hf)
    result: dict[str, Any] = {"model": args.model, "new_tokens": args.new_tokens, "device": args.device,
                              "dtype": args.dtype,
                              "torch_threads": on_model_thread(torch.get_num_threads), "repeats": args.repeats}
    warm = _prompts(llm.tokenizer, 2)
    bench_ours(llm, warm, 4)
    on_model_thread(bench_hf, hf, llm.tokenizer, warm, 4)
    for batch in batches:
        prompts = _prompts(llm.tokenizer, batch)
        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate, so a burst of load elsewhere hits both sides alike
            ours.append(bench_ours(llm, prompts, args.new_tokens))
            theirs.append(on_model_thread(bench_hf, hf, llm.tokenizer, prompts, args.new_tokens))
        result[f"ours_tok_s_batch{batch}"] = round(statistics.median(ours), 1)
        result[f"hf_tok_s_batch{batch}"] = round(statistics.median(theirs), 1)
        result[f"ratio_batch{batch}"] = round(statistics.median(ours) / statistics.median(theirs), 3)
    if args.decode_seqs > 0:
        result.update(on_model_thread(functools.partial(
            bench_decode_step, llm, args.decode_seqs, args.decode_context, max(args.repeats, 5),
            breakdown=args.decode_breakdown, bound=args.decode_bound)))
    if args.prefill_prompts > 0:
        result.update(on_model_thread(bench_prefill_step, llm, args.prefill_prompts, PREFILL_LEN,
                                      max(args.repeats, 5)))
    return result


PREFILL_LEN = 128  # tokens a prompt in the timed prefill step: `bench serve`'s prompts


Slots = Callable[[int, int, int], list[int]]  # (sequence, first position, count) -> their cache slots


def _tables(num_seqs: int, tokens: int, block_size: int) -> tuple[list[list[int]], Slots]:
    """Block tables for `num_seqs` sequences of up to `tokens` tokens, side by side in a cache of their own, and
    the slots of a sequence's positions."""
    blocks_per_seq = -(-tokens // block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]

    def slots(seq: int, start: int, count: int) -> list[int]:
        return [tables[seq][p // block_size] * block_size + p % block_size for p in range(start, start + count)]

    return tables, slots


def _time_alternately(steps: list[tuple[Any, Any]], matmuls: Callable[[], None],
                      repeats: int) -> tuple[list[list[float]], list[list[float]]]:
    """Each (runner, step) and the matmuls once to warm up, then `repeats` rounds of each step followed by the
    matmuls: the seconds of every step's runs, and of the matmuls timed right after each."""
    for runner, step in steps:
        runner.execute(step)
    matmuls()
    step_s: list[list[float]] = [[] for _ in steps]
    matmul_s: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for (runner, step), step_times, matmul_times in zip(steps, step_s, matmul_s, strict=True):
            start = time.perf_counter()
            runner.execute(step)
            step_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            matmuls()
            matmul_times.append(time.perf_counter() - start)
    return step_s, matmul_s


def bench_prefill_step(llm: Any, num_prompts: int, prompt_len: int, repeats: int) -> dict[str, Any]:
    """One prefill step of `num_prompts` prompts of `prompt_len` tokens against its own matmuls (medians of
    `repeats` alternating timings), on a runner of its own that shares the LLM's model. Each run writes the same
    slots, so every run is the same step."""
    from ..services.executor.runner import ModelRunner
    from ..services.executor.step_types import GREEDY, SequenceInput, StepInput

    served = llm.engine.executor.runner
    tables, slots = _tables(num_prompts, prompt_len, served.block_size)
    runner = ModelRunner(served.model, served.config, served.backend, served.block_size,
                         num_prompts * len(tables[0]), 0, served.max_model_len, kv_dtype=served.kv_dtype)
    prompts = _prompts(llm.tokenizer, num_prompts)
    step = StepInput([SequenceInput(i, (prompts[i] * prompt_len)[:prompt_len], 0, tables[i], slots(i, 0, prompt_len),
                                    GREEDY) for i in range(num_prompts)])
    tokens = num_prompts * prompt_len
    matmuls = _step_matmuls(served.model, tokens, logit_rows=num_prompts)
    [step_s], [matmul_s] = _time_alternately([(runner, step)], matmuls, repeats)
    return {f"prefill_step_ms_{tokens}": round(1000 * statistics.median(step_s), 2),
            f"prefill_matmul_ms_{tokens}": round(1000 * statistics.median(matmul_s), 2),
            f"prefill_tok_s_{tokens}": round(tokens / statistics.median(step_s), 1),
            f"prefill_step_over_matmul_{tokens}": round(statistics.median(
                step / matmul for step, matmul in zip(step_s, matmul_s, strict=True)), 3)}


def bench_decode_step(llm: Any, num_seqs: int, context: int, repeats: int, *, breakdown: bool = False,
                      bound: bool = False) -> dict[str, Any]:
    """One decode step of `num_seqs` sequences at `context` tokens vs its own matmuls (medians of `repeats`
    alternating timings). The step runs on a runner of its own that shares the LLM's model (weights), with a
    KV cache just large enough, so that nothing of the LLM's cache is touched. Under fp32 weights on the CPU
    the same step is also timed over a cache of the other dtype (fp32 or bf16, `--kv-cache-dtype`), alternated
    with the first: keys ending `_bfloat16_kv` (or `_float32_kv`) and `kv_step_ratio_bf16_over_fp32`. With
    `bound`, the step at context 1 too (`_context1`), and the step's bound (module docstring)."""
    from ..services.executor.engine_config import dtype_name
    from ..services.executor.runner import ModelRunner
    from ..services.executor.step_types import GREEDY, SequenceInput, StepInput
    from ..services.frontend.ports import LocalExecutor

    executor = llm.engine.executor
    assert isinstance(executor, LocalExecutor), f"the LLM's executor is {type(executor).__name__}"
    served = executor.runner
    block_size = served.block_size
    # the served cache, and the other of fp32 and bf16 where the executor would build a bf16 one
    narrow = _narrow_cache(served)
    kv_dtypes = [served.kv_dtype, *({served.dtype, narrow} - {served.kv_dtype} if narrow is not None else ())]
    prompts = _prompts(llm.tokenizer, num_seqs)

    def prepared(kv_dtype: torch.dtype, context: int) -> tuple[ModelRunner, StepInput]:
        tables, slots = _tables(num_seqs, context + 1, block_size)
        runner = ModelRunner(served.model, served.config, served.backend, block_size, num_seqs * len(tables[0]), 0,
                             served.max_model_len, kv_dtype=kv_dtype)
        last_tokens = []
        for first in range(0, num_seqs, 8):  # prefill: each prompt repeated up to the context, 8 sequences a step
            seqs = [SequenceInput(i, (prompts[i] * context)[:context], 0, tables[i], slots(i, 0, context), GREEDY)
                    for i in range(first, min(first + 8, num_seqs))]
            last_tokens += [t.token_id for t in runner.execute(StepInput(seqs))]
        # The same step again and again: each run writes the same slot, so the context stays `context` tokens.
        return runner, StepInput([SequenceInput(i, [last_tokens[i]], context, tables[i], slots(i, context, 1), GREEDY)
                                  for i in range(num_seqs)])

    n = num_seqs
    # each timed step with its keys' suffix: the served cache, the other one, and with `bound` the served one at
    # context 1
    suffixes = ["", *(f"_{str(kv_dtype).removeprefix('torch.')}_kv" for kv_dtype in kv_dtypes[1:])]
    steps = [prepared(kv_dtype, context) for kv_dtype in kv_dtypes]
    if bound:
        suffixes.append("_context1")
        steps.append(prepared(served.kv_dtype, 1))
    step_s, matmul_s = _time_alternately(steps, _step_matmuls(served.model, num_seqs), repeats)
    result: dict[str, Any] = {
        "kernel_backend": served.backend.name,  # "cpu": the C kernels (kernels/cpu_native.py); "torch": torch's ops
        f"decode_context_{n}": context, "kv_cache_dtype": dtype_name(served.kv_dtype),
    }
    ratios = []
    for suffix, step_times, matmul_times in zip(suffixes, step_s, matmul_s, strict=True):
        # the ratio of each step to the matmuls timed right after it: load elsewhere that drifts over the run
        # slows both sides of a pair alike
        ratios.append(statistics.median(step / matmul for step, matmul in zip(step_times, matmul_times, strict=True)))
        result |= {f"decode_step_ms_{n}{suffix}": round(1000 * statistics.median(step_times), 2),
                   f"decode_matmul_ms_{n}{suffix}": round(1000 * statistics.median(matmul_times), 2),
                   f"decode_step_over_matmul_{n}{suffix}": round(ratios[-1], 3)}
    if len(kv_dtypes) == 2:  # each round's bf16 step over its fp32 step, side by side
        bf16 = kv_dtypes.index(torch.bfloat16)
        result["kv_step_ratio_bf16_over_fp32"] = round(statistics.median(
            narrow / wide for narrow, wide in zip(step_s[bf16], step_s[1 - bf16], strict=True)), 3)
    if bound:
        rate = _stream_read_bytes_per_s(served.device)
        result["stream_read_gb_s"] = round(rate / 1e9, 2)
        config, context1 = served.config, ratios[-1]
        for i, kv_dtype in enumerate(kv_dtypes):
            read = n * (context + 1) * config.num_layers * 2 * config.num_kv_heads * config.head_dim * torch.finfo(
                kv_dtype).bits // 8  # each sequence attends to its context and the token it adds
            result[f"kv_read_mb_{n}{suffixes[i]}"] = round(read / 1e6, 2)
            bound_ratio = context1 + read / rate / statistics.median(matmul_s[i])
            result[f"decode_step_bound_over_matmul_{n}{suffixes[i]}"] = round(bound_ratio, 3)
            # the step over that bound, from the same run (target <= 1.05): what is left to take out of it
            result[f"decode_step_over_bound_{n}{suffixes[i]}"] = round(ratios[i] / bound_ratio, 3)
    if breakdown:
        runner, step = steps[0]
        parts: dict[str, list[float]] = collections.defaultdict(list)
        with _section_timers(runner.model) as sections:
            for _ in range(repeats):
                sections.clear()
                start = time.perf_counter()
                runner.execute(step)
                sections["step"] = time.perf_counter() - start
                for name, seconds in _breakdown(sections).items():
                    parts[name].append(seconds)
        result[f"decode_breakdown_ms_{n}"] = {name: round(1000 * statistics.median(v), 2) for name, v in parts.items()}
    return result


STREAM_READ_BYTES = 1 << 30  # far beyond any cache: reads come from memory


def _stream_read_bytes_per_s(device: torch.device) -> float:
    """The rate at which torch sums a 1 GiB buffer with the step's threads (the best of five): how fast this
    machine streams memory into the cores, which bounds how fast attention can read a cold cache."""
    buffer = torch.ones(STREAM_READ_BYTES // 4, device=device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum().item()  # .item(): until the device is done
        times.append(time.perf_counter() - start)
    return STREAM_READ_BYTES / min(times)


def _narrow_cache(served: Any) -> torch.dtype | None:
    """The bf16 cache the executor would build under the served weights (engine_config's rule), or None."""
    from ..services.executor.engine_config import kv_cache_dtype
    from ..services.executor.options import ExecutorConfig

    try:
        return kv_cache_dtype(ExecutorConfig(kv_cache_dtype="bfloat16"), served.dtype, served.backend.name)
    except ValueError:
        return None


NORMS = "RMSNorm (and the residual adds)"  # each sublayer's output is added by the norm after it, in one call


@contextlib.contextmanager
def _section_timers(model: Any) -> Iterator[collections.defaultdict[str, float]]:
    """Wall time of the step's parts, summed over the step: wrappers on the model's modules and on the functions
    the runner and the layers call, all removed on exit. The wrappers add ~1 us per call (~300 a step). On the
    cpu backend the decode step runs `cpu_decode.decode_forward`, whose GEMMs and C calls are wrapped instead
    (there the rotary embedding and the cache write are inside the attention call)."""
    from ..kernels.backend import CPU_BACKEND
    from ..services.executor import runner as runner_module
    from ..services.executor.model import cpu_decode
    from ..services.executor.model import llama as llama_module

    seconds: collections.defaultdict[str, float] = collections.defaultdict(float)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start
        return wrapper

    modules: list[tuple[Any, str, str]] = [(model, "forward", "forward"), (model, "compute_logits", "matmul: LM head"),
                                           (model.norm, "forward", NORMS)]
    functions = [(runner_module, "sample", "sampling"), (runner_module, "build_attention_metadata", "metadata")]
    backend = model.backend
    if backend == CPU_BACKEND:  # the decode forward's own calls
        library = cpu_decode.native_library()
        names = {"rms_norm_f32": NORMS, "add_rms_norm_f32": NORMS, "decode_attention_layer_f32": "attention",
                 "silu_and_mul_f32": "SiLU * up"}
        timed_library = types.SimpleNamespace(**{f: timed(name, getattr(library, f)) for f, name in names.items()})
        matmul, gated_matmul = cpu_decode._matmul, cpu_decode._gated_matmul
        functions += [(cpu_decode, name, "") for name in ("native_library", "_matmul", "_gated_matmul")]
        replacements = {"native_library": lambda: timed_library,
                        "_matmul": lambda b: timed("matmul: linear layers", matmul(b)),
                        "_gated_matmul": lambda b: timed("matmul: linear layers", gated_matmul(b))}
    else:
        for layer in model.layers:
            modules += [(lin, "forward", "matmul: linear layers") for lin in (
                layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            modules += [(norm, "forward", NORMS) for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        functions.append((llama_module, "paged_attention", "attention"))
        replacements = {}
        fused = backend.linear_silu_and_mul
        model.use_backend(dataclasses.replace(
            backend, rotary=timed("rotary", backend.rotary), silu_and_mul=timed("SiLU * up", backend.silu_and_mul),
            linear_silu_and_mul=fused and timed("matmul: linear layers", fused)))
    for owner, attr, name in modules:
        setattr(owner, attr, timed(name, getattr(owner, attr)))  # an instance attribute over the class's method
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in functions]
    for owner, attr, name in functions:
        setattr(owner, attr, replacements.get(attr) or timed(name, getattr(owner, attr)))
    try:
        yield seconds
    finally:
        model.use_backend(backend)
        for owner, attr, _ in modules:
            delattr(owner, attr)
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


def _breakdown(seconds: collections.defaultdict[str, float]) -> dict[str, float]:
    """The timed parts, and what is left of the forward pass and of the step once they are taken out."""
    names = ("matmul: linear layers", "matmul: LM head", "attention", NORMS, "rotary", "SiLU * up", "sampling",
             "metadata")
    parts = {name: seconds[name] for name in names}
    in_forward = ("matmul: linear layers", "attention", NORMS, "rotary", "SiLU * up")
    parts["forward, other (embedding, views, module calls)"] = (
        seconds["forward"] - sum(parts[name] for name in in_forward))
    parts["runner, other (batch, Python)"] = seconds["step"] - seconds["forward"] - sum(
        parts[name] for name in ("matmul: LM head", "sampling", "metadata"))
    parts["step"] = seconds["step"]
    return parts


def _step_matmuls(model: Any, num_tokens: int, logit_rows: int | None = None) -> Any:
    """The model's linear layers (each decoder layer's, then the LM head on `logit_rows` rows, by default every
    token's) on inputs of a step's shapes, through the model's own matmul (the kernel backend's; the gate/up layer
    with its SiLU * up where the backend fuses them, as the step runs it)."""
    linears = [lin for layer in model.layers for lin in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    fused = model.backend.linear_silu_and_mul
    norm = model.norm.weight  # never released: the linear weights and a tied head's table may be (meta) on the cpu
    dtype, device = norm.dtype, norm.device
    inputs = {lin.in_features: torch.randn(num_tokens, lin.in_features, dtype=dtype, device=device) for lin in linears}
    hidden = torch.randn(num_tokens if logit_rows is None else logit_rows, norm.shape[0], dtype=dtype, device=device)

    @torch.inference_mode()
    def run() -> None:
        for lin in linears:
            if fused is not None and lin.packed.gate_up:
                fused(inputs[lin.in_features], lin.weight, lin.packed)
            else:
                lin(inputs[lin.in_features])
        model.compute_logits(hidden)
        if device.type == "cuda":
            torch.cuda.synchronize()  # timed as the step is: until the device is done

    return run


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
