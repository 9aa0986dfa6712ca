"""What both front doors do with a request, whatever their wire format: the gRPC API (api.py) and the
OpenAI-compatible HTTP API (http_api.py) serve one engine through one `Serving`.

Text work happens here, on the event loop: tokenizing, the chat template, streaming detokenization and stop
strings. Scheduling happens on the engine thread (engine_loop.py). A request whose caller goes away is aborted
in the `finally` of `generate`: its blocks are freed at once. Who is calling (auth.py) decides the cache
namespace and whose stream count (limits.py) a request takes; one `Serving` holds one salt secret (the
fleet's, from `--cache-salt-secret-file`, or a random one: common/cache_salt.py) and one stream count, so a
tenant's cache and its limit are the same through either door.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain

from opentelemetry import trace
from transformers import PreTrainedTokenizerFast

from ..common.cache_salt import Metadata, client_salt, load_secret, tenant_salt
from ..common.errors import InvalidRequest, NotReady, Unauthenticated, UnknownModel
from ..executor.model.tokenizer import render_chat
from ..executor.step_types import ExecutorInfo
from .auth import UNAUTHENTICATED, ApiKeys, presented_key
from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .engine_loop import EngineLoop, Event
from .limits import ApiLimits, StreamCounter
from .metrics import latency
from .request import FinishReason, GenerationParams, Request, SequenceOutput, StepOutput

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Backend:
    """What the API needs once the stack is up."""

    loop: EngineLoop
    tokenizer: PreTrainedTokenizerFast
    info: ExecutorInfo


@dataclass(slots=True)
class Chunk:
    """New output of one sample: its tokens, the text they add (stop strings and held-back bytes applied), their
    logprobs when asked for, and why the sample ended on its last chunk (STOP for a stop string too)."""

    index: int
    token_ids: Sequence[int]
    text: str
    logprobs: Sequence[float] = ()
    top_logprobs: Sequence[Sequence[tuple[int, float]]] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # on the request's last chunk when its end was known as it was made (see generate)


@dataclass(frozen=True)
class Usage:
    """A request's totals, after its last chunk."""

    prompt_tokens: int
    completion_tokens: int  # over all samples
    cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    tpot_ms: float = 0.0  # sample 0's time per output token after its first
    itl_ms: tuple[float, ...] = ()  # sample 0's inter-token gaps
    seed: int = 0  # what the samples drew with: the request's, or the one the engine picked

    def span_attributes(self) -> dict[str, int | float]:
        """What the call's trace span records of it."""
        return {"gen_ai.usage.output_tokens": self.completion_tokens, "pagedserve.ttft_ms": self.ttft_ms,
                "pagedserve.cached_prompt_tokens": self.cached_prompt_tokens,
                "pagedserve.num_preemptions": self.num_preemptions}


@dataclass
class _Sample:
    """The text side of one of a request's samples."""

    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    text_at_end: bool = False  # a unary call without stop strings: its text is decoded once, at the end
    done: bool = False
    token_ids: list[int] = field(default_factory=list)


