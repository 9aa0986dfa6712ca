"""Every Triton kernel compiles to a Hopper (sm_90) cubin on a machine without a GPU.

The interpreter replaces `@triton.jit` functions, so the compile runs in a subprocess with
TRITON_INTERPRET unset; run this file as a script to see the per-kernel report. The report also reads
each cubin's register use with the cuobjdump that ships in the Triton wheel: the 16-bit attention
builds must not spill (a spill costs local-memory traffic on every key tile).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# name -> whether the build must be free of register spills
EXPECTED = {
    "decode-bf16-gqa8-d128": True,
    "decode-split-fp16-mha-d128": True,
    "decode-fp32-gqa3-d80": True,
    "decode-reduce-bf16": True,
    "prefill-bf16-gqa8-d128": True,
    "prefill-fp16-gqa3-d80": True,
    "prefill-fp32-mha-d64": True,
    "prefill-fp32-gqa8-d128": False,  # fp32 caches are a correctness path; a few hundred bytes spill
    "cache-write-bf16": True,
    "copy-blocks-16bit": True,
}


def _specs() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int]]:
    """(name, kernel, pointer dtypes, constexprs, num_warps); other arguments are i32 (`scale` fp32)."""
    import triton.language as tl

    # By module path: the package re-exports functions with the same names as these modules.
    block_copy, cache_write, decode, prefill = (
        importlib.import_module(f"pagedserve.kernels.{name}")
        for name in ("block_copy", "cache_write", "paged_decode_attention", "paged_prefill_attention")
    )

    def attention_ptrs(dtype: str, out: str, partial: str) -> dict[str, str]:
        return {
            "out_ptr": out, "partial_max_ptr": partial, "partial_sum_ptr": partial, "q_ptr": dtype,
            "k_cache_ptr": dtype, "v_cache_ptr": dtype, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
            "cu_seqlens_q_ptr": "*i32",
        }  # fmt: skip

    def pow2(n: int) -> int:
        return 1 << (n - 1).bit_length()

    def decode_consts(group: int, head_dim: int, split: bool, precision: str) -> dict[str, Any]:
        return {
            "GROUP_SIZE": group, "BLOCK_G": pow2(group), "HEAD_DIM": head_dim, "BLOCK_D": pow2(head_dim),
            "BLOCK_SIZE": 16, "BLOCK_N": decode.BLOCK_N, "IS_SPLIT": split, "DOT_PRECISION": precision,
        }  # fmt: skip

    def prefill_consts(group: int, head_dim: int, precision: str) -> dict[str, Any]:
        return {
            "GROUP_SIZE": group, "HEAD_DIM": head_dim, "BLOCK_D": pow2(head_dim), "BLOCK_SIZE": 16,
            "BLOCK_M": prefill.BLOCK_M, "BLOCK_N": prefill.BLOCK_N, "DOT_PRECISION": precision,
        }  # fmt: skip

    decode_kernel, reduce_kernel = decode._paged_decode_attention_kernel, decode._paged_decode_reduce_kernel
    prefill_kernel = prefill._paged_prefill_attention_kernel
    return [
        ("decode-bf16-gqa8-d128", decode_kernel, attention_ptrs("*bf16", "*bf16", "*bf16"),
         decode_consts(8, 128, False, "tf32"), decode.NUM_WARPS),
        ("decode-split-fp16-mha-d128", decode_kernel, attention_ptrs("*fp16", "*fp32", "*fp32"),
         decode_consts(1, 128, True, "tf32"), decode.NUM_WARPS),
        ("decode-fp32-gqa3-d80", decode_kernel, attention_ptrs("*fp32", "*fp32", "*fp32"),
         decode_consts(3, 80, False, "tf32x3"), decode.NUM_WARPS),
        ("decode-reduce-bf16", reduce_kernel,
         {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_max_ptr": "*fp32", "partial_sum_ptr": "*fp32"},
         {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SPLITS": decode.MAX_SPLITS}, decode.NUM_WARPS),
        ("prefill-bf16-gqa8-d128", prefill_kernel, attention_ptrs("*bf16", "*bf16", "*bf16"),
         prefill_consts(8, 128, "tf32"), prefill.NUM_WARPS),
        ("prefill-fp16-gqa3-d80", prefill_kernel, attention_ptrs("*fp16", "*fp16", "*fp16"),
         prefill_consts(3, 80, "tf32"), prefill.NUM_WARPS),
        ("prefill-fp32-mha-d64", prefill_kernel, attention_ptrs("*fp32", "*fp32", "*fp32"),
         prefill_consts(1, 64, "tf32x3"), prefill.NUM_WARPS),
        ("prefill-fp32-gqa8-d128", prefill_kernel, attention_ptrs("*fp32", "*fp32", "*fp32"),
         prefill_consts(8, 128, "tf32x3"), prefill.NUM_WARPS),
        ("cache-write-bf16", cache_write._cache_write_kernel,
         {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
          "slot_mapping_ptr": "*i64"},
         {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128, "BLOCK_SIZE": 16}, 4),
        ("copy-blocks-16bit", block_copy._copy_blocks_kernel,
         {"cache_ptrs_ptr": "*i64", "block_mapping_ptr": "*i64"},
         {"ELEMENT_TYPE": tl.int16, "COPY_BLOCK": block_copy.COPY_BLOCK}, 4),
    ]  # fmt: skip


def _resource_usage(cubin: bytes) -> dict[str, int]:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        listing = subprocess.run([cuobjdump, "-res-usage", file.name], capture_output=True, text=True, check=True)
    match = re.search(r"REG:(\d+) STACK:(\d+)", listing.stdout)
    assert match, listing.stdout
    return {"registers": int(match[1]), "stack_bytes": int(match[2])}


def compile_all() -> dict[str, dict[str, Any]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = {}
    for name, kernel, pointers, constexprs, num_warps in _specs():
        signature = {
            arg: "constexpr" if arg in constexprs else pointers[arg] if arg.endswith("_ptr") else
            "fp32" if arg == "scale" else "i32"
            for arg in kernel.arg_names
        }  # fmt: skip
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        ptx = compiled.asm["ptx"]
        report[name] = {
            "cubin_bytes": len(compiled.asm["cubin"]),
            "targets_sm90": ".target sm_90" in ptx,
            "has_entry": f".entry {kernel.__name__}" in ptx,
            "shared_bytes": compiled.metadata.shared,
            **_resource_usage(compiled.asm["cubin"]),
        }
    return report


def test_every_kernel_compiles_for_sm90() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(Path(__file__))], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report) == set(EXPECTED)
    for name, entry in report.items():
        assert entry["cubin_bytes"] > 1000, name
        assert entry["targets_sm90"] and entry["has_entry"], name
        assert entry["shared_bytes"] <= 228 * 1024, name  # an H100/H200 SM's shared memory
        if EXPECTED[name]:
            assert entry["stack_bytes"] == 0, f"{name} spills registers: {entry}"


if __name__ == "__main__":
    assert "TRITON_INTERPRET" not in os.environ, "compile with the interpreter off"
    print(json.dumps(compile_all()))
