"""Every Triton kernel compiles to a Hopper (sm_90) cubin on a machine without a GPU.

The interpreter replaces `@triton.jit` functions, so the compile runs in a subprocess with
TRITON_INTERPRET unset; run this file as a script to see the per-kernel report.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

KERNEL_NAMES = {
    "decode-bf16-gqa8-d128",
    "decode-split-fp16-mha-d128",
    "decode-fp32-gqa3-d80",
    "decode-reduce-bf16",
    "prefill-bf16-gqa8-d128",
    "prefill-fp32-mha-d64",
    "cache-write-bf16",
    "copy-blocks-16bit",
}


def _specs() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """(name, kernel, pointer dtypes, constexprs); every other argument is an i32 (fp32 for `scale`)."""
    import triton.language as tl

    # By module path: the package re-exports functions with the same names as these modules.
    block_copy, cache_write, paged_decode_attention, paged_prefill_attention = (
        importlib.import_module(f"pagedserve.kernels.{name}")
        for name in ("block_copy", "cache_write", "paged_decode_attention", "paged_prefill_attention")
    )

    def attention_ptrs(dtype: str, out: str, partial: str) -> dict[str, str]:
        return {
            "out_ptr": out, "partial_max_ptr": partial, "partial_sum_ptr": partial, "q_ptr": dtype,
            "k_cache_ptr": dtype, "v_cache_ptr": dtype, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
            "cu_seqlens_q_ptr": "*i32",
        }  # fmt: skip

    def decode(group: int, head_dim: int, split: bool, precision: str) -> dict[str, Any]:
        return {
            "GROUP_SIZE": group, "BLOCK_G": group, "HEAD_DIM": head_dim, "BLOCK_D": 1 << (head_dim - 1).bit_length(),
            "BLOCK_SIZE": 16, "BLOCK_N": paged_decode_attention.BLOCK_N, "IS_SPLIT": split, "DOT_PRECISION": precision,
        }  # fmt: skip

    def prefill(group: int, head_dim: int, precision: str) -> dict[str, Any]:
        return {
            "GROUP_SIZE": group, "HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_SIZE": 16,
            "BLOCK_M": paged_prefill_attention.BLOCK_M, "BLOCK_N": paged_prefill_attention.BLOCK_N,
            "DOT_PRECISION": precision,
        }  # fmt: skip

    decode_kernel = paged_decode_attention._paged_decode_attention_kernel
    prefill_kernel = paged_prefill_attention._paged_prefill_attention_kernel
    return [
        ("decode-bf16-gqa8-d128", decode_kernel, attention_ptrs("*bf16", "*bf16", "*bf16"),
         decode(8, 128, False, "tf32")),
        ("decode-split-fp16-mha-d128", decode_kernel, attention_ptrs("*fp16", "*fp32", "*fp32"),
         decode(1, 128, True, "tf32")),
        ("decode-fp32-gqa3-d80", decode_kernel, attention_ptrs("*fp32", "*fp32", "*fp32"),
         {**decode(3, 80, False, "ieee"), "BLOCK_G": 4}),
        ("decode-reduce-bf16", paged_decode_attention._paged_decode_reduce_kernel,
         {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_max_ptr": "*fp32", "partial_sum_ptr": "*fp32"},
         {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SPLITS": paged_decode_attention.MAX_SPLITS}),
        ("prefill-bf16-gqa8-d128", prefill_kernel, attention_ptrs("*bf16", "*bf16", "*bf16"), prefill(8, 128, "tf32")),
        ("prefill-fp32-mha-d64", prefill_kernel, attention_ptrs("*fp32", "*fp32", "*fp32"), prefill(1, 64, "ieee")),
        ("cache-write-bf16", cache_write._cache_write_kernel,
         {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
          "slot_mapping_ptr": "*i64"},
         {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128, "BLOCK_SIZE": 16}),
        ("copy-blocks-16bit", block_copy._copy_blocks_kernel,
         {"cache_ptrs_ptr": "*i64", "block_mapping_ptr": "*i64"},
         {"ELEMENT_TYPE": tl.int16, "COPY_BLOCK": block_copy.COPY_BLOCK}),
    ]  # fmt: skip


def compile_all() -> dict[str, dict[str, Any]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = {}
    for name, kernel, pointers, constexprs in _specs():
        signature = {
            arg: "constexpr" if arg in constexprs else pointers[arg] if arg.endswith("_ptr") else
            "fp32" if arg == "scale" else "i32"
            for arg in kernel.arg_names
        }  # fmt: skip
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = compiled.asm["ptx"]
        report[name] = {
            "cubin_bytes": len(compiled.asm["cubin"]),
            "targets_sm90": ".target sm_90" in ptx,
            "has_entry": f".entry {kernel.__name__}" in ptx,
            "shared_bytes": compiled.metadata.shared,
        }
    return report


def test_every_kernel_compiles_for_sm90() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONSAFEPATH"] = "1"
    result = subprocess.run(
        [sys.executable, str(Path(__file__))], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report) == KERNEL_NAMES
    for name, entry in report.items():
        assert entry["cubin_bytes"] > 1000, name
        assert entry["targets_sm90"] and entry["has_entry"], name
        assert entry["shared_bytes"] <= 228 * 1024, name  # an H100/H200 SM's shared memory


if __name__ == "__main__":
    assert "TRITON_INTERPRET" not in os.environ, "compile with the interpreter off"
    print(json.dumps(compile_all()))
