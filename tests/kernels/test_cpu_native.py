"""The CPU's decode attention in C against plain fp64 attention and the torch path, its checks, its threads."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch
from kernel_testing import assert_close, dense_attention_fp64, make_paged_kv, strided_queries
from test_backend import run_python

from pagedserve import kernels
from pagedserve.kernels import cpu_unavailable_reason, paged_decode_attention_cpu, paged_decode_attention_ref
from pagedserve.kernels.cpu_native import CFLAGS, SOURCES, _openmp_runtimes
from pagedserve.kernels.linear_ops import linear_packed


def test_the_kernel_builds_here() -> None:
    # `make test` installs a C compiler, so the CPU serving path is the native one wherever the tests run
    assert cpu_unavailable_reason() is None
    backend = kernels.get_backend("cpu")
    assert backend.name == "cpu" and backend.decode_attention is paged_decode_attention_cpu
    assert backend.prefill_attention is kernels.paged_prefill_attention_cpu
    assert backend.linear is linear_packed  # torch's CPU wheels carry oneDNN


def test_it_runs_on_torchs_openmp_runtime() -> None:
    # one runtime, torch's: a second would run its own threads against torch's at every layer
    assert cpu_unavailable_reason() is None
    runtimes = _openmp_runtimes()
    assert len(runtimes) == 1 and Path(next(iter(runtimes))).is_relative_to(Path(torch.__file__).parent), runtimes


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the vectorizer's report is gcc's")
@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.name)  # cpu_gemm.c: its gated epilogue's loop
def test_every_simd_loop_vectorizes_on_this_cpu(source: Path, tmp_path: Path) -> None:
    # The build's own flags for this machine, with gcc's report of the loops it vectorized. A loop that
    # selects between values compiles to branches on a CPU without AVX-512 unless trapping math is off:
    # SiLU * up and the softmax's exp once ran one element at a time on an AVX2 machine, 2.3x slower.
    flags = [f for f in CFLAGS if f not in ("-shared", "-fPIC")]
    report = subprocess.run(["gcc", *flags, "-fopt-info-vec-optimized", "-c", str(source), "-o",
                             str(tmp_path / "kernel.o")], check=True, capture_output=True, text=True).stderr
    vectorized = {int(line) for line in re.findall(rf"{re.escape(source.name)}:(\d+):\d+: optimized: loop vectorized",
                                                   report)}
    lines = source.read_text().splitlines()
    simd_loops = [_loop_lines(lines, number + 1) for number, line in enumerate(lines, start=1)
                  if line.strip().startswith("#pragma omp simd")]
    assert simd_loops, f"no `omp simd` loop in {source.name}"
    assert [loop[0] for loop in simd_loops if not vectorized & set(loop)] == [], report


def _loop_lines(lines: list[str], first: int) -> range:
    """The 1-based lines of the loop that starts on line `first` (gcc names a line inside it)."""
    depth, number = 0, first
    for number in range(first, len(lines) + 1):
        depth += lines[number - 1].count("{") - lines[number - 1].count("}")
        if depth <= 0 and (number > first or ";" in lines[number - 1]):
            break
    return range(first, number + 1)


@pytest.mark.parametrize(
    ("group", "head_dim", "block_size", "seq_lens"),
    [
        (1, 64, 16, [1, 16, 17, 45]),
        (3, 64, 16, [80, 3, 0, 33]),  # SmolLM2's 9 query / 3 KV heads; an empty sequence attends to nothing
        (4, 32, 8, [9, 1, 64]),
        (2, 128, 32, [100, 31]),
        (8, 16, 1, [5, 2]),  # two passes of four query heads per KV head
        (7, 64, 16, [50, 18]),  # passes of four and three query heads
        (5, 24, 8, [19, 4]),  # four and one; AVX2: three single vectors per head
        (2, 20, 16, [30, 7]),  # not a multiple of the vector width: the plain loops
        (1, 24, 16, [40, 2]),  # a multiple of AVX2's 8 floats, not AVX-512's 16
        (1, 48, 16, [23, 5]),  # AVX2: the values summed as a block of four vectors, then two of one
        (1, 320, 16, [20, 3]),  # wider than the registers hold (256): the plain loops
    ],
)
def test_matches_dense_attention(group: int, head_dim: int, block_size: int, seq_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + block_size)
    kv = make_paged_kv(seq_lens, 3, head_dim, block_size, torch.float32, generator=gen)
    k_cache, v_cache, tables, lens = kv.k_cache.cpu(), kv.v_cache.cpu(), kv.block_tables.cpu(), kv.seq_lens.cpu()
    q = strided_queries(len(seq_lens), 3 * group, head_dim, torch.float32, gen).cpu()  # a view, as the model's
    scale = 0.3  # logits well beyond N(0, 1): exercises the max subtraction
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    for seq, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            assert torch.equal(out[seq], torch.zeros_like(out[seq]))
            continue
        expected = dense_attention_fp64(q[seq : seq + 1], kv.keys[seq], kv.values[seq], scale)
        assert_close(out[seq : seq + 1], expected, torch.float32)
    reference = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
    # both round: longer dot products drift further apart (each is checked against fp64 above)
    torch.testing.assert_close(out, reference, atol=2e-6 * max(1, head_dim // 64), rtol=1e-5)


@pytest.mark.parametrize(
    ("group", "head_dim", "seq_lens"),
    [(3, 64, [80, 3, 0, 33]), (7, 64, [50, 18]), (1, 48, [23, 5]), (2, 20, [30, 7]), (1, 320, [20, 3])],
)
def test_a_bf16_cache_gives_the_fp32_result_over_its_values_widened(group: int, head_dim: int,
                                                                    seq_lens: list[int]) -> None:
    # bf16 -> fp32 is exact, so reading a bf16 cache is the fp32 kernel over the widened cache, to the bit: in
    # registers (64, 48) and in the plain loops (20; 320, wider than the registers)
    gen = torch.Generator().manual_seed(head_dim + group)
    kv = make_paged_kv(seq_lens, 3, head_dim, 16, torch.bfloat16, generator=gen)
    k_cache, v_cache, tables, lens = kv.k_cache.cpu(), kv.v_cache.cpu(), kv.block_tables.cpu(), kv.seq_lens.cpu()
    q = strided_queries(len(seq_lens), 3 * group, head_dim, torch.float32, gen).cpu()
    narrow = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 0.3)
    assert torch.equal(narrow, paged_decode_attention_cpu(q, k_cache.float(), v_cache.float(), tables, lens, 0.3))
    reference = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)  # widens as it gathers
    torch.testing.assert_close(narrow, reference, atol=2e-6 * max(1, head_dim // 64), rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_seqs", [37, 2])  # 2: fewer sequences than threads, a task per (sequence, KV head)
def test_any_thread_count_gives_the_same_bits(threads: int, num_seqs: int) -> None:
    gen = torch.Generator().manual_seed(7)
    seq_lens = [int(n) for n in torch.randint(1, 90, (num_seqs,), generator=gen)]
    kv = make_paged_kv(seq_lens, 3, 64, 16, torch.float32, generator=gen)
    q = strided_queries(len(seq_lens), 9, 64, torch.float32, gen).cpu()
    args = (q, kv.k_cache.cpu(), kv.v_cache.cpu(), kv.block_tables.cpu(), kv.seq_lens.cpu(), 0.125)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_decode_attention_cpu(*args)
        torch.set_num_threads(threads)
        many = paged_decode_attention_cpu(*args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)  # a query head's arithmetic never depends on how the work is split
    torch.testing.assert_close(many, paged_decode_attention_ref(*args), atol=2e-6, rtol=1e-5)


def small_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([20, 5], 1, 16, 8, torch.float32, generator=gen)
    q = strided_queries(2, 2, 16, torch.float32, gen).cpu()
    return q, kv.k_cache.cpu(), kv.v_cache.cpu(), kv.block_tables.cpu(), kv.seq_lens.cpu()


def test_a_block_outside_the_cache_is_refused_before_it_is_read() -> None:
    q, k_cache, v_cache, tables, lens = small_case()
    for bad in (k_cache.shape[0], -1, 2**31 - 1):
        tables_bad = tables.clone()
        tables_bad[1, 0] = bad
        with pytest.raises(ValueError, match="block outside the cache"):
            paged_decode_attention_cpu(q, k_cache, v_cache, tables_bad, lens, 1.0)


def test_a_length_past_the_block_table_is_refused() -> None:
    q, k_cache, v_cache, tables, lens = small_case()
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * k_cache.shape[1] + 1
    with pytest.raises(ValueError, match="longer than its block table"):
        paged_decode_attention_cpu(q, k_cache, v_cache, tables, too_long, 1.0)
    with pytest.raises(ValueError, match="negative"):
        paged_decode_attention_cpu(q, k_cache, v_cache, tables, -lens, 1.0)


def test_inputs_it_cannot_read_are_refused() -> None:
    q, k_cache, v_cache, tables, lens = small_case()
    with pytest.raises(ValueError, match="fp32"):
        paged_decode_attention_cpu(q.half(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        paged_decode_attention_cpu(q, k_cache.half(), v_cache.half(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):  # K and V interleaved in one tensor
        paged_decode_attention_cpu(q, k_cache[::2], v_cache[::2], tables, lens, 1.0)
    with pytest.raises(ValueError, match="heads must be contiguous"):
        paged_decode_attention_cpu(q.transpose(0, 1).contiguous().transpose(0, 1), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        paged_decode_attention_cpu(torch.randn(2, 2, 8), k_cache, v_cache, tables, lens, 1.0)


def test_without_a_compiler_the_cpu_backend_says_why() -> None:
    code = """
        from pagedserve import kernels
        print(kernels.cpu_unavailable_reason())
        try:
            kernels.get_backend("cpu")
        except RuntimeError as error:
            print(error)
        else:
            raise SystemExit("get_backend('cpu') did not raise")
    """
    result = run_python(code, {"PATH": "/nonexistent", "CC": None})
    assert result.returncode == 0, result.stderr
    assert "no C compiler" in result.stdout and "use get_backend('torch')" in result.stdout


def test_the_executor_takes_it_on_the_cpu_in_fp32_and_bf16() -> None:
    from pagedserve.services.executor.engine_config import backend_name

    cpu = torch.device("cpu")
    assert backend_name(cpu, torch.float32) == "cpu"
    assert backend_name(cpu, torch.bfloat16) == "cpu"
    assert backend_name(cpu, torch.float16) == "torch"  # the C kernels read fp32 or bf16 only
    assert backend_name(torch.device("cuda"), torch.bfloat16) == "triton"


def test_a_kernel_backend_asked_for_is_checked_against_the_device_and_dtype() -> None:
    from pagedserve.services.executor.engine_config import check_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert check_backend(None, cpu, torch.float32) is None  # then the default decides
    assert check_backend("torch", cpu, torch.float32) == "torch"
    assert check_backend("cpu", cpu, torch.float32) == "cpu"
    assert check_backend("cpu", cpu, torch.bfloat16) == "cpu"
    with pytest.raises(ValueError, match="float32 or bfloat16 on the CPU"):
        check_backend("cpu", cpu, torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16 on the CPU"):
        check_backend("cpu", cuda, torch.float32)
    with pytest.raises(ValueError, match="CUDA device"):
        check_backend("triton", cpu, torch.float32)


def test_the_executor_flag_round_trips_through_its_argv() -> None:
    import argparse

    from pagedserve.services.executor.options import ExecutorConfig, add_executor_arguments

    parser = argparse.ArgumentParser()
    add_executor_arguments(parser)
    for backend in (None, "torch", "cpu"):
        config = ExecutorConfig(kernel_backend=backend, num_threads=1)
        assert ExecutorConfig.from_args(parser.parse_args(config.to_argv())) == config
    with pytest.raises(SystemExit):
        parser.parse_args(["--kernel-backend", "cuda"])


def test_a_temporary_directory_mounted_noexec_is_a_reason_not_a_crash() -> None:
    # A stand-in for the fault (mounting a noexec tmpfs needs privileges a test must not use): dlopen of the
    # built library fails as it does on a hardened pod's noexec /tmp.
    code = """
        import ctypes
        import torch  # loads its own libraries through ctypes first
        def refuse(path, *args, **kwargs):
            raise OSError(f"{path}: failed to map segment from shared object")
        ctypes.CDLL = refuse
        from pagedserve import kernels
        print(kernels.cpu_unavailable_reason())
    """
    result = run_python(code, {})
    assert result.returncode == 0, result.stderr
    assert "could not build and load the CPU kernels" in result.stdout
    assert "failed to map segment" in result.stdout


def test_a_nan_query_gives_nan_as_the_torch_path_does_and_touches_no_other_sequence() -> None:
    q, k_cache, v_cache, tables, lens = small_case()
    q = q.clone()
    q[0, 1, 3] = float("nan")  # a diverged model: its attention must show it, not turn it into numbers
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, 1.0)
    reference = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 1.0)
    assert torch.isnan(out[0, 1]).all() and torch.isnan(reference[0, 1]).all()
    torch.testing.assert_close(out[0, 0], reference[0, 0])
    torch.testing.assert_close(out[1], reference[1])


LOADED_FROM = """
    from pagedserve.kernels.cpu_native import cpu_unavailable_reason
    assert cpu_unavailable_reason() is None, cpu_unavailable_reason()
    # the mapped file's path (a private build's ends "(deleted)": its directory went once it was loaded)
    print(next(line.split(maxsplit=5)[-1] for line in open("/proc/self/maps") if "kernels" in line and ".so" in line))
