"""The offline API and `pagedserve run` on the default model (SmolLM2-135M from its PyPI package)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from pagedserve import LLM, GenerationParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", device="cpu", dtype="float32", kv_cache_mib=64)


def test_generate_text_and_chat(llm: LLM) -> None:
    params = GenerationParams(max_tokens=8)
    (paris,) = llm.generate("The capital of France is", params, progress=False)
    assert "Paris" in paris.outputs[0].text
    (answer,) = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]], params, progress=False)
    assert "Paris" in answer.outputs[0].text
    # the chat template was applied: the prompt carries the template's role markers, not the bare question
    rendered = llm.tokenizer.decode(answer.prompt_token_ids)
    assert "<|im_start|>user" in rendered and rendered.rstrip().endswith("assistant")


def test_batch_equals_single_and_prefix_cache_hits(llm: LLM) -> None:
    params = GenerationParams(max_tokens=12, ignore_eos=True)
    prompts = ["Once upon a time", "The three primary colors are", "def add(a, b):"]
    batch = llm.generate(prompts, params, progress=False)
    singles = [llm.generate(p, params, progress=False)[0] for p in prompts]
    assert [b.outputs[0].token_ids for b in batch] == [s.outputs[0].token_ids for s in singles]
    assert all(len(b.outputs[0].token_ids) == 12 for b in batch)
    long_prompt = "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 8
    cold = llm.generate(long_prompt, params, progress=False)[0]
    warm = llm.generate(long_prompt, params, progress=False)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens > 64
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert llm.stats()["num_used_blocks"] == 0


def test_executor_in_process_equals_executor_process(llm: LLM) -> None:
    params = GenerationParams(max_tokens=10, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3,"]
    with LLM("smollm2-135m", device="cpu", dtype="float32", kv_cache_mib=64, executor="thread") as in_process:
        here = in_process.generate(prompts, params, progress=False)
    there = llm.generate(prompts, params, progress=False)
    assert [r.outputs[0].token_ids for r in here] == [r.outputs[0].token_ids for r in there]


def test_a_bf16_cache_doubles_the_blocks_and_keeps_the_answers(llm: LLM) -> None:
    """The real model with `kv_cache_dtype="bfloat16"`: twice the blocks in the same budget, and what it
    generates stays close to the fp32 cache's: each chosen token's logprob, up to where the two first part."""
    params = GenerationParams(max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):", "The three primary colors are"]
    with LLM("smollm2-135m", device="cpu", dtype="float32", kv_cache_mib=64, executor="thread",
             kv_cache_dtype="bfloat16") as narrow:
        assert (narrow.info.dtype, narrow.info.kv_cache_dtype) == ("float32", "bfloat16")
        assert narrow.info.num_blocks == 2 * llm.info.num_blocks
        # what the blocks hold is part of the prefix cache's namespace: a bf16 block never serves an fp32 one
        assert (narrow.engine.identity.kv_dtype, llm.engine.identity.kv_dtype) == ("bfloat16", "float32")
        assert narrow.engine.identity.namespace(b"") != llm.engine.identity.namespace(b"")
        (paris,) = narrow.generate("The capital of France is", GenerationParams(max_tokens=8), progress=False)
        assert "Paris" in paris.outputs[0].text
        ours = narrow.generate(prompts, params, progress=False)
    wide = llm.generate(prompts, params, progress=False)
    for a, b in zip(ours, wide, strict=True):
        tokens, logprobs, theirs = a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(tokens, theirs, strict=True)) if x != y), len(tokens))
        assert same > 0 and len(tokens) == 16
        # measured: within 0.016 (fp32 vs bf16 keys and values; |logits| up to ~35)
        assert logprobs[:same] == pytest.approx(b.outputs[0].logprobs[:same], abs=0.1)


def test_in_process_the_model_opens_no_openmp_pool_on_the_callers_thread() -> None:
    # libgomp gives every thread that opens a parallel region a pool of workers of its own, and once the pools'
    # threads outnumber the cores, every pool's workers sleep at each barrier (a decode step 10-15 % slower on
    # two cores). So the in-process model loads and runs on its step thread only, and a parallel op on the
    # caller's thread afterwards starts the caller's first worker. In a child process: its main thread has
    # run nothing in parallel before.
    script = textwrap.dedent("""
        import os, torch
        from pagedserve import LLM, GenerationParams
        llm = LLM("smollm2-135m", device="cpu", dtype="float32", kv_cache_mib=16, executor="thread", threads=2)
        llm.generate(["The capital of France is"], GenerationParams(max_tokens=4), progress=False)
        torch.set_num_threads(2)
        before = len(os.listdir("/proc/self/task"))
        torch.randn(1 << 22).sum()  # millions of elements: a parallel region on this thread
        print(len(os.listdir("/proc/self/task")) - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.split()[-1] == "1", out.stdout + out.stderr


def test_an_in_process_model_that_fails_to_load_leaves_no_step_thread() -> None:
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="unknown model"):
        LLM("no-such-model", device="cpu", executor="thread")
    assert [t.name for t in set(threading.enumerate()) - before] == []


