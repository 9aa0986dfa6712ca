"""The router's prediction of a pod's prefix hit equals what the pod's own BlockManager grants on admission."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.block_manager.manager import BlockManager
from pagedserve.services.block_manager.prefix_hash import cache_namespace
from pagedserve.services.common.cache_identity import CacheIdentity
from pagedserve.services.common.kv_events import BlocksStored, KvEventBatch, KvSnapshot
from pagedserve.services.common.kv_events_codec import cache_identity_from_proto, cache_identity_to_proto
from pagedserve.services.frontend.engine import Engine, EngineLimits
from pagedserve.services.frontend.request import GenerationParams, Request
from pagedserve.services.router.pod_index import PodIndex
from pagedserve.services.router.prompt_blocks import chained_block_hashes, prompt_blocks

IDENTITY = CacheIdentity(model_digest="sha256:m", tokenizer="tok", chat_template="{{ x }}", kv_dtype="bfloat16",
                         block_size=4)


def test_namespace_is_the_pods() -> None:
    """The router's CacheIdentity (rebuilt from the pod's ListModels) roots the chain where the pod's Engine
    roots a request's, field for field."""
    pod_identity = CacheIdentity("sha256:m", "tok", "{{ x }}", "bfloat16", 4, adapter="lora-1")
    limits = EngineLimits(vocab_size=10, max_model_len=64, num_blocks=8, block_size=4, eos_token_ids=frozenset())
    queued: list[Request] = []
    scheduler = SimpleNamespace(request=lambda request_id: None, add=queued.append)
    engine = Engine(scheduler, None, limits, pod_identity)  # type: ignore[arg-type]
    router_side = cache_identity_from_proto(cache_identity_to_proto(pod_identity))
    for salt in (b"", b"tenant-salt"):
        request = engine.add_request(f"r{len(queued)}", [1, 2, 3], GenerationParams(max_tokens=1), tenant_salt=salt)
        assert router_side.namespace(salt) == request.cache_namespace
    assert router_side.namespace(b"a") != router_side.namespace(b"b")
    with pytest.raises(ValueError, match="block_size"):
        Engine(scheduler, None, limits, CacheIdentity("m", "t", "", "f", 8))  # type: ignore[arg-type]


def test_differences_name_the_field() -> None:
    other = CacheIdentity("sha256:m", "tok", "x" * 200, "fp8", 4)
    lines = IDENTITY.differences(other)
    assert lines[0] == "chat_template: '{{ x }}' here, <200 characters, blake2b " + lines[0].split("blake2b ")[1]
    assert lines[1] == "kv_dtype: 'bfloat16' here, 'fp8' there"
    assert IDENTITY.differences(IDENTITY) == []


@pytest.mark.parametrize(("num_tokens", "reusable"), [(1, 0), (4, 0), (5, 1), (8, 1), (9, 2)])
def test_leaves_the_last_token(num_tokens: int, reusable: int) -> None:
    blocks = prompt_blocks(list(range(num_tokens)), IDENTITY.namespace(b""), 4)
    assert len(blocks.block_hashes) == reusable and blocks.num_blocks == -(-num_tokens // 4)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        prompt_blocks([], b"ns", 4)
    with pytest.raises(ValueError, match="namespace"):
        prompt_blocks([1], b"", 4)
    with pytest.raises(ValueError, match="block_size"):
        prompt_blocks([1], b"ns", 0)
    with pytest.raises(ValueError, match="num_cached_blocks"):
        prompt_blocks([1, 2, 3, 4, 5], b"ns", 4).cached_tokens(2)


# prompts built from a few shared stems, so that they share prefixes of every length
stems = st.lists(st.integers(0, 3), min_size=1, max_size=20)
prompts = st.tuples(st.integers(0, 2), st.integers(0, 2), stems).map(
    lambda t: [*([7] * 6 * t[0]), *([9, 8] * 5 * t[1]), *t[2]]
)


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 16]), tenants=st.lists(st.sampled_from([b"", b"t1", b"t2"]),
       min_size=2, max_size=8), bodies=st.lists(prompts, min_size=2, max_size=8), free_some=st.booleans())
def test_predicted_cached_tokens_equal_the_block_managers(
    block_size: int, tenants: list[bytes], bodies: list[list[int]], free_some: bool
) -> None:
    """Admit prompts in turn on a real BlockManager; the router, fed the keys the pod registers as it computes
    them (the KV events, with no eviction: the pool is large), predicts each admission's cached tokens."""
    identity = CacheIdentity("sha256:m", "tok", "", "float32", block_size)
    manager = BlockManager(num_blocks=512, block_size=block_size)
    index = PodIndex()
    index.add_pod("pod")
    index.apply_snapshot("pod", KvSnapshot("e", 0), now=0.0)
    for seq_id, (salt, tokens) in enumerate(zip(tenants, bodies, strict=False)):
        namespace = identity.namespace(salt)
        predicted = prompt_blocks(tokens, namespace, block_size)
        depth = index.longest_prefix("pod", predicted.block_hashes)
        admission = manager.admit(seq_id, tokens, namespace, max_tokens=len(tokens))
        assert admission.granted
        assert predicted.cached_tokens(depth) == admission.num_cached_tokens
        manager.commit(seq_id, len(tokens))  # the engine's commit after the step: full blocks join the cache
        stored = chained_block_hashes(tokens, namespace, block_size, len(tokens) // block_size)
        index.apply_batch("pod", KvEventBatch("e", seq_id + 1, (BlocksStored(tuple(stored)),)), now=0.0)
        if free_some and seq_id % 2:
            manager.free(seq_id)  # released blocks stay cached (nothing evicts them in this pool)


def test_the_chain_is_the_managers() -> None:
    """Keys are the block manager's own: a prompt sharing two full blocks hits exactly those."""
    namespace = cache_namespace(model="m", tokenizer="t", chat_template="", adapter="", kv_dtype="f", block_size=2,
                                tenant_salt=b"")
    manager = BlockManager(num_blocks=16, block_size=2)
    first = [1, 2, 3, 4, 5, 6]
    assert manager.admit(0, first, namespace, max_tokens=6).granted
    manager.commit(0, 6)
    second = [1, 2, 3, 4, 9, 9, 9]
    keys = set(chained_block_hashes(first, namespace, 2, 3))
    predicted = prompt_blocks(second, namespace, 2)
    depth = next((i for i, key in enumerate(predicted.block_hashes) if key not in keys), len(predicted.block_hashes))
    assert predicted.cached_tokens(depth) == manager.admit(1, second, namespace, max_tokens=7).num_cached_tokens == 4
