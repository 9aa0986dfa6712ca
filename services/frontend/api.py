"""The public gRPC API (`service Inference`): requests in, streamed tokens and text out.

Text work happens here, on the event loop: tokenizing, the chat template, streaming detokenization and
stop strings. Scheduling happens on the engine thread (engine_loop.py). A request whose client goes
away, or whose deadline passes, is aborted in the `finally` of its handler: its blocks are freed at once.
Who is calling (auth.py) decides the cache namespace and whose stream count (limits.py) a request takes.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc.aio
from opentelemetry import trace
from transformers import PreTrainedTokenizerFast

from ...protos import inference_pb2 as pb
from ...protos import inference_pb2_grpc as pb_grpc
from ..common.errors import InvalidRequest, NotReady, Unauthenticated
from ..executor.model.tokenizer import render_chat
from ..executor.step_types import ExecutorInfo
from .auth import UNAUTHENTICATED, ApiKeys, Metadata, client_salt, presented_key, tenant_salt
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .engine_loop import EngineLoop
from .limits import DEFAULT_MAX_TOKENS, ApiLimits, StreamCounter
from .metrics import latency
from .request import FinishReason, GenerationParams, Request, SequenceOutput

FINISH = {FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH, FinishReason.ABORT: pb.ABORT}


@dataclass
class _Sample:
    """The text side of one of a request's samples."""

    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    text_at_end: bool = False  # a unary call without stop strings: its text is decoded once, at the end
    done: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED


@dataclass(frozen=True)
class Backend:
    """What the API needs once the stack is up."""

    loop: EngineLoop
    tokenizer: PreTrainedTokenizerFast
    info: ExecutorInfo


