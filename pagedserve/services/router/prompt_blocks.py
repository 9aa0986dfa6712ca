"""A prompt's block keys, exactly as a pod's block manager will match them.

The router predicts a pod's prefix hit by looking the prompt's keys up in that pod's cached keys (pod_index.py),
so it must chain them as the block manager does (`BlockManager._prefix_hits`): from the namespace, one
`prefix_hash.block_hash` per full block of `block_size` tokens, and only over the first
`(num_tokens - 1) // block_size` blocks, since admission reuses the longest chain of cached full blocks
*leaving at least the prompt's last token* to compute (its logits start the output). A prompt of exactly k
full blocks can reuse at most k - 1 of them.

What the router must know to compute the pod's namespace (`CacheIdentity.namespace(tenant_salt)`):
- from each pod: model digest, tokenizer name, chat template, adapter, KV dtype and block size, as the pod's
  frontend feeds them to `cache_namespace` (its `ModelIdentity` and the block manager's block size);
- from the request: the tenant's salt, which the pod derives from the caller's API-key tenant and its
  `x-cache-salt` header, keyed with a secret (`frontend/auth.tenant_salt`). The router derives it the same way,
  so the secret must be one per fleet, shared by the pods and the routers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..block_manager.prefix_hash import block_hash
from ..common.kv_geometry import blocks_for


@dataclass(frozen=True)
class PromptBlocks:
    """A prompt as the router weighs it: its reusable block keys, in chain order, and its size."""

    block_hashes: tuple[bytes, ...]  # [min(full blocks, (num_tokens - 1) // block_size)]
    num_tokens: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        """Blocks the whole prompt occupies (the partly filled last one included)."""
        return blocks_for(self.num_tokens, self.block_size)

    def cached_tokens(self, num_cached_blocks: int) -> int:
        """The prompt tokens a pod serves from its cache when it holds the first num_cached_blocks keys."""
        if not 0 <= num_cached_blocks <= len(self.block_hashes):
            raise ValueError(f"num_cached_blocks must be in [0, {len(self.block_hashes)}], got {num_cached_blocks}")
        return num_cached_blocks * self.block_size


def chained_block_hashes(token_ids: Sequence[int], namespace: bytes, block_size: int, num_blocks: int) -> list[bytes]:
    """The keys of the first num_blocks full blocks of token_ids, each chained on the one before (the first on
    the namespace): what a pod registers once it has computed them."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not 0 <= num_blocks <= len(token_ids) // block_size:
        raise ValueError(f"num_blocks must be in [0, {len(token_ids) // block_size}] for {len(token_ids)} tokens"
                         f" in blocks of {block_size}, got {num_blocks}")
    keys: list[bytes] = []
    parent = namespace
    for i in range(num_blocks):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys


def prompt_blocks(token_ids: Sequence[int], namespace: bytes, block_size: int) -> PromptBlocks:
    """The prompt's keys that admission can reuse: those of its full blocks, leaving at least its last token."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not token_ids:
        raise ValueError("token_ids must not be empty")
    if not namespace:
        raise ValueError("the cache namespace must not be empty")
    keys = chained_block_hashes(token_ids, namespace, block_size, (len(token_ids) - 1) // block_size)
    return PromptBlocks(tuple(keys), len(token_ids), block_size)