class Serving:
    """The state both front doors share: the backend once the stack is up (NotReady before), the callers' keys,
    the limits, the streams in flight per tenant and the secret of the tenants' cache salts."""

    def __init__(self, keys: ApiKeys | None = None, limits: ApiLimits | None = None,
                 salt_secret: bytes | None = None) -> None:
        self._backend: Backend | None = None
        self._tenant_secret = salt_secret if salt_secret is not None else load_secret(None)
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

    # ---- who is calling ------------------------------------------------------------------------------

    def tenant(self, metadata: Metadata) -> str:
        """The tenant as the server knows it: the name the keys file gives the caller's key. Without a keys
        file (a trusted network) the key the client sends is taken as its tenant, unchecked."""
        key = presented_key(metadata)
        if self.keys is None:
            return key
        tenant = self.keys.tenant_for(key)
        if tenant is None:
            raise Unauthenticated(UNAUTHENTICATED)
        return tenant

    @contextmanager
    def hold(self, metadata: Metadata) -> Iterator[bytes]:
        """Holds one of the caller's streams (limits.py) for the block, however it ends; gives its cache salt."""
        tenant = self.tenant(metadata)
        with self.streams.hold(tenant):
            yield self.salt(tenant, metadata)

    def salt(self, tenant: str, metadata: Metadata) -> bytes:
        """The cache salt of the tenant's call (its `x-cache-salt` header in metadata)."""
        return tenant_salt(self._tenant_secret, tenant, client_salt(metadata))

    # ---- prompts -------------------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        served = self.backend.info.model
        if model and model != served:
            raise UnknownModel(f"model: {model!r} is not served here; this pod serves {served!r}")

    def text_prompt(self, text: str) -> list[int]:
        return list(self.backend.tokenizer.encode(text, add_special_tokens=False))

    def chat_prompt(self, messages: Sequence[tuple[str, str]], name: str = "messages") -> list[int]:
        """(role, content) pairs under the model's chat template; `name` is the field errors name."""
        tokenizer = self.backend.tokenizer
        if not messages:
            raise InvalidRequest(f"{name}: must not be empty")
        if tokenizer.chat_template is None:
            raise InvalidRequest(f"{name}: this model has no chat template; send a plain prompt")
        for i, (role, _) in enumerate(messages):
            if role not in CHAT_ROLES:
                raise InvalidRequest(f"{name}[{i}].role: {role!r} is not system, user or assistant")
        return render_chat(tokenizer, [{"role": role, "content": content} for role, content in messages])

    def max_tokens_that_fit(self, num_prompt_tokens: int, n: int) -> int:
        """The most new tokens each of n samples could get: what the context, the server's limit and the whole
        KV cache allow (Engine.check's block count solved for max_tokens); at least 1, so that a prompt that
        leaves no room is refused for its own length."""
        info = self.backend.info
        bs = info.block_size
        by_cache = (info.num_blocks - num_prompt_tokens // bs) // n * bs - num_prompt_tokens % bs
        by_context = info.max_model_len - num_prompt_tokens
        return max(1, min(by_cache, by_context, self.limits.max_new_tokens or by_context))

    # ---- generation ----------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt: list[int], params: GenerationParams, salt: bytes, stop: Sequence[str] = (),
        want_logprobs: bool = False, unary: bool = False,
    ) -> AsyncIterator[Chunk | Usage]:
        """The request's chunks as they come, then its Usage: on the last chunk (its `usage`) when the engine had
        ended the request by the time that chunk was made (the usual case: the end comes with the last step's
        outputs; one message less on every hop of a short request), else alone after it (a stop string ends a
        sample before the engine does, and the last chunk does not wait for it). For a unary call without stop
        strings (nothing to match while the text grows), one chunk per sample at the end, read from the
        finished request. Raises the domain errors (limits, engine checks, a full queue, a lost sidecar) before
        or instead of a chunk."""
        self.limits.check(len(prompt), params)
        at_end = unary and not stop
        stops = [StopStringMatcher(stop) for _ in range(params.n)]  # bad stop strings: refused before anything queued
        span = trace.get_current_span()  # the call's server span (a no-op one when tracing is off)
        span.set_attributes({"pagedserve.request_id": request_id, "gen_ai.usage.input_tokens": len(prompt),
                             "gen_ai.request.max_tokens": params.max_tokens})
        events = self.backend.loop.submit(request_id, prompt, params, salt, final_only=at_end)
        engine_request: Request | None = None
        over = False
        try:
            # the detokenizers decode the prompt: only once the engine has checked its ids (a negative one breaks
            # the tokenizer: InvalidRequest from submit, not an unhandled error here)
            samples = [_Sample(IncrementalDetokenizer(self.backend.tokenizer, prompt), stop_matcher, at_end)
                       for stop_matcher in stops]
            # the engine ends every request's stream with None, after which it no longer touches the request
            later: Event | _Nothing = NOTHING  # an event taken while catching up, not handled yet
            last: Chunk | None = None  # the last chunk, held for the usage since the end is already in hand
            while (event := await events.get() if later is NOTHING else later) is not None:
                later = NOTHING
                if isinstance(event, BaseException):
                    raise event
                if engine_request is None and not at_end:
                    span.add_event("first_token")
                engine_request = event.request
                if at_end:  # the outputs are read from the request at its end
                    continue
                outputs = event.outputs
                if not stop and not events.empty():  # stop strings are matched token by token: no catching up
                    outputs, later = _catch_up(outputs, events)
                for output in outputs:
                    chunk = self._chunk(request_id, samples, output, want_logprobs)
                    if chunk is None:
                        continue
                    if all(sample.done for sample in samples):
                        if later is NOTHING and not events.empty():
                            later = events.get_nowait()
                        if later is None:
                            last = chunk
                            continue
                    yield chunk
            over = True
            if at_end and engine_request is not None:  # the engine no longer touches it
                chunks = self._whole_chunks(request_id, samples, engine_request, want_logprobs)
                last = chunks.pop() if chunks else None
                for chunk in chunks:
                    yield chunk
            usage = _usage(engine_request, prompt, samples)
            span.set_attributes(usage.span_attributes())
            if last is None:
                yield usage
            else:
                last.usage = usage
                yield last
        finally:
            if not over:  # the client went away, the deadline passed, or the engine failed
                self.backend.loop.abort(request_id)

    def _whole_chunks(self, request_id: str, samples: list[_Sample], request: Request,
                      want_logprobs: bool) -> list[Chunk]:
        """One chunk per sample of a finished request, read from it (a unary call without stop strings)."""
        chunks = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            whole = SequenceOutput(seq.seq_id, seq.index, seq.output_token_ids, seq.finish_reason, seq.logprobs,
                                   seq.top_logprobs)
            chunk = self._chunk(request_id, samples, whole, want_logprobs)
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def _chunk(
        self, request_id: str, samples: list[_Sample], output: SequenceOutput, want_logprobs: bool
    ) -> Chunk | None:
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
        finish = FinishReason.STOP if stopped else output.finish_reason
        if finish is not None and not stopped and not sample.text_at_end:  # the end: release what was held back
            text += sample.stop.feed(sample.detokenizer.flush())[0] + sample.stop.flush()
        if stopped and output.finish_reason is None:
            self.backend.loop.finish_sample(request_id, output.index)
        sample.done = finish is not None
        sample.token_ids.extend(output.new_token_ids)
        if not want_logprobs:
            return Chunk(output.index, output.new_token_ids, text, finish_reason=finish)
        return Chunk(output.index, output.new_token_ids, text, output.new_logprobs, output.new_top_logprobs, finish)


