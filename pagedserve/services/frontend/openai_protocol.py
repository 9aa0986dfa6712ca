"""OpenAI's wire format: the request bodies of `/v1/completions` and `/v1/chat/completions` (pydantic), and the
response objects and stream chunks built from generation.py's chunks.

Defaults follow OpenAI, not the gRPC API: temperature 1 (gRPC: greedy), a chat without a max_tokens may use
what is left of the context (capped by the server's limits and its KV cache), a completion gets 16 tokens.
Fields this engine cannot honour are refused with a 400 naming them rather than silently ignored (penalties,
logit_bias, echo, suffix, best_of > n, tools, non-text response formats, non-text message parts); fields
that change nothing here (user, metadata, store, service_tier, parallel_tool_calls, ...) are ignored. As
vLLM does, `top_k`, `ignore_eos` and `stop_token_ids` are accepted as extensions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict
from transformers import PreTrainedTokenizerFast

from ..common.errors import InvalidRequest
from .generation import Chunk, Usage
from .request import GenerationParams

Json = dict[str, Any]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    """What both endpoints take. Unknown fields are ignored, as OpenAI-compatible servers commonly do."""

    model_config = ConfigDict(extra="ignore")
    model: str = ""
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_k: int | None = None  # extension
    ignore_eos: bool = False  # extension
    stop_token_ids: list[int] | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("presence_penalty", "frequency_penalty", "logit_bias")

    def check_supported(self) -> None:
        for name in self.UNSUPPORTED:
            if getattr(self, name) not in (None, False, 0, "", [], {}):
                raise InvalidRequest(f"{name}: not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options: only allowed with stream: true")

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def params(self, max_tokens: int, logprobs: int, max_n: int) -> GenerationParams:
        params = GenerationParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, n=self.num_samples,
            logprobs=logprobs,
        )
        params.validate(max_n)
        return params


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None  # top alternatives per token (the chosen token's logprob comes with any value)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    UNSUPPORTED = (*_Body.UNSUPPORTED, "echo", "suffix")

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.num_samples):
            raise InvalidRequest("best_of: only best_of = n is supported (every sample is returned)")

    def single_prompt(self) -> str | list[int]:
        """One prompt per request: a list of several would need one choice index per prompt and sample."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return prompt  # type: ignore[return-value]
        if len(prompt) != 1:
            raise InvalidRequest(f"prompt: one prompt per request, got a list of {len(prompt)}")
        return prompt[0]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # OpenAI's older name of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None

    UNSUPPORTED = (*_Body.UNSUPPORTED, "tools", "functions")

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice: tools are not supported by this server")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidRequest("response_format: only {\"type\": \"text\"} is supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs: true")

    def turns(self) -> list[tuple[str, str]]:
        """(role, text) per message; OpenAI's `developer` role is the system prompt of older models."""
        turns = []
        for i, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise InvalidRequest(f"messages[{i}].content[{j}].type: only text parts are supported, "
                                             f"got {part.type!r}")
                content = "".join(part.text or "" for part in content)
            turns.append(("system" if message.role == "developer" else message.role, content or ""))
        return turns


# ---- responses ---------------------------------------------------------------------------------------------


def usage_json(usage: Usage) -> Json:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def finish_json(chunk: Chunk) -> str | None:
    return None if chunk.finish_reason is None else chunk.finish_reason.value


class Responses:
    """Builds one request's response objects: chunks of a stream, or the whole answer (`choices` from the
    chunks merged per sample). `chat` picks the chat shapes (`delta`/`message`, logprobs `content`)."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: PreTrainedTokenizerFast,
                 want_logprobs: bool) -> None:
        self.chat, self.tokenizer, self.want_logprobs = chat, tokenizer, want_logprobs
        self.head: Json = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", "object": "", "created":
                           int(time.time()), "model": model}
        self.offsets: dict[int, int] = {}  # completions' logprobs: each sample's text length so far

    def chunk(self, choices: list[Json], usage: Usage | None = None, include_usage: bool = False) -> Json:
        body = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion", "choices": choices}
        if include_usage:
            body["usage"] = None if usage is None else usage_json(usage)
        return body

    def role_choices(self, n: int) -> list[Json]:
        """A chat stream opens every sample with the assistant's role, as OpenAI's does."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)]

    def stream_choice(self, chunk: Chunk) -> Json:
        key, value = ("delta", {"content": chunk.text}) if self.chat else ("text", chunk.text)
        return {"index": chunk.index, key: value, "logprobs": self.logprobs(chunk), "finish_reason": finish_json(chunk)}

    def whole(self, chunks: Sequence[Chunk], usage: Usage) -> Json:
        """The non-streaming answer from every chunk of the request, in order."""
        by_index: dict[int, list[Chunk]] = {}
        for chunk in chunks:
            by_index.setdefault(chunk.index, []).append(chunk)
        choices = []
        for index in sorted(by_index):
            parts = by_index[index]
            merged = Chunk(index, [t for p in parts for t in p.token_ids], "".join(p.text for p in parts),
                           [lp for p in parts for lp in p.logprobs], [top for p in parts for top in p.top_logprobs],
                           parts[-1].finish_reason)
            key, value = (("message", {"role": "assistant", "content": merged.text}) if self.chat
                          else ("text", merged.text))
            choices.append({"index": index, key: value, "logprobs": self.logprobs(merged),
                            "finish_reason": finish_json(merged)})
        object_ = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": object_, "choices": choices, "usage": usage_json(usage)}

    def logprobs(self, chunk: Chunk) -> Json | None:
        if not self.want_logprobs:
            return None
        tokens = [self.token(t) for t in chunk.token_ids]
        if self.chat:
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": (a := self.token(i)), "logprob": v, "bytes": list(a.encode())}
                                  for i, v in top]}
                for s, lp, top in zip(tokens, chunk.logprobs, chunk.top_logprobs, strict=True)
            ], "refusal": None}
        offset = self.offsets.get(chunk.index, 0)
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        self.offsets[chunk.index] = offset
        return {"tokens": tokens, "token_logprobs": list(chunk.logprobs),
                "top_logprobs": [{self.token(i): v for i, v in top} for top in chunk.top_logprobs],
                "text_offset": offsets}

    def token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False))
