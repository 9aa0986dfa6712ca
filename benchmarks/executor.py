"""`pagedserve bench executor`: generation throughput of our engine vs HF transformers `generate()`.

For batch sizes 1, 8 and 32, the same prompts (a fixed set of short texts) and the same number of new
tokens (EOS ignored) run through `pagedserve.LLM` (paged KV cache, continuous batching, CPU torch path)
and through HF `generate()` on the same weights (greedy, one left-padded static batch). Tokens/s is
generated tokens over the wall time of the whole call, prefill included, measured side by side in one
process with the same torch thread count, alternating the two sides `--repeats` times (medians reported).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

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
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
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
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side; medians are reported")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ..services.executor.model.registry import resolve_model
    from ..services.frontend.llm import LLM

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, device="cpu", dtype="float32", max_num_seqs=max(batches), max_num_batched_tokens=2048)
    source = resolve_model(args.model)
    hf_kwargs: dict[str, Any] = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    folder = source.path.parent if source.kind == "gguf" else source.path
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **hf_kwargs).eval()
    result: dict[str, Any] = {"model": args.model, "new_tokens": args.new_tokens, "device": "cpu",
                              "torch_threads": torch.get_num_threads(), "repeats": args.repeats}
    warm = _prompts(llm.tokenizer, 2)
    bench_ours(llm, warm, 4)
    bench_hf(hf, llm.tokenizer, warm, 4)
    for batch in batches:
        prompts = _prompts(llm.tokenizer, batch)
        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate, so a burst of load elsewhere hits both sides alike
            ours.append(bench_ours(llm, prompts, args.new_tokens))
            theirs.append(bench_hf(hf, llm.tokenizer, prompts, args.new_tokens))
        result[f"ours_tok_s_batch{batch}"] = round(statistics.median(ours), 1)
        result[f"hf_tok_s_batch{batch}"] = round(statistics.median(theirs), 1)
        result[f"ratio_batch{batch}"] = round(statistics.median(ours) / statistics.median(theirs), 3)
    return result


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