class _Nothing(enum.Enum):
    NOTHING = enum.auto()


NOTHING = _Nothing.NOTHING  # no event held back (None is one: the end)


def _catch_up(outputs: Sequence[SequenceOutput],
              events: asyncio.Queue[Event]) -> tuple[list[SequenceOutput], Event | _Nothing]:
    """The outputs of every step already queued behind `outputs`, joined into one per sample (in the order the
    samples first appear), and the end or error that stopped the taking (NOTHING when the queue ran dry). For a
    caller that fell behind: a loaded server sends fewer, larger messages instead of falling further behind."""
    parts: dict[int, list[SequenceOutput]] = {}
    for output in outputs:
        parts.setdefault(output.index, []).append(output)
    stopped_by: Event | _Nothing = NOTHING
    while not events.empty():
        event = events.get_nowait()
        if not isinstance(event, StepOutput):
            stopped_by = event
            break
        for output in event.outputs:
            parts.setdefault(output.index, []).append(output)
    joined = [SequenceOutput(each[0].seq_id, index, list(chain.from_iterable(o.new_token_ids for o in each)),
                             each[-1].finish_reason, list(chain.from_iterable(o.new_logprobs for o in each)),
                             list(chain.from_iterable(o.new_top_logprobs for o in each)))
              for index, each in parts.items()]
    return joined, stopped_by


def _usage(request: Request | None, prompt: list[int], samples: list[_Sample]) -> Usage:
    completion_tokens = sum(len(s.token_ids) for s in samples)
    if request is None:
        return Usage(len(prompt), completion_tokens)
    lat = latency(request.metrics, completion_tokens)
    return Usage(len(prompt), completion_tokens, request.num_cached_tokens, request.num_preemptions, lat.queue_ms,
                 lat.ttft_ms, lat.e2e_ms, lat.tpot_ms, lat.itl_ms, request.seed)
