"""`pagedserve bench model`: our model path against HF transformers on one device, per dtype: the greedy
tokens (do they agree, and for how long) and the log-probability of each agreed token (how close).

For each `--dtypes` entry, the prompts of `bench executor` run through `pagedserve.LLM` (in process, the
device's kernels: Triton on a GPU) and through HF `generate()` (greedy, one prompt at a time, so no padding
changes HF's numbers) on the same weights, device and dtype. Keys per dtype: `greedy_match_<dtype>` (share
of prompts whose tokens are all equal), `greedy_prefix_<dtype>` (mean share of tokens before the first
difference), `logprob_max_abs_diff_<dtype>` (over the tokens before the first difference: ours against
HF's log-softmax of its logits, in fp32). On a GPU this is the first end-to-end check of the Triton path in
bf16/fp16 (scripts/gpu-check.sh); on the CPU it checks the torch path the same way.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from .executor import TEXTS
from .report import emit

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--out", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="bfloat16,float16", help="comma-separated: float32, bfloat16, float16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)


def hf_greedy(model: Any, prompt: list[int], new_tokens: int, device: str) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and the log-probability of each under HF's own logits."""
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1)[t].item() for step, t in zip(out.logits, tokens,
                                                                                          strict=True)]
    return tokens, logprobs


def compare(ours: list[tuple[list[int], list[float]]], theirs: list[tuple[list[int], list[float]]]
            ) -> dict[str, float]:
    matches, prefixes, diffs = 0, [], [0.0]
    for (our_tokens, our_lp), (hf_tokens, hf_lp) in zip(ours, theirs, strict=True):
        agreed = next((i for i, (a, b) in enumerate(zip(our_tokens, hf_tokens, strict=True)) if a != b),
                      len(hf_tokens))
        matches += agreed == len(hf_tokens)
        prefixes.append(agreed / len(hf_tokens))
        diffs += [abs(a - b) for a, b in zip(our_lp[:agreed], hf_lp[:agreed], strict=True)]
    return {"greedy_match": matches / len(ours), "greedy_prefix": sum(prefixes) / len(prefixes),
            "logprob_max_abs_diff": max(diffs)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from ..services.executor.model.registry import resolve_model
    from ..services.frontend.llm import LLM
    from ..services.frontend.request import GenerationParams

    source = resolve_model(args.model)
    hf_kwargs: dict[str, Any] = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    folder = source.path.parent if source.kind == "gguf" else source.path
    result: dict[str, Any] = {"model": args.model, "device": args.device, "prompts": args.prompts,
                              "new_tokens": args.new_tokens}
    if args.device == "cuda":
        result["device_name"] = torch.cuda.get_device_name()
    for name in args.dtypes.split(","):
        llm = LLM(args.model, device=args.device, dtype=name, executor="thread", kv_cache_mib=256)
        prompts = [llm.tokenizer.encode(TEXTS[i % len(TEXTS)], add_special_tokens=False) for i in range(args.prompts)]
        params = GenerationParams(max_tokens=args.new_tokens, ignore_eos=True)
        ours = [(c.outputs[0].token_ids, c.outputs[0].logprobs) for c in llm.generate(prompts, params, progress=False)]
        del llm
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[name], local_files_only=True, **hf_kwargs)
        hf = hf.to(args.device).eval()
        theirs = [hf_greedy(hf, p, args.new_tokens, args.device) for p in prompts]
        del hf
        for key, value in compare(ours, theirs).items():
            result[f"{key}_{name}"] = float(f"{value:.4g}")
    return result


def main(args: argparse.Namespace) -> None:
    emit(run(args), args)
