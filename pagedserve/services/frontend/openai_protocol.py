"""OpenAI's wire format, the answers: the response objects and stream chunks built from generation.py's chunks
(the request bodies are openai_bodies.py's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from transformers import PreTrainedTokenizerFast

from ..common.openai_http import Json
from .generation import Chunk, Usage


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