"""


def test_the_built_library_is_kept_and_loaded_again(tmp_path: Path) -> None:
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    abandoned, building = cache / ".building-old.so", cache / ".building-now.so"  # a killed build; one under way
    unused, recent = cache / "cpu_kernels-old.so", cache / "cpu_kernels-recent.so"  # built for other sources
    for path in (abandoned, building, unused, recent):
        path.write_bytes(b"a library, or half of one")
    os.utime(abandoned, (time.time() - 7200, time.time() - 7200))
    os.utime(unused, (time.time() - 31 * 86400, time.time() - 40 * 86400))  # last loaded 31 days ago
    os.utime(recent, (time.time() - 29 * 86400, time.time() - 40 * 86400))
    # built under a umask that lets the group write: the library must still be the user's alone, or it is refused
    first = run_python("import os; os.umask(0o002)\n" + textwrap.dedent(LOADED_FROM),
                       {"PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert first.returncode == 0, first.stderr
    (kept,) = set(cache.glob("cpu_kernels-*.so")) - {unused, recent}
    assert first.stdout.strip() == str(kept) and not kept.stat().st_mode & 0o022
    # the abandoned partial build and the library unused for a month are removed
    assert sorted(cache.iterdir()) == sorted([kept, building, recent])
    built_at = kept.stat().st_mtime_ns
    os.utime(kept, ns=(built_at - 10**9, built_at))
    second = run_python(LOADED_FROM, {"PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == str(kept) and kept.stat().st_mtime_ns == built_at  # loaded, not built again
    assert kept.stat().st_atime_ns > built_at  # and marked as used


def test_a_cache_others_can_write_to_is_not_used(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir(mode=0o700)
    (tmp_path / "kernels").chmod(0o777)
    result = run_python(LOADED_FROM, {"PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "pagedserve-kernel-" in result.stdout and not list((tmp_path / "kernels").iterdir())


def test_a_damaged_cached_library_is_built_again_elsewhere(tmp_path: Path) -> None:
    first = run_python(LOADED_FROM, {"PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    kept = Path(first.stdout.strip())
    kept.write_bytes(b"not a library")
    result = run_python(LOADED_FROM, {"PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "pagedserve-kernel-" in result.stdout  # the kernels still load, from a private build


def test_the_build_key_names_the_cpu_the_flags_and_the_sources(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    from pagedserve.kernels import cpu_native

    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    key = cpu_native.build_key(compiler)
    assert cpu_native.build_key(compiler) == key
    with monkeypatch.context() as patch:
        patch.setattr(cpu_native, "_cpu_identity", lambda: "[('flags', 'sse2 avx512f')]")
        assert cpu_native.build_key(compiler) != key
    with monkeypatch.context() as patch:
        patch.setattr(cpu_native, "CFLAGS", (*cpu_native.CFLAGS, "-DNDEBUG"))
        assert cpu_native.build_key(compiler) != key
    changed = tmp_path / "cpu_math.h"
    changed.write_text(cpu_native.HEADERS[0].read_text() + "\n/* changed */\n")
    with monkeypatch.context() as patch:
        patch.setattr(cpu_native, "HEADERS", (changed,))
        assert cpu_native.build_key(compiler) != key
