"""A request's prompt blocks as the pod that serves it will key them: the router's only use of the tokenizer.

The router forwards each request unchanged (the pod tokenizes it again, so its usage, text and errors are its
own) and tokenizes it only to hash: the same token ids as the pod's (`text` without special tokens, `chat` under
the model's chat template, `token_ids` as given: frontend/generation.py's rules), under the same namespace
(the fleet's cache identity and the caller's tenant salt: the tenant from the API key as the pod reads it, the
client's `x-cache-salt`, keyed with the fleet's shared secret).

When the router cannot know the keys it says so instead of guessing: `UNKNOWN` (no prefix anywhere, so the choice
weighs load alone) for a request whose prompt it cannot tokenize (the pod will answer its error), before the
tokenizer or the fleet's identity is known, and for a salted tenant when it has no secret.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from ...protos import inference_pb2 as pb
from ..common.cache_identity import CacheIdentity
from ..common.cache_salt import Metadata, client_salt, tenant_salt
from ..executor.model.tokenizer import render_chat
from ..frontend.auth import ApiKeys, presented_key
from .prompt_blocks import PromptBlocks, prompt_blocks

UNKNOWN = PromptBlocks((), 1, 1)  # a prompt whose keys the router cannot know: one block, matched nowhere

log = logging.getLogger(__name__)


@dataclass
class RequestHasher:
    """`keys`: the router's API keys (None: the key a caller sends is its tenant, as on a pod without a keys
    file); `secret`: the fleet's cache-salt secret (None: only the anonymous namespace can be computed)."""

    keys: ApiKeys | None
    secret: bytes | None
    tokenizer: PreTrainedTokenizerFast | None = None  # set once loaded

    def token_ids(self, request: pb.GenerateRequest) -> list[int] | None:
        """The prompt's token ids as the pod computes them; None when the router cannot tell."""
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids) or None
        if self.tokenizer is None or kind is None:
            return None
        try:
            if kind == "text":
                return list(self.tokenizer.encode(request.text, add_special_tokens=False)) or None
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            return render_chat(self.tokenizer, messages) if messages else None
        except Exception as exc:
            log.debug("cannot tokenize a request (%s): routing it by load", exc)
            return None

    def salt(self, metadata: Metadata) -> bytes | None:
        """The caller's cache salt as its pod derives it (frontend/generation.py's `Serving.tenant` and `salt`);
        None when the router cannot (no secret, an unknown key)."""
        key = presented_key(metadata)
        tenant = key if self.keys is None else self.keys.tenant_for(key)
        if tenant is None:
            return None
        salt = client_salt(metadata)
        if not tenant and not salt:
            return b""  # the anonymous namespace needs no secret
        return None if self.secret is None else tenant_salt(self.secret, tenant, salt)

    def blocks(self, request: pb.GenerateRequest, metadata: Metadata, identity: CacheIdentity | None) -> PromptBlocks:
        """The prompt's reusable block keys in the caller's namespace, or UNKNOWN."""
        if identity is None:
            return UNKNOWN
        salt = self.salt(metadata)
        token_ids = self.token_ids(request) if salt is not None else None
        if salt is None or token_ids is None:
            return UNKNOWN
        return prompt_blocks(token_ids, identity.namespace(salt), identity.block_size)
