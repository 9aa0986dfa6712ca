"""vLLM's offline engine on one batch of token-id prompts: the peer side of `pagedserve bench offline`.

Runs under the peer venv's python (benchmarks/peers/setup-vllm.sh), never under pagedserve's: it imports
nothing of pagedserve. The prompts arrive as token ids and go in as `TokensPrompt`s, so vLLM sees exactly
the ids the other sides see. Greedy, EOS ignored, `--dtype` (fp32 by default). One small warm-up `generate()`
first (it also triggers vLLM's compilation), then the timed one over all prompts; tokens/s is generated tokens over the
wall time of that call, prefill included (median over `--repeats`). Prints one JSON line: tok_s, the
generated ids, versions.

    python vllm_offline.py --model HF_DIR --prompts PROMPTS.json --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

# Offline: only package registries are reachable. Set before vLLM (and huggingface_hub) read them.
for _name, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                      "DO_NOT_TRACK": "1"}.items():
    os.environ.setdefault(_name, _value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    parser.add_argument("--prompts", type=Path, required=True, help="a JSON list of token-id lists")
    parser.add_argument("--new-tokens", type=int, required=True)
    # a fixed KV budget: by default vLLM's CPU backend claims 92 % of the node's memory, and refuses to start
    # when that much is not free
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs; the median is reported")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile (vLLM's default compiles)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    prompts: list[list[int]] = json.loads(args.prompts.read_text())
    result = run(args.model, prompts, args.new_tokens, args.enforce_eager, args.kv_cache_mib, args.repeats, args.dtype)
    print(json.dumps(result), flush=True)


def run(
    model: Path, prompts: list[list[int]], new_tokens: int, enforce_eager: bool, kv_cache_mib: int, repeats: int,
    dtype: str,
) -> dict[str, Any]:
    import torch
    import vllm  # type: ignore[import-not-found]  # only in the peer venv, never in pagedserve's
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    max_model_len = max(max(len(p) for p in prompts) + new_tokens, 256)  # 256: room for its chat-template warm-up
    llm = LLM(model=str(model), tokenizer=str(model), dtype=dtype, max_model_len=max_model_len,
              max_num_seqs=len(prompts), seed=0, enforce_eager=enforce_eager, kv_cache_memory_bytes=kv_cache_mib << 20)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        rates.append(len(prompts) * new_tokens / (time.perf_counter() - start))
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(t) == new_tokens for t in token_ids), "vLLM stopped early despite ignore_eos"
    return {
        "tok_s": statistics.median(rates),
        "tok_s_runs": rates,
        "token_ids": token_ids,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "enforce_eager": enforce_eager,
        "dtype": dtype,
    }


if __name__ == "__main__":
    main()
