"""How far the running sequences are expected to grow: the room admission leaves them (docs/scheduler.md).

A sequence still has to compute what it knows but has not computed (the rest of a chunked prompt) and the output
it will generate, whose length is known only once it stops. That is estimated from the sequences that finished: a
sequence is expected to reach the 35th percentile of the latest finished output lengths, and no further than its
own limit (`max_tokens`, the context); one already past it adds nothing more. A low percentile because the reserve
is a sum over the running sequences that counts none of the blocks they free as they finish: on the ShareGPT-shaped
trace of `bench blocks` the median cut preemptions a little further (0.045 per request against 0.061) for 4 % more
steps, and the 25th percentile left 0.1 per request on one seed (docs/performance.md). Until
`MIN_OBSERVED` sequences have finished there is no estimate and nothing is reserved: preemption is the fallback.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from ..common.kv_geometry import blocks_for
from .request import Sequence

WINDOW = 1024  # finished sequences the estimate looks at: recent enough to follow a change of traffic
MIN_OBSERVED = 16  # finished sequences before there is an estimate
PERCENTILE = 35  # of the window's output lengths: where a running sequence is expected to stop


class OutputLengths:
    """The output lengths of the latest finished sequences, and the estimate they give of the running ones."""

    def __init__(self, window: int = WINDOW, min_observed: int = MIN_OBSERVED, percentile: int = PERCENTILE) -> None:
        if window < 1 or not 1 <= min_observed <= window or not 0 <= percentile < 100:
            raise ValueError(f"need 1 <= min_observed ({min_observed}) <= window ({window}) and a percentile in"
                             f" [0, 100), got {percentile}")
        self.min_observed, self.percentile = min_observed, percentile
        self._latest: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []  # the window's lengths in order
        self.typical = 0  # the output length a sequence is expected to reach (0: too few finished yet)

    def observe(self, length: int) -> None:
        """Adds a finished sequence's output length; the oldest one of a full window drops out."""
        if len(self._latest) == self._latest.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._latest[0])]
        self._latest.append(length)
        bisect.insort(self._sorted, length)
        count = len(self._sorted)
        self.typical = self._sorted[count * self.percentile // 100] if count >= self.min_observed else 0

    def expected_len(self, seq: Sequence, max_model_len: int) -> int:
        """The tokens the sequence is expected to hold in the KV cache when it ends: those it knows (prompt and
        output so far, computed or not) and the output it is still expected to generate (none without an
        estimate, or once it is past the typical length)."""
        known = len(seq.token_ids)
        limit = min(seq.request.max_len, max_model_len) - known
        more = self.typical - (known - seq.num_prompt_tokens)
        return known + max(0, min(limit, more))

    def reserve(self, seqs: Iterable[Sequence], block_size: int, max_model_len: int) -> int:
        """Blocks the (running) sequences are expected to take beyond those they hold."""
        return sum(max(0, blocks_for(self.expected_len(seq, max_model_len), block_size) - len(seq.block_table))
                   for seq in seqs)
