"""Cache identity: the namespace digest and the chained content hash of full blocks.

Two blocks may be shared only if everything that shaped their KV is identical: the model weights,
tokenizer and chat template (the same text can tokenize differently), adapter, KV dtype, block size,
and the tenant's salt (so one tenant cannot probe another's prompts through cache timing). Matching
text alone is never a sharing key. blake2b is cryptographic: Python's hash() is seeded per process
and collides by design.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16  # 128-bit digests: collisions are out of reach for any cache size


def cache_namespace(
    *,
    model: str,
    tokenizer: str,
    chat_template: str,
    adapter: str,
    kv_dtype: str,
    block_size: int,
    tenant_salt: bytes,
) -> bytes:
    """The root of every block-hash chain. `model` should be a weights digest or an id plus revision."""
    digest = hashlib.blake2b(digest_size=HASH_BYTES, person=b"pagedserve-ns")
    for part in (model, tokenizer, chat_template, adapter, kv_dtype, str(block_size)):
        encoded = part.encode()
        digest.update(struct.pack("<Q", len(encoded)) + encoded)
    digest.update(struct.pack("<Q", len(tenant_salt)) + tenant_salt)
    return digest.digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """H(parent key, token ids of one full block): equal keys imply equal prefixes up to this block."""
    digest = hashlib.blake2b(parent, digest_size=HASH_BYTES, person=b"pagedserve-blk")
    digest.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return digest.digest()