class InferenceServicer(pb_grpc.InferenceServicer):
    """Registered before the server starts (gRPC requires it); answers UNAVAILABLE until `attach`. With
    `keys`, generation needs a listed key on any listener (the public one's interceptor guards the rest)."""

    def __init__(self, keys: ApiKeys | None = None, limits: ApiLimits | None = None) -> None:
        self._backend: Backend | None = None
        self._tenant_secret = secrets.token_bytes(32)
        self.keys = keys
        self.limits = limits or ApiLimits()
        self.streams = StreamCounter(self.limits.max_streams_per_tenant)

    def attach(self, backend: Backend) -> None:
        self._backend = backend

    @property
    def ready(self) -> bool:
        return self._backend is not None

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise NotReady("the model is still loading")
        return self._backend

    @property
    def loop(self) -> EngineLoop:
        return self.backend.loop

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        return self.backend.tokenizer

    @property
    def info(self) -> ExecutorInfo:
        return self.backend.info

    # ---- Generate and Complete -----------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        with self._stream(context) as salt:
            async for message in self._generate(request, salt):
                yield message

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        choices: dict[int, pb.Completion] = {}
        response = pb.CompleteResponse()
        with self._stream(context) as salt:
            async for chunk in self._generate(request, salt, unary=True):
                response.request_id = chunk.request_id
                choice = choices.setdefault(chunk.index, pb.Completion(index=chunk.index))
                choice.text += chunk.text
                choice.token_ids.extend(chunk.token_ids)
                choice.logprobs.extend(chunk.logprobs)
                if chunk.finish_reason:
                    choice.finish_reason = chunk.finish_reason
                if chunk.HasField("usage"):
                    response.usage.CopyFrom(chunk.usage)
        response.choices.extend(choices[i] for i in sorted(choices))
        return response

    @contextmanager
    def _stream(self, context: grpc.aio.ServicerContext) -> Iterator[bytes]:
        """Holds one of the caller's streams (limits.py) for the call, however it ends; gives its cache salt."""
        metadata = context.invocation_metadata()
        tenant = self._tenant(metadata)
        with self.streams.hold(tenant):
            yield tenant_salt(self._tenant_secret, tenant, client_salt(metadata))

    async def _generate(
        self, request: pb.GenerateRequest, salt: bytes, unary: bool = False
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The request's chunks as they come; for a unary call without stop strings (nothing to match while
        the text grows), one chunk per sample at the end, read from the finished request."""
        if request.model and request.model != self.info.model:
            raise InvalidRequest(f"model: {request.model!r} is not served here; this pod serves {self.info.model!r}")
        prompt = self._prompt(request)
        params = generation_params(request.params, self.limits.max_n, self.limits.default_max_tokens)
        self.limits.check(len(prompt), params)
        stop = list(request.params.stop)
        at_end = unary and not stop
        samples = [self._sample(prompt, stop, text_at_end=at_end) for _ in range(params.n)]
        want_logprobs = request.params.HasField("logprobs")
        request_id = uuid.uuid4().hex
        span = trace.get_current_span()  # the call's server span (a no-op one when tracing is off)
        span.set_attributes({"pagedserve.request_id": request_id, "gen_ai.usage.input_tokens": len(prompt),
                             "gen_ai.request.max_tokens": params.max_tokens})
        events = self.loop.submit(request_id, prompt, params, salt, final_only=at_end)
        engine_request: Request | None = None
        over = False
        try:
            # the engine ends every request's stream with None, after which it no longer touches the request
            while (event := await events.get()) is not None:
                if isinstance(event, BaseException):
                    raise event
                if engine_request is None and not at_end:
                    span.add_event("first_token")
                engine_request = event.request
                for output in [] if at_end else event.outputs:
                    chunk = self._chunk(request_id, samples, output, want_logprobs)
                    if chunk is not None:
                        yield chunk
            over = True
            if at_end and engine_request is not None:  # the engine no longer touches it
                for seq in sorted(engine_request.seqs, key=lambda s: s.index):
                    whole = SequenceOutput(seq.seq_id, seq.index, seq.output_token_ids, seq.finish_reason,
                                           seq.logprobs, seq.top_logprobs)
                    chunk = self._chunk(request_id, samples, whole, want_logprobs)
                    if chunk is not None:
                        yield chunk
            usage = self._usage(engine_request, prompt, samples)
            span.set_attributes({
                "gen_ai.usage.output_tokens": usage.completion_tokens, "pagedserve.ttft_ms": usage.ttft_ms,
                "pagedserve.cached_prompt_tokens": usage.cached_prompt_tokens,
                "pagedserve.num_preemptions": usage.num_preemptions,
            })
            yield pb.GenerateResponse(request_id=request_id, usage=usage)
        finally:
            if not over:  # the client went away, the deadline passed, or the engine failed
                self.loop.abort(request_id)

    def _sample(self, prompt: list[int], stop: list[str], text_at_end: bool) -> _Sample:
        return _Sample(IncrementalDetokenizer(self.tokenizer, prompt), StopStringMatcher(stop), text_at_end)

    def _chunk(
        self, request_id: str, samples: list[_Sample], output: SequenceOutput, want_logprobs: bool
    ) -> pb.GenerateResponse | None:
        sample = samples[output.index]
        if sample.done:  # a stop string ended it; the engine may have produced one more token meanwhile
            return None
        if sample.text_at_end:  # one decode of the whole output instead of two per token (the same text)
            text, stopped = "", False
            if output.finish_reason is not None:
                ids = [*sample.token_ids, *output.new_token_ids]
                text = sample.detokenizer.add(ids) + sample.detokenizer.flush()
        else:
            text, stopped = sample.stop.feed(sample.detokenizer.add(output.new_token_ids))
        finish = pb.STOP if stopped else pb.FINISH_REASON_UNSPECIFIED
        if output.finish_reason is not None and not stopped:
            finish = FINISH[output.finish_reason]
        if finish and not stopped and not sample.text_at_end:  # the end of the stream: release what was held back
            text += sample.stop.feed(sample.detokenizer.flush())[0] + sample.stop.flush()
        if stopped and output.finish_reason is None:
            self.loop.finish_sample(request_id, output.index)
        logprobs = [
            pb.TokenLogprob(token_id=t, logprob=lp, top_token_ids=[i for i, _ in top], top_logprobs=[v for _, v in top])
            for t, lp, top in zip(output.new_token_ids, output.new_logprobs, output.new_top_logprobs, strict=True)
        ] if want_logprobs else []
        sample.done = bool(finish)
        sample.token_ids.extend(output.new_token_ids)
        sample.finish_reason = finish
        return pb.GenerateResponse(request_id=request_id, index=output.index, token_ids=output.new_token_ids,
                                   text=text, logprobs=logprobs, finish_reason=finish)

    def _usage(self, request: Request | None, prompt: list[int], samples: list[_Sample]) -> pb.Usage:
        usage = pb.Usage(prompt_tokens=len(prompt), completion_tokens=sum(len(s.token_ids) for s in samples))
        if request is not None:
            lat = latency(request.metrics, usage.completion_tokens)
            usage.cached_prompt_tokens = request.num_cached_tokens
            usage.num_preemptions = request.num_preemptions
            usage.queue_ms, usage.ttft_ms, usage.e2e_ms = lat.queue_ms, lat.ttft_ms, lat.e2e_ms
        return usage

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return list(self.tokenizer.encode(request.text, add_special_tokens=False))
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            return self._chat(request.chat)
        raise InvalidRequest("prompt: set one of text, token_ids or chat")

    def _chat(self, chat: pb.Chat) -> list[int]:
        if not chat.messages:
            raise InvalidRequest("chat.messages: must not be empty")
        if self.tokenizer.chat_template is None:
            raise InvalidRequest("chat: this model has no chat template; send text or token_ids")
        for i, message in enumerate(chat.messages):
            if message.role not in ("system", "user", "assistant"):
                raise InvalidRequest(f"chat.messages[{i}].role: {message.role!r} is not system, user or assistant")
        return render_chat(self.tokenizer, [{"role": m.role, "content": m.content} for m in chat.messages])

    def _tenant(self, metadata: Metadata) -> str:
        """The tenant as the server knows it: the name the keys file gives the caller's key. Without a keys
        file (a trusted network) the key the client sends is taken as its tenant, unchecked."""
        key = presented_key(metadata)
        if self.keys is None:
            return key
        tenant = self.keys.tenant_for(key)
        if tenant is None:  # a listener without the interceptor (the local one) still guards generation
            raise Unauthenticated(UNAUTHENTICATED)
        return tenant

    # ---- the rest ------------------------------------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind == "text":
            return pb.TokenizeResponse(token_ids=self.tokenizer.encode(request.text, add_special_tokens=False))
        if kind == "chat":
            return pb.TokenizeResponse(token_ids=self._chat(request.chat))
        raise InvalidRequest("input: set one of text or chat")

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        i = self.info
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            name=i.model, digest=i.model_digest, max_model_len=i.max_model_len, vocab_size=i.vocab_size,
            block_size=i.block_size, num_blocks=i.num_blocks, dtype=i.dtype, device=i.device,
        )])

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        status = self.loop.status
        stats = status["stats"]
        return pb.StatusResponse(
            num_running=status["num_running"], num_waiting=status["num_waiting"], num_swapped=status["num_swapped"],
            num_used_blocks=stats.num_used_blocks, num_cached_blocks=stats.num_cached_blocks,
            num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
            block_pressure=stats.block_pressure, kv_utilization=stats.kv_utilization,
            prefix_hit_rate=stats.prefix_hit_rate,
            num_preemptions_recompute=status["num_preemptions_recompute"],
            num_preemptions_swap=status["num_preemptions_swap"],
            num_requests_refused=status["num_refused"],
            **self.loop.metrics.snapshot(),  # type: ignore[arg-type]
        )


def generation_params(
    p: pb.GenerationParameters, max_n: int = 16, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> GenerationParams:
    """Proto parameters with their defaults; validated by the engine (InvalidRequest naming the field)."""
    params = GenerationParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else default_max_tokens,
        temperature=p.temperature if p.HasField("temperature") else 0.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else 0,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        n=p.n if p.HasField("n") else 1,
        logprobs=p.logprobs if p.HasField("logprobs") else 0,
    )
    params.validate(max_n)
    return params
