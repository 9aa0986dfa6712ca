"""The router hashes a request as its pod will: the pod's own tokenization and salt (frontend/generation.py's
`Serving`, called here) against the router's `RequestHasher`, with the real SmolLM2 tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from pagedserve.protos import inference_pb2 as pb
from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.executor.model.registry import resolve_model
from pagedserve.services.executor.model.tokenizer import load_tokenizer
from pagedserve.services.frontend.auth import ApiKeys
from pagedserve.services.frontend.generation import Backend, Serving
from pagedserve.services.router.prompt_blocks import prompt_blocks
from pagedserve.services.router.request_blocks import UNKNOWN, RequestHasher

IDENTITY = CacheIdentity("sha256:m", "tok", "{{ chat }}", "bfloat16", 4)
KEYS = ApiKeys.parse("key-of-tenant-a-0123456 tenant-a\nkey-of-tenant-b-0123456 tenant-b\n")
SECRET = b"s" * 64
CHAT = pb.Chat(messages=[pb.ChatMessage(role="system", content="Be brief."),
                         pb.ChatMessage(role="user", content="Hello there, how are you?")])


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("smollm2-135m"))


def pod_serving(tokenizer: Any, keys: ApiKeys | None = KEYS) -> Serving:
    serving = Serving(keys, salt_secret=SECRET)
    serving.attach(Backend(None, tokenizer, None))  # type: ignore[arg-type]  # prompts need only the tokenizer
    return serving


def test_token_ids_are_the_pods(tokenizer: Any) -> None:
    pod, router = pod_serving(tokenizer), RequestHasher(KEYS, SECRET, tokenizer)
    text = "The quick brown fox jumps over the lazy dog. " * 5
    assert router.token_ids(pb.GenerateRequest(text=text)) == pod.text_prompt(text)
    assert router.token_ids(pb.GenerateRequest(chat=CHAT)) == pod.chat_prompt([(m.role, m.content)
                                                                                for m in CHAT.messages])
    assert router.token_ids(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]))) == [5, 6, 7]


def test_what_the_router_cannot_tokenize_is_routed_by_load(tokenizer: Any) -> None:
    router = RequestHasher(None, None)  # no tokenizer yet
    assert router.token_ids(pb.GenerateRequest(text="hello")) is None
    assert router.token_ids(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]))) == [1, 2]  # needs none
    router.tokenizer = tokenizer
    assert router.token_ids(pb.GenerateRequest()) is None  # no prompt: the pod answers INVALID_ARGUMENT
    assert router.token_ids(pb.GenerateRequest(chat=pb.Chat())) is None
    assert router.blocks(pb.GenerateRequest(text="hello"), (), None) is UNKNOWN  # the fleet's identity unknown


@pytest.mark.parametrize(("keys", "metadata"), [
    (None, ()),  # anonymous
    (None, (("x-api-key", "any-label"),)),  # a pod without a keys file takes the key as the tenant
    (KEYS, (("authorization", "Bearer key-of-tenant-a-0123456"),)),
    (KEYS, (("x-api-key", "key-of-tenant-b-0123456"), ("x-cache-salt", "user-7"))),
])
def test_salt_is_the_pods(tokenizer: Any, keys: ApiKeys | None, metadata: tuple[tuple[str, str], ...]) -> None:
    pod, router = pod_serving(tokenizer, keys), RequestHasher(keys, SECRET, tokenizer)
    assert router.salt(metadata) == pod.salt(pod.tenant(metadata), metadata)
    request = pb.GenerateRequest(text="A shared system prompt, long enough for a few blocks of four tokens.")
    expected = prompt_blocks(pod.text_prompt(request.text), IDENTITY.namespace(pod.salt(pod.tenant(metadata),
                                                                                        metadata)), 4)
    assert router.blocks(request, metadata, IDENTITY) == expected and expected.block_hashes
    assert (router.salt(metadata) == b"") == (not metadata)


def test_without_the_secret_only_the_anonymous_namespace_is_known(tokenizer: Any) -> None:
    assert RequestHasher(None, None, tokenizer).salt(()) == b""
    assert RequestHasher(None, None, tokenizer).salt((("x-cache-salt", "mine"),)) is None
    router = RequestHasher(KEYS, None, tokenizer)
    keyed = (("authorization", "Bearer key-of-tenant-a-0123456"),)
    assert router.salt(keyed) is None and router.salt((("x-api-key", "not-a-listed-key"),)) is None
    assert router.blocks(pb.GenerateRequest(text="hello world, again"), keyed, IDENTITY) is UNKNOWN
