"""`pagedserve run`: offline generation for a few prompts, printed as text or one JSON object per prompt."""

from __future__ import annotations

import argparse
import json

from ..executor.options import DTYPE_NAMES, KV_CACHE_DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="a registered name, an HF directory or a .gguf file")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="render each prompt as a user message of the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt and line")
    parser.add_argument("--dtype", choices=DTYPE_NAMES)
    parser.add_argument("--device")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--num-blocks", type=int)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="bfloat16: a bf16 KV cache under fp32 weights on the CPU")


def main(args: argparse.Namespace) -> None:
    from .llm import LLM
    from .request import GenerationParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_mib=args.kv_cache_mib,
              num_blocks=args.num_blocks, kv_cache_dtype=args.kv_cache_dtype)
    params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, n=args.n, ignore_eos=args.ignore_eos)
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        results = llm.generate(args.prompt, params)
    for prompt, result in zip(args.prompt, results, strict=True):
        for out in result.outputs:
            if args.json:
                print(json.dumps({
                    "prompt": prompt, "index": out.index, "text": out.text, "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason, "num_prompt_tokens": len(result.prompt_token_ids),
                    "num_cached_tokens": result.num_cached_tokens,
                }), flush=True)
            else:
                print(f"--- {prompt!r} [{out.index}] ({out.finish_reason})\n{out.text}", flush=True)
