"""The request bodies of OpenAI's `/v1/completions` and `/v1/chat/completions` (pydantic): what a pod's HTTP API
parses (openai_protocol.py builds the responses), and what the router reads a prompt from (router/http_prompt.py),
so that both read a body by the same rules.

Defaults follow OpenAI, not the gRPC API: temperature 1 (gRPC: greedy), a chat without a max_tokens may use
what is left of the context (capped by the server's limits and its KV cache), a completion gets 16 tokens.
Fields this engine cannot honour are refused with a 400 naming them rather than silently ignored (penalties,
logit_bias, echo, suffix, best_of > n, tools, non-text response formats, non-text message parts); fields
that change nothing here (user, metadata, store, service_tier, parallel_tool_calls, ...) are ignored. As
vLLM does, `top_k`, `ignore_eos` and `stop_token_ids` are accepted as extensions.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from ..common.errors import InvalidRequest
from .request import GenerationParams


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
