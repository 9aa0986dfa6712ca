"""The engine: admission checks, then the scheduler and the executor, one step per call.

Overlapped (the default): the executor always has the next step queued behind the one it runs. Each call
plans step N+2 and sends its block-manager call, collects step N's tokens while the block manager works,
then applies the answer (leaving out what finished in N) and sends N+2 behind N+1; a call whose answer shapes
no row of N+2 (spares, catch-ups, frees) is not even waited for: the scheduler applies it at its next plan. So
neither the block manager's round trip nor the frontend's bookkeeping waits on the accelerator, or it on them;
tokens reach the caller one step later, and a sequence that stops costs one extra computed token (N+1's).
Serial (`overlap=False`): plan, run, wait, in lock step.
It is synchronous: the offline `LLM` calls it in a loop; the server runs it on its own thread.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass
from typing import Any

from ..block_manager.contract import BlockStats
from ..common.cache_identity import CacheIdentity
from ..common.errors import ExceedsCapacity, InvalidRequest
from ..common.kv_geometry import blocks_for
from .ports import ExecutorPort, RunningStep
from .request import GenerationParams, Request, StepOutput
from .scheduler import PlannedStep, ScheduledStep, Scheduler


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: frozenset[int]
    max_n: int = 16


class Engine:
    def __init__(self, scheduler: Scheduler, executor: ExecutorPort, limits: EngineLimits, identity: CacheIdentity,
                 overlap: bool = True):
        """`identity`: what roots the cache namespace of every request (a router computes it alike: it reads the
        pod's identity from ListModels)."""
        if identity.block_size != limits.block_size:
            raise ValueError(f"identity.block_size {identity.block_size} != limits.block_size {limits.block_size}")
        self.scheduler, self.executor, self.limits, self.identity = scheduler, executor, limits, identity
        self.overlap = overlap
        self.in_flight: list[tuple[ScheduledStep, RunningStep]] = []  # sent, not answered: oldest first
        self.undelivered: list[StepOutput] = []  # collected by a step that then failed (see take_undelivered)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: GenerationParams, tenant_salt: bytes = b"",
        final_only: bool = False,
    ) -> Request:
        """Validates and queues a request; raises InvalidRequest or OutOfCapacity naming the limit."""
        self.check(prompt_token_ids, params)
        return self.enqueue(request_id, prompt_token_ids, params, tenant_salt, final_only)

    def enqueue(
        self, request_id: str, prompt_token_ids: list[int], params: GenerationParams, tenant_salt: bytes = b"",
        final_only: bool = False,
    ) -> Request:
        """Queues a request that already passed `check` (the server checks in its API thread). A `final_only`
        request's caller reads its outputs from it at the end (`Request.final_only`)."""
        if self.scheduler.request(request_id) is not None:
            raise InvalidRequest(f"request_id: {request_id!r} is already running")
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        request = Request(request_id, list(prompt_token_ids), params, self.identity.namespace(tenant_salt), seed,
                          self.limits.eos_token_ids, final_only=final_only)
        self.scheduler.add(request)
        return request

    def check(self, prompt_token_ids: list[int], params: GenerationParams) -> None:
        params.validate(self.limits.max_n)
        limits = self.limits
        if not prompt_token_ids:
            raise InvalidRequest("prompt: must not be empty")
        bad = next((t for t in prompt_token_ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt: token id {bad} outside the vocabulary [0, {limits.vocab_size})")
        total = len(prompt_token_ids) + params.max_tokens
        if len(prompt_token_ids) >= limits.max_model_len:
            raise InvalidRequest(f"prompt: {len(prompt_token_ids)} tokens exceed the context of {limits.max_model_len}")
        if total > limits.max_model_len:
            raise InvalidRequest(
                f"max_tokens: prompt ({len(prompt_token_ids)}) + max_tokens ({params.max_tokens}) exceeds the"
                f" context of {limits.max_model_len} tokens"
            )
        bs = limits.block_size
        # the prompt's blocks are shared by the n samples; each sample's own tail and output are not
        blocks = len(prompt_token_ids) // bs + params.n * blocks_for(len(prompt_token_ids) % bs + params.max_tokens, bs)
        if blocks > limits.num_blocks:
            raise ExceedsCapacity(
                f"the request needs up to {blocks} KV blocks of {bs} tokens; the cache holds {limits.num_blocks}"
            )

    def step(self) -> list[StepOutput]:
        """Sends the next step (if there is one); returns the outputs of the oldest step in flight that was
        collected (with overlap, two steps stay in flight). On an error, every step in flight is waited for
        before it propagates."""
        planned: PlannedStep | None = None
        outputs: list[StepOutput] = []
        collected = False
        try:
            planned = self.scheduler.plan()
            if self.overlap and len(self.in_flight) >= 2:  # N+1 stays queued while N is collected
                outputs, collected = self._collect_oldest(), True
            scheduled = self.scheduler.apply(planned) if planned is not None else None
            planned = None
            if scheduled is not None:
                self.in_flight.append((scheduled, self.executor.submit(scheduled.step_input)))
            if not collected and self.in_flight and (not self.overlap or scheduled is None):
                outputs = self._collect_oldest()  # lock step, or nothing new to send: wait for the oldest
        except BaseException:
            if planned is not None:  # answered or not, the call is over before anything else is sent
                with contextlib.suppress(Exception):
                    planned.answer.result()
            self.undelivered += outputs  # recorded tokens: their callers get them even though the step failed
            self.drain()
            raise
        if not self.has_work:
            self.scheduler.flush()  # the last finished sequences release their blocks now, not next time
        return outputs

    def take_undelivered(self) -> list[StepOutput]:
        """The outputs of a step collected before a later part of the same call failed (the block manager's
        answer): the scheduler has recorded their tokens, so the callers must get them too."""
        outputs, self.undelivered = self.undelivered, []
        return outputs

    def drain(self) -> None:
        """Waits for every step in flight and forgets them (after a failure: their results are void)."""
        in_flight, self.in_flight = self.in_flight, []
        for _, running in in_flight:
            with contextlib.suppress(Exception):
                running.result()

    def abort(self, request_id: str) -> StepOutput | None:
        output = self.scheduler.abort(request_id)
        self.scheduler.flush()
        while self.in_flight and not self.scheduler.has_work:  # only void tokens can come back: collect them
            self._collect_oldest()
        return output

    def finish_sample(self, request_id: str, index: int) -> Request | None:
        """Ends sample `index` of the request (a stop string ended it) and frees its blocks now; returns the
        request, if it was still in the engine."""
        request = self.scheduler.finish_sample(request_id, index)
        if request is not None:
            self.scheduler.flush()
        return request

    def restart(self) -> None:
        """Starts over after a lost sidecar: the steps in flight are void (waited for, never seen), and every
        request waits to be recomputed from the tokens it has (`Scheduler.restart`)."""
        self.drain()
        self.scheduler.restart()

    def resume(self, stats: BlockStats) -> None:
        """The sidecars answer again, both reset (the block manager's statistics): the requests resume."""
        self.scheduler.resume(stats)

    def reset_block_manager(self) -> None:
        """Empties the block manager after a failed step (the prefix cache may point at KV never written)."""
        self.scheduler.reset_block_manager()

    def request(self, request_id: str) -> Request | None:
        return self.scheduler.request(request_id)

    def request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def num_waiting_requests(self) -> int:
        """Requests with a sequence waiting for admission: new ones, and preempted ones to be recomputed."""
        return self.scheduler.num_waiting_requests()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_generated(self) -> int:
        """Tokens recorded, ever (a final-only request has no output per step to count them from)."""
        return self.scheduler.num_generated

    def status(self) -> dict[str, Any]:
        """The scheduler's queues, the block statistics, the preemptions so far and the KV cache's dtype."""
        return {**self.scheduler.status(), "kv_cache_dtype": self.identity.kv_dtype}

    def _collect_oldest(self) -> list[StepOutput]:
        done, running = self.in_flight.pop(0)
        return self.scheduler.update(done, running.result())

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.in_flight)
