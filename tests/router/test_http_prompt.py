"""The router reads an OpenAI-compatible body's prompt as the pod does: the blocks it hashes for a completion and a
chat, with the tenant and salt from HTTP headers, against the pod's own `Serving` (frontend/generation.py) fed the
pod's own parsing of the same body (openai_bodies.py), with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.datastructures import Headers

from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.executor.model.registry import resolve_model
from pagedserve.services.executor.model.tokenizer import load_tokenizer
from pagedserve.services.frontend.auth import ApiKeys
from pagedserve.services.frontend.generation import Backend, Serving
from pagedserve.services.frontend.openai_bodies import ChatBody, CompletionBody
from pagedserve.services.router.http_prompt import CHAT_COMPLETIONS, COMPLETIONS, read_prompt
from pagedserve.services.router.prompt_blocks import prompt_blocks
from pagedserve.services.router.request_blocks import RequestHasher

IDENTITY = CacheIdentity("sha256:m", "tok", "{{ chat }}", "bfloat16", 4)
KEYS = ApiKeys.parse("key-of-tenant-a-0123456 tenant-a\nkey-of-tenant-b-0123456 tenant-b\n")
SECRET = b"s" * 64
SYSTEM = "You answer questions about the history of Rome in full sentences, citing your sources. "
COMPLETION = {"model": "m", "prompt": SYSTEM + "Who founded the city?", "max_tokens": 4}
CHAT = {"messages": [{"role": "developer", "content": SYSTEM},
                     {"role": "user", "content": [{"type": "text", "text": "Who founded "}, {"type": "text",
                                                                                              "text": "the city?"}]}],
        "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("smollm2-135m"))


def http_headers(*pairs: tuple[str, str]) -> list[tuple[str, str]]:
    """Headers as the pod's and the router's handlers read them (Starlette's: names lower-cased)."""
    return Headers(raw=[(k.encode(), v.encode()) for k, v in pairs]).items()


def pods_blocks(tokenizer: Any, path: str, body: dict[str, Any], headers: list[tuple[str, str]]) -> Any:
    """What the pod's http_api computes for the body: its token ids, then its tenant's salt."""
    serving = Serving(KEYS, salt_secret=SECRET)
    serving.attach(Backend(None, tokenizer, None))  # type: ignore[arg-type]  # prompts need only the tokenizer
    raw = json.dumps(body).encode()
    if path == COMPLETIONS:
        prompt = CompletionBody.model_validate_json(raw).single_prompt()
        ids = serving.text_prompt(prompt) if isinstance(prompt, str) else list(prompt)
    else:
        ids = serving.chat_prompt(ChatBody.model_validate_json(raw).turns())
    salt = serving.salt(serving.tenant(headers), headers)
    return prompt_blocks(ids, IDENTITY.namespace(salt), IDENTITY.block_size)


@pytest.mark.parametrize(("path", "body"), [(COMPLETIONS, COMPLETION), (CHAT_COMPLETIONS, CHAT),
                                            (COMPLETIONS, {"prompt": [[5, 6, 7, 8, 9, 10, 11, 12, 13]]})])
@pytest.mark.parametrize("headers", [
    (("Authorization", "Bearer key-of-tenant-a-0123456"),),
    (("X-Api-Key", "key-of-tenant-b-0123456"), ("X-Cache-Salt", "user-7")),
])
def test_the_router_hashes_an_http_body_as_its_pod(tokenizer: Any, path: str, body: dict[str, Any],
                                                   headers: tuple[tuple[str, str], ...]) -> None:
    read = read_prompt(path, json.dumps(body).encode())
    assert read.request is not None
    router = RequestHasher(KEYS, SECRET, tokenizer)
    expected = pods_blocks(tokenizer, path, body, http_headers(*headers))
    assert router.blocks(read.request, http_headers(*headers), IDENTITY) == expected
    assert expected.block_hashes


def test_stream_options_are_read() -> None:
    assert read_prompt(CHAT_COMPLETIONS, json.dumps(CHAT).encode()).include_usage
    plain = read_prompt(COMPLETIONS, json.dumps({**COMPLETION, "stream": True}).encode())
    assert plain.stream and not plain.include_usage
    assert not read_prompt(COMPLETIONS, json.dumps(COMPLETION).encode()).stream


@pytest.mark.parametrize(("path", "body"), [
    (COMPLETIONS, b"not json"),
    (COMPLETIONS, b'{"max_tokens": 4}'),  # no prompt
    (COMPLETIONS, b'{"prompt": ["one", "two"]}'),  # several prompts: the pod refuses them
    (COMPLETIONS, b'{"prompt": [99999999999]}'),  # a token id past the pod's range
    (CHAT_COMPLETIONS, b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'),
    (CHAT_COMPLETIONS, b'{"messages": "hello"}'),
])
def test_a_body_the_pod_refuses_has_no_prompt_here(path: str, body: bytes) -> None:
    """No prompt: the router routes it by load alone (request_blocks.UNKNOWN), and the pod answers the error."""
    assert read_prompt(path, body).request is None
