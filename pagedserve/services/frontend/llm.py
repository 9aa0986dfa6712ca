"""Offline batch inference: `pagedserve.LLM(model).generate(prompts, params)`.

The same engine as the server (block-manager core, scheduler, model runner) without the public API: the
block manager runs in process; the model runs by default in an executor process of its own on a private
unix socket. In process (`executor="thread"`) the engine's Python and the model's op dispatch share one
interpreter lock, and overlapped steps then cost the model up to a fifth of its speed on a CPU. There the model
loads and runs on a step thread of its own; torch run in parallel on another thread of the same process (the
caller's, say) gives libgomp a second thread pool, and with more pool threads than cores each of a step's
parallel regions waits for its workers to wake (a CPU decode step 10-15 % slower on two cores). Run such work
through `engine.executor.call` (the step thread), or keep the default executor process.
"""

from __future__ import annotations

import itertools
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..block_manager.manager import BlockManager
from ..common.cache_identity import CacheIdentity
from ..common.processes import ServiceProcess, start_service, stop_service
from ..executor.client import RemoteExecutor
from ..executor.model.registry import resolve_model
from ..executor.model.tokenizer import load_tokenizer, render_chat
from ..executor.options import ExecutorConfig
from ..executor.step_types import ExecutorInfo
from .engine import Engine, EngineLimits
from .ports import ExecutorPort, LocalBlockManager, LocalExecutor
from .request import FinishReason, GenerationParams, Request
from .scheduler import Scheduler, SchedulerConfig, shares_kv

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: str
    logprobs: list[float]  # of each generated token


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    num_preemptions: int


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: str | None = None,
        device: str | None = None,
        block_size: int = 16,
        kv_cache_mib: int = 512,
        num_blocks: int | None = None,
        cpu_swap_mib: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        preemption_mode: Literal["recompute", "swap"] = "recompute",
        overlap: bool = True,
        executor: Literal["process", "thread"] = "process",
        threads: int = 0,
        kv_layout: Literal["paged", "virtual", "static"] = "paged",
        kernel_backend: Literal["triton", "cpu", "torch"] | None = None,
        kv_cache_dtype: Literal["auto", "bfloat16"] = "auto",
    ) -> None:
        """`threads`: the model's torch CPU threads (0: torch's default, all physical cores). `kv_layout`: paged
        blocks, or a region per sequence (virtual; static) that shares nothing (docs/layouts.md). `kernel_backend`:
        as the executor's `--kernel-backend` (default: triton on a GPU, else the C decode attention where it
        builds). `kv_cache_dtype`: as `--kv-cache-dtype` (bfloat16: a bf16 cache under fp32 weights on the CPU)."""
        config = ExecutorConfig(
            model=model, dtype=dtype, device=device, block_size=block_size, kv_cache_bytes=kv_cache_mib << 20,
            num_blocks=num_blocks, cpu_swap_bytes=cpu_swap_mib << 20, max_model_len=max_model_len,
            num_threads=threads, kv_layout=kv_layout, kernel_backend=kernel_backend, kv_cache_dtype=kv_cache_dtype,
        )
        self.executor_process: ServiceProcess | None = None
        self._close: Callable[[], object] = lambda: None
        port, info = self._start_executor(config) if executor == "process" else self._load_runner(config)
        source = resolve_model(model)
        self.tokenizer = load_tokenizer(source)
        self.info = info
        self.block_manager = BlockManager(info.num_blocks, info.block_size, info.num_cpu_blocks)
        scheduler = Scheduler(
            SchedulerConfig(info.block_size, info.max_model_len, max_num_seqs, max_num_batched_tokens, preemption_mode,
                            shares_kv(info.kv_layout)),
            LocalBlockManager(self.block_manager),
        )
        eos = frozenset(info.eos_token_ids) | ({self.tokenizer.eos_token_id} - {None})
        limits = EngineLimits(info.vocab_size, info.max_model_len, info.num_blocks, info.block_size, eos)
        identity = CacheIdentity(info.model_digest, self.tokenizer.name_or_path or source.name,
                                 self.tokenizer.chat_template or "", info.cache_dtype, info.block_size)
        self.engine = Engine(scheduler, port, limits, identity, overlap)
        self._ids = itertools.count()

    def _start_executor(self, config: ExecutorConfig) -> tuple[ExecutorPort, ExecutorInfo]:
        run_dir = tempfile.mkdtemp(prefix="pagedserve-llm-")  # private (0700): the socket is ours alone
        child = start_service(["executor", *config.to_argv()], listen=f"unix:{run_dir}/executor.sock", timeout=1800)
        remote = RemoteExecutor(child.address)
        self.executor_process = child
        self._close = weakref.finalize(self, _stop_executor, remote, child, run_dir)  # also at interpreter exit
        return remote, remote.info()

    def _load_runner(self, config: ExecutorConfig) -> tuple[ExecutorPort, ExecutorInfo]:
        from ..executor.engine_config import build_runner  # torch, in this process

        return LocalExecutor.load(lambda: build_runner(config))  # on the step thread: one OpenMP pool

    def close(self) -> None:
        """Stops the executor process (if any); the LLM is unusable after."""
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: GenerationParams | None = None, *, progress: bool = True
    ) -> list[Completion]:
        """Completes each prompt (text, or token ids); results in the prompts' order."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item, arg-type]
        token_lists = [self._encode(p) for p in batch]
        return self._run(token_lists, params or GenerationParams(), progress)

    def chat(
        self, conversations: Sequence[Sequence[dict[str, str]]], params: GenerationParams | None = None,
        *, progress: bool = True,
    ) -> list[Completion]:
        """Completes each conversation rendered with the model's chat template."""
        token_lists = [render_chat(self.tokenizer, list(c)) for c in conversations]
        return self._run(token_lists, params or GenerationParams(), progress)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def _run(self, token_lists: list[list[int]], params: GenerationParams, progress: bool) -> list[Completion]:
        requests: list[Request] = []
        for tokens in token_lists:
            requests.append(self.engine.add_request(f"offline-{next(self._ids)}", tokens, params, final_only=True))
        start, generated, done = time.monotonic(), 0, 0
        before = self.engine.num_generated  # of earlier calls
        show = progress and sys.stderr.isatty()  # a live progress line, for people watching a terminal
        while self.engine.has_work:
            done += sum(output.request.finished for output in self.engine.step())  # final only: at their ends
            generated = self.engine.num_generated - before
            if show:
                rate = generated / max(time.monotonic() - start, 1e-9)
                print(f"\r{done}/{len(requests)} requests, {generated} tokens, {rate:.1f} tok/s", end="",
                      file=sys.stderr, flush=True)
        if show:
            print(file=sys.stderr)
        return [self._completion(r) for r in requests]

    def _completion(self, request: Request) -> Completion:
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            ids = seq.output_token_ids
            reason = (seq.finish_reason or FinishReason.ABORT).value
            text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
            outputs.append(CompletionOutput(seq.index, text, ids, reason, list(seq.logprobs)))
        return Completion(list(request.prompt_token_ids), outputs, request.num_cached_tokens, request.num_preemptions)

    def stats(self) -> dict[str, Any]:
        return vars(self.block_manager.stats())


def _stop_executor(remote: RemoteExecutor, child: ServiceProcess, run_dir: str) -> None:
    remote.close()
    stop_service(child)
    shutil.rmtree(run_dir, ignore_errors=True)
