"""The public gRPC API (`service Inference`): requests in, streamed tokens and text out.

What a request goes through (prompt, limits, engine, detokenization, stop strings, usage, abort when the
client goes away or its deadline passes) is shared with the HTTP API: generation.py. Here: the protobuf
messages, a unary `Complete` assembled from the same chunks, and the block manager's KV events relayed with the
pod's load (kv_relay.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc.aio
from transformers import PreTrainedTokenizerFast

from ...protos import inference_pb2 as pb
from ...protos import inference_pb2_grpc as pb_grpc
from ...protos import kv_events_pb2
from ..common.errors import InvalidRequest, NotReady
from ..common.kv_events_codec import cache_identity_to_proto
from ..executor.step_types import ExecutorInfo
from .auth import ApiKeys
from .engine_loop import EngineLoop
from .generation import Backend, Chunk, Serving, Usage
from .kv_relay import KvEventRelay
from .limits import DEFAULT_MAX_TOKENS, ApiLimits
from .request import FinishReason, GenerationParams

__all__ = ["Backend", "InferenceServicer", "generation_params"]

FINISH = {FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH, FinishReason.ABORT: pb.ABORT}


class InferenceServicer(pb_grpc.InferenceServicer):
    """Registered before the server starts (gRPC requires it); answers UNAVAILABLE until `attach`. With
    `keys`, generation needs a listed key on any listener (the public one's interceptor guards the rest).
    `serving`: the state shared with the HTTP API (one is made from `keys` and `limits` when not given).
    `kv_events`: the relay of the block manager's KV events (SubscribeKvEvents is UNAVAILABLE without one).
    `http_port`: the port of this process's HTTP API once it listens (ListModels tells a router; 0: none)."""

    def __init__(self, keys: ApiKeys | None = None, limits: ApiLimits | None = None,
                 serving: Serving | None = None, kv_events: KvEventRelay | None = None,
                 http_port: Callable[[], int] = lambda: 0) -> None:
        self.serving = serving or Serving(keys, limits)
        self.kv_events = kv_events
        self.http_port = http_port

    def attach(self, backend: Backend) -> None:
        self.serving.attach(backend)

    @property
    def ready(self) -> bool:
        return self.serving.ready

    @property
    def backend(self) -> Backend:
        return self.serving.backend

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
        with self.serving.hold(context.invocation_metadata()) as salt:
            yield salt

    async def _generate(
        self, request: pb.GenerateRequest, salt: bytes, unary: bool = False
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.serving.check_model(request.model)
        prompt = self._prompt(request)
        params = generation_params(request.params, self.serving.limits.max_n, self.serving.limits.default_max_tokens)
        request_id = uuid.uuid4().hex
        async for item in self.serving.generate(request_id, prompt, params, salt, list(request.params.stop),
                                                request.params.HasField("logprobs"), unary):
            if isinstance(item, Usage):
                yield pb.GenerateResponse(request_id=request_id, usage=_usage(item))
            else:
                yield _response(request_id, item)

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return self.serving.text_prompt(request.text)
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            return self._chat(request.chat)
        raise InvalidRequest("prompt: set one of text, token_ids or chat")

    def _chat(self, chat: pb.Chat) -> list[int]:
        return self.serving.chat_prompt([(m.role, m.content) for m in chat.messages], "chat.messages")

    # ---- the rest ------------------------------------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind == "text":
            return pb.TokenizeResponse(token_ids=self.serving.text_prompt(request.text))
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
            kv_cache_dtype=i.cache_dtype, cache_identity=cache_identity_to_proto(self.loop.engine.identity),
            http_port=self.http_port(),
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

    async def SubscribeKvEvents(self, request: kv_events_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[kv_events_pb2.KvEventMessage]:
        """The block manager's KV events, each with the pod's load; the caller needs a key wherever keys are set
        (the public port's interceptor checks it before this; the local socket's callers are checked here)."""
        self.serving.tenant(context.invocation_metadata())
        if self.kv_events is None:
            raise NotReady("this server relays no KV events")
        loop = self.loop  # NotReady until the engine is up
        async for message in self.kv_events.relay(lambda: _load(loop.status)):
            yield message


def _load(status: dict[str, Any]) -> kv_events_pb2.LoadReport:
    stats = status["stats"]
    return kv_events_pb2.LoadReport(num_running=status["num_running"], num_waiting=status["num_waiting"],
                                    num_used_blocks=stats.num_used_blocks, num_total_blocks=stats.num_total_blocks)


def _response(request_id: str, chunk: Chunk) -> pb.GenerateResponse:
    logprobs = [
        pb.TokenLogprob(token_id=t, logprob=lp, top_token_ids=[i for i, _ in top], top_logprobs=[v for _, v in top])
        for t, lp, top in zip(chunk.token_ids, chunk.logprobs, chunk.top_logprobs, strict=True)
    ] if chunk.logprobs else []  # empty unless the request asked for them
    finish = FINISH[chunk.finish_reason] if chunk.finish_reason is not None else pb.FINISH_REASON_UNSPECIFIED
    return pb.GenerateResponse(request_id=request_id, index=chunk.index, token_ids=chunk.token_ids, text=chunk.text,
                               logprobs=logprobs, finish_reason=finish,
                               usage=_usage(chunk.usage) if chunk.usage is not None else None)


def _usage(usage: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    cached_prompt_tokens=usage.cached_prompt_tokens, num_preemptions=usage.num_preemptions,
                    queue_ms=usage.queue_ms, ttft_ms=usage.ttft_ms, e2e_ms=usage.e2e_ms, tpot_ms=usage.tpot_ms,
                    itl_ms=usage.itl_ms, seed=usage.seed)


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
