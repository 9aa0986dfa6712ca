"""What the router reads of an OpenAI-compatible request body: the prompt, to hash it, and whether the answer is a
stream that ends with the pod's usage. Nothing else: the body goes to the pod as it came.

The prompt is read under the pod's own rules (frontend/http_api.py, through openai_bodies.py): a
completion's `prompt` (one text, or one list of token ids), a chat's `messages` as `ChatBody.turns()` gives them
(`developer` as `system`, text parts joined), then hashed as a gRPC request of the same prompt is
(request_blocks.py). A body the pod would refuse (not JSON, a field of the wrong type, several prompts, a non-text
part) has no prompt here: the request is routed by load alone, and the pod answers the error.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...protos import inference_pb2 as pb
from ..frontend.openai_bodies import ChatBody, CompletionBody

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"


@dataclass(frozen=True)
class HttpPrompt:
    """`request`: the prompt as a GenerateRequest (for RequestHasher), None when the body gives none the router
    can read. `include_usage`: a stream whose last event carries the pod's usage (`stream_options.include_usage`).
    """

    request: pb.GenerateRequest | None
    stream: bool = False
    include_usage: bool = False


def read_prompt(path: str, body: bytes) -> HttpPrompt:
    """The prompt and stream options of a body sent to `path` (COMPLETIONS or CHAT_COMPLETIONS)."""
    try:
        parsed = CompletionBody.model_validate_json(body) if path == COMPLETIONS else ChatBody.model_validate_json(body)
    except ValueError:  # pydantic's ValidationError: the pod answers it
        return HttpPrompt(None)
    stream, include_usage = bool(parsed.stream), parsed.include_usage
    try:
        if isinstance(parsed, CompletionBody):
            prompt = parsed.single_prompt()
            request = (pb.GenerateRequest(text=prompt) if isinstance(prompt, str)
                       else pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt)))
        else:
            messages = [pb.ChatMessage(role=role, content=content) for role, content in parsed.turns()]
            request = pb.GenerateRequest(chat=pb.Chat(messages=messages))
    except ValueError:  # InvalidRequest (several prompts, a non-text part), or a token id out of int32's range
        return HttpPrompt(None, stream, include_usage)
    return HttpPrompt(request, stream, include_usage)
