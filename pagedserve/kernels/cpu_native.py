"""The CPU's kernels in C, built at first use and called through ctypes: decode and prefill attention
(`paged_attention_cpu.c`), a layer's per-token ops in fp32 and bf16 (`cpu_layer_ops.c`, wrapped in
cpu_layer_ops.py), the logits' normalizer (`cpu_logits.c`, wrapped in logits_ops.py) and the fp32 matmul over
packed weights (`cpu_gemm.c`, wrapped in linear_ops.py). The bf16 kernels widen and
round with integer shifts, so they run on any x86-64 (an AVX2 CPU too); the matmuls' bf16 path is linear_ops.py's.

The sources are compiled on the machine that runs them (`-march=native`: the AVX2 or AVX-512 of this CPU)
into one library, ~2 s of gcc on a 2-core machine. The library is kept in the user's cache directory
(`$PAGEDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedserve` or `~/.cache/pagedserve`; in a pod, the emptyDir
that is its HOME, so a restarted container skips the build) under a name that is the digest of everything the
build depends on: the sources and headers, the flags, the compiler binary, and this CPU's vendor, model and
flags, so a build is never loaded on a CPU or from sources it was not made for. The directory must be the
user's own and writable by no one else (a library loaded from it runs as this process); where it is not, or
cannot be written, the library is built in a private temporary directory removed once loaded.

Its OpenMP loops run on torch's own OpenMP runtime (the same `libgomp.so.1`, already loaded by torch), with as
many threads as `torch.get_num_threads()` gives on the calling thread: what torch's own ops use there (an OpenMP
thread count is per thread). Where that cannot be arranged, or no C compiler is found, `cpu_unavailable_reason`
says why and the executor keeps the torch path.

Decode attention against the torch path at 64 sequences of ~80 tokens (SmolLM2-135M's 9 query / 3 KV heads
of 64, caches cold): 1.58 -> 0.61 ms per layer on one thread, 0.88 -> 0.44 on two (docs/kernels.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ._common import CacheShape, check_block_tables, check_kv_cache

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention_cpu.c", "cpu_layer_ops.c",
                                                                   "cpu_logits.c", "cpu_gemm.c"))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# -fno-trapping-math: the kernels never read floating-point exception flags, and without it gcc vectorizes
# no loop that selects between values (exp's clamp, SiLU's two halves) unless the CPU has AVX-512's masks:
# on an AVX2 machine SiLU * up and the softmax's exp ran one element at a time (2.3x slower than torch's).
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120
ERRORS = {  # the kernel's return codes
    1: "a block table names a block outside the cache",
    2: "a sequence length is negative or longer than its block table",
    3: "the kernel could not allocate its scratch memory",
    4: "slot_mapping names a slot past the cache",
}
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {  # each function's return and argument types
    "paged_decode_attention_f32": (
        ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _F32,
                       _I64]),
    "paged_prefill_attention_f32": (
        ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                       _F32, _I64]),
    "rms_norm_f32": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _I64]),
    "add_rms_norm_f32": (None, [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _I64]),
    "rotary_f32": (None, [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]),
    "silu_and_mul_f32": (None, [_PTR, _I64, _PTR, _I64, _I64, _I64]),
    "cache_write_f32": (ctypes.c_int, [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64]),
    "first_max_and_log_sum_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64]),
    "decode_attention_layer_f32": (
        ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64,
                       _I64, _I64, _I64, _F32, _I64]),
    "gemm_panel_columns": (_I64, []),
    "gemm_pack_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64]),
    "gemm_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64]),
    "gemm_silu_mul_f32": (None, [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64]),
    # a bf16 model's (cpu_layer_ops.c's second half): the fp32 ones' arguments, bf16 tensors
    "rms_norm_bf16": (None, [_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _I64]),
    "add_rms_norm_bf16": (None, [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _I64]),
    "silu_and_mul_bf16": (None, [_PTR, _I64, _PTR, _I64, _I64, _I64]),
    "decode_attention_layer_bf16": (
        ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                       _I64, _I64, _I64, _F32, _I64]),
}


def cpu_unavailable_reason() -> str | None:
    """Why the native CPU kernel cannot run here, or None when it can."""
    library = _library()
    return library if isinstance(library, str) else None


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or why there is none."""
    if sys.platform != "linux":
        return f"built only on Linux, not {sys.platform}"
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return "torch does not run on OpenMP here, so the kernel's threads would not be torch's"
    compiler = _compiler()
    if compiler is None:
        return "no C compiler (cc, gcc, or $CC) on PATH"
    cache = _cache_dir()
    library = _load_cached(compiler, cache) if cache is not None else None
    if library is None:
        try:
            with tempfile.TemporaryDirectory(prefix="pagedserve-kernel-") as directory:
                target = Path(directory) / "pagedserve_cpu_kernels.so"
                error = _compile(compiler, target)
                if error is not None:
                    return error
                library = ctypes.CDLL(str(target))  # mapped: the file may go with its directory
        except OSError as error:  # no writable temporary directory, or one mounted noexec
            return f"could not build and load the CPU kernels in {tempfile.gettempdir()}: {error}"
    if isinstance(library, str):
        return library
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:  # the library brought a second runtime: its threads would fight torch's
        return f"two OpenMP runtimes would be loaded: {', '.join(sorted(runtimes))}"
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compile(compiler: str, target: Path, sources: tuple[Path, ...] = SOURCES) -> str | None:
    """Builds the library at `target` (from `sources`: the kernels', or another build of them to compare); why it
    could not, or None."""
    try:
        subprocess.run([compiler, *CFLAGS, "-I", str(Path(__file__).parent), "-o", str(target), *map(str, sources),
                        "-lm"], check=True,
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        return f"{compiler} could not build the CPU kernels: {detail.strip()[-500:]}"
    return None


def _cache_dir() -> Path | None:
    """The directory built libraries are kept in, or None where there is no safe one: it must be this user's
    and writable by no one else, since what is loaded from it runs in this process."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve")
    directory = Path(root) / "kernels"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return directory if _private(directory) else None
    except OSError:
        return None


def _private(path: Path) -> bool:
    info = path.stat()
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def build_key(compiler: str) -> str:
    """The digest of everything a build depends on: sources, headers, flags, the compiler binary, and the CPU
    that `-march=native` builds for (its vendor, family, model and feature flags)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    binary = os.path.realpath(shutil.which(compiler) or compiler)
    info = os.stat(binary)
    digest.update(f"{CFLAGS}\0{binary}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
    digest.update(_cpu_identity().encode())
    return digest.hexdigest()


def _cpu_identity() -> str:
    wanted = ("vendor_id", "cpu family", "model", "model name", "flags")
    identity: dict[str, str] = {}
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if not line.strip():
                break  # the first processor's block: every core of a machine is the same model
            key, _, value = line.partition(":")
            if key.strip() in wanted:
                identity[key.strip()] = value.strip()
    return repr(sorted(identity.items()))


def _load_cached(compiler: str, cache: Path) -> ctypes.CDLL | str | None:
    """The library from the cache, built there first if it is not; None where the cache cannot be used."""
    try:
        target = cache / f"cpu_kernels-{build_key(compiler)[:32]}.so"
        if not target.exists():
            # built under a temporary name and renamed: a process that loads it never sees half a file; the
            # linker keeps that file's private mode (mkstemp's), whatever the umask
            handle, partial = tempfile.mkstemp(dir=cache, prefix=".building-", suffix=".so")
            os.close(handle)
            error = _compile(compiler, Path(partial))
            if error is not None:
                os.unlink(partial)
                return error
            os.replace(partial, target)
            _remove_stale(cache)
        if not _private(target):
            return None
        library = ctypes.CDLL(str(target))
        with contextlib.suppress(OSError):  # its access time says when it was last loaded (see _remove_stale)
            os.utime(target, ns=(time.time_ns(), target.stat().st_mtime_ns))
        return library
    except OSError:  # a full disk, a directory mounted noexec: build it the other way
        return None


def _remove_stale(cache: Path, partial_age_s: float = 3600.0, unused_age_s: float = 30 * 86400.0) -> None:
    """Partial builds of processes killed while building (a build takes seconds, not an hour), and libraries
    no process has loaded for a month: those of older sources, compilers or CPUs pile up otherwise (each load
    sets its library's access time, whatever the mount's atime policy)."""
    now = time.time()
    stale = [(path, partial_age_s, "st_mtime") for path in cache.glob(".building-*.so")]
    stale += [(path, unused_age_s, "st_atime") for path in cache.glob("cpu_kernels-*.so")]
    for path, age_s, stamp in stale:
        with contextlib.suppress(OSError):  # another process may be removing it too
            if now - getattr(path.stat(), stamp) > age_s:
                path.unlink()  # a process that has it loaded keeps its mapping


def native_library() -> ctypes.CDLL:
    """The loaded library; RuntimeError with the reason where it cannot be built or loaded here."""
    library = _library()
    if isinstance(library, str):
        raise RuntimeError(f"kernel backend 'cpu' is unavailable: {library}")
    return library


def _openmp_runtimes() -> set[str]:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if line.count(" ") >= 5}
    return {p for p in paths if any(name in Path(p).name for name in ("libgomp", "libiomp", "libomp"))}


def check_fp32_cpu(**tensors: torch.Tensor) -> None:
    """The C kernels read fp32 CPU memory only: anything else is a ValueError naming the argument."""
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
            raise ValueError(f"{name} must be an fp32 CPU tensor, got {tensor.dtype} on {tensor.device}")


def check_cpu_activations(**tensors: torch.Tensor) -> torch.dtype:
    """The per-token C kernels' tensors: all fp32, or all bf16 (a bf16 model's), on the CPU; their dtype, or a
    ValueError naming the argument."""
    dtype = next(iter(tensors.values())).dtype
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or tensor.dtype not in CACHE_DTYPES or tensor.dtype != dtype:
            raise ValueError(f"{name} must be an fp32 or bf16 CPU tensor of the others' dtype ({dtype}), got "
                             f"{tensor.dtype} on {tensor.device}")
    return dtype


CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' `kv_bf16` argument for each cache dtype


def check_cpu_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[CacheShape, int]:
    """A layer's caches as the C kernels read them: check_kv_cache's shape, fp32 or bf16 on the CPU, contiguous.
    Their shape and the kernels' `kv_bf16` argument."""
    cache = check_kv_cache(k_cache, v_cache)
    if k_cache.device.type != "cpu" or k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"the caches must be fp32 or bf16 CPU tensors, got {k_cache.dtype} on {k_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    return cache, CACHE_DTYPES[k_cache.dtype]


def check_status(status: int) -> None:
    """A kernel's return code: 0, or a ValueError that says what it refused."""
    if status:
        raise ValueError(ERRORS.get(status, f"the kernel failed with code {status}"))


def library_from(source: Path, directory: Path, functions: tuple[str, ...] = ("paged_decode_attention_f32",)
                 ) -> ctypes.CDLL:
    """Another build of one kernel source (`source`, an edited copy, built as the kernels are, into `directory`),
    with its `functions`' signatures: `bench cpu-attention --ab-source` and `bench cpu-gemm --ab-source` compare
    it with the kernels' own build, in one process."""
    native_library()  # torch's OpenMP runtime first, and a compiler found (else this raises, with the reason)
    target = directory / "pagedserve_ab_kernel.so"
    error = _compile(_compiler() or "cc", target, (source,))
    if error is not None:
        raise RuntimeError(error)
    library = ctypes.CDLL(str(target))
    for name in functions:
        getattr(library, name).restype, getattr(library, name).argtypes = SIGNATURES[name]
    return library


def _check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor) -> tuple[CacheShape, int]:
    """What both attention kernels read, checked: the caches, the block tables against the lengths, an fp32 query
    whose rows hold their heads contiguous and fit the cache's heads. The caches' shape and `kv_bf16`."""
    num_heads, head_dim = q.shape[1:]
    cache, kv_bf16 = check_cpu_caches(k_cache, v_cache)
    check_block_tables(block_tables, seq_lens, seq_lens.shape[0])
    check_fp32_cpu(q=q)
    if q.stride(2) != 1 or (num_heads > 1 and q.stride(1) != head_dim):
        raise ValueError(f"each query row's heads must be contiguous, got strides {q.stride()}")
    if cache.head_dim != head_dim or cache.num_kv_heads == 0 or num_heads % cache.num_kv_heads:
        raise ValueError(f"{num_heads} query heads of {head_dim} do not fit a cache of {cache.num_kv_heads} x "
                         f"{cache.head_dim}")
    return cache, kv_bf16


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32 or bf16; each row's heads contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 or bf16, contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] the same
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    max_seq_len: int | None = None,  # unused: the kernel sizes its scratch from seq_lens itself
    library: ctypes.CDLL | None = None,  # another build of the kernel (library_from); default: the kernels' own
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] q's dtype
    """Decode attention in fp32 over a paged cache of fp32 or bf16 on the CPU (a bf16 cache's keys and values
    widened as read); a sequence of length 0 attends to nothing (0). A bf16 query (a bf16 model's) is widened and
    the result rounded back to bf16."""
    if q.dtype == torch.bfloat16:
        return paged_decode_attention_cpu(q.float(), k_cache, v_cache, block_tables, seq_lens, scale,
                                          library=library).bfloat16()
    library = library or native_library()
    num_seqs, num_heads, head_dim = q.shape
    cache, kv_bf16 = _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim)
    status = library.paged_decode_attention_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), kv_bf16, cache.num_blocks, cache.block_size,
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(), num_seqs, num_heads,
        cache.num_kv_heads, head_dim, scale, torch.get_num_threads(),
    )
    check_status(status)
    return out


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] fp32 or bf16; each row's heads contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32 or bf16, contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] the same
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32: sequence i's queries are q[cu[i]:cu[i + 1]]
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length after the chunk
    scale: float,
    *,
    max_query_len: int | None = None,  # unused: the kernel reads the chunks' lengths itself
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] q's dtype
    """Causal prefill attention in fp32 over a paged cache of fp32 or bf16 on the CPU: a query row's result is the
    same bits whichever chunk, batch or thread count computes it (paged_attention_cpu.c). Rows of q past
    cu_seqlens_q[-1] are left unwritten. A bf16 query is widened and the result rounded back to bf16."""
    if q.dtype == torch.bfloat16:
        return paged_prefill_attention_cpu(q.float(), k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                                           scale).bfloat16()
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    cache, kv_bf16 = _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (num_seqs + 1,) or cu_seqlens_q.device.type != "cpu":
        raise ValueError(f"cu_seqlens_q must be [{num_seqs + 1}] int32 on the CPU, got {tuple(cu_seqlens_q.shape)} "
                         f"{cu_seqlens_q.dtype}")
    cu = cu_seqlens_q.contiguous()
    if num_seqs and (int(cu[0]) != 0 or int(cu[-1]) > num_tokens):
        raise ValueError(f"cu_seqlens_q must start at 0 and end within the {num_tokens} query rows")
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim)
    status = native_library().paged_prefill_attention_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), kv_bf16, cache.num_blocks,
        cache.block_size, tables.data_ptr(), tables.shape[1], cu.data_ptr(), lens.data_ptr(), out.data_ptr(), num_seqs,
        num_heads, cache.num_kv_heads, head_dim, scale, torch.get_num_threads(),
    )
    check_status(status)
    return out