def test_close_stops_the_executor_process() -> None:
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", kv_cache_mib=16)
    child = llm.executor_process
    assert child is not None and child.proc.poll() is None
    llm.close()
    assert child.proc.poll() is not None


def test_run_cli_prints_one_json_object_per_prompt() -> None:
    cmd = [sys.executable, "-m", "pagedserve", "run", "--model", "smollm2-135m", "--prompt", "Hello, my name is",
           "--prompt", "2 + 2 =", "--max-tokens", "5", "--ignore-eos", "--json", "--kv-cache-mib", "32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello, my name is", "2 + 2 ="]
    for line in lines:
        assert len(line["token_ids"]) == 5 and line["finish_reason"] == "length" and isinstance(line["text"], str)


def test_decode_step_breakdown_times_the_cpu_decode_forward() -> None:
    # bench executor --decode-breakdown on the cpu backend wraps the decode forward's own GEMMs and C calls;
    # --decode-bound adds the step at context 1 and the bound from the bytes attention reads
    from pagedserve.benchmarks.executor import NORMS, bench_decode_step
    from pagedserve.services.executor.model import cpu_decode

    originals = (cpu_decode.native_library, cpu_decode._matmul, cpu_decode._gated_matmul)
    with LLM("smollm2-135m", device="cpu", dtype="float32", kv_cache_mib=16, executor="thread") as llm:
        result = bench_decode_step(llm, 4, 20, 3, breakdown=True, bound=True)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; 4 sequences attend to 20 tokens and the one each adds
    fp32_bytes = 4 * 21 * 30 * 2 * 3 * 64 * 4
    assert result["kv_read_mb_4"] == round(fp32_bytes / 1e6, 2)
    assert result["kv_read_mb_4_bfloat16_kv"] == round(fp32_bytes / 2 / 1e6, 2)
    assert result["decode_step_ms_4_context1"] > 0 and result["stream_read_gb_s"] > 0
    for suffix in ("", "_bfloat16_kv"):  # the context-1 ratio plus the reads at the streaming rate, over the matmuls
        reads_s = result[f"kv_read_mb_4{suffix}"] * 1e6 / (result["stream_read_gb_s"] * 1e9)
        assert result[f"decode_step_bound_over_matmul_4{suffix}"] == pytest.approx(
            result["decode_step_over_matmul_4_context1"] + reads_s / (result[f"decode_matmul_ms_4{suffix}"] / 1e3),
            abs=2e-3)
        assert result[f"decode_step_over_bound_4{suffix}"] == pytest.approx(  # the step over that bound
            result[f"decode_step_over_matmul_4{suffix}"] / result[f"decode_step_bound_over_matmul_4{suffix}"],
            rel=3e-3)
    assert result["kernel_backend"] == "cpu" and result["kv_cache_dtype"] == "float32"
    assert result["decode_step_ms_4_bfloat16_kv"] > 0 and result["kv_step_ratio_bf16_over_fp32"] > 0  # side by side
    parts = result["decode_breakdown_ms_4"]
    for name in ("matmul: linear layers", "matmul: LM head", "attention", NORMS, "sampling"):
        assert parts[name] > 0, name
    assert parts["rotary"] == 0  # inside the attention call
    assert parts["SiLU * up"] == 0  # the gate/up matmul's epilogue (fp32: SmolLM2's 1536 fits its panels)
    assert (cpu_decode.native_library, cpu_decode._matmul, cpu_decode._gated_matmul) == originals  # the wrappers go
