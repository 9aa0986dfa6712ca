"""How far the running sequences are expected to grow: the room admission leaves them (docs/scheduler.md).

A sequence still has to compute what it knows but has not computed (the rest of a chunked prompt) and the output
it will generate, whose length is known only once it stops. That is estimated from the sequences that finished: a
new sequence is expected to reach the 60th percentile of the latest finished output lengths, and no further than
its own limit (`max_tokens`, the context). One already past that is in the long tail: it is expected to go on to
the 10th percentile of the finished lengths beyond its own, and its blocks are not counted on to come back soon.
The reserve is the peak of what the sequences take as they grow, counting the blocks each frees as it ends
(`peak_growth`), not the sum of their growth: a sum holds back admissions for blocks that the first sequences to
end give back before the last ones need them. On the ShareGPT-shaped trace of `bench blocks` this gives 0.02-0.07
preemptions a request on three seeds, 0.065 with each request's exact `max_tokens` (docs/performance.md). Until
`MIN_OBSERVED` sequences have finished there is no estimate and only the rest of a chunked prompt is reserved:
preemption is the fallback.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import NamedTuple

from ..common.kv_geometry import blocks_for
from .request import Sequence

WINDOW = 1024  # finished sequences the estimate looks at: recent enough to follow a change of traffic
MIN_OBSERVED = 16  # finished sequences before there is an estimate
PERCENTILE = 60  # of the window's output lengths: where a new sequence is expected to stop
TAIL_PERCENTILE = 10  # of the lengths beyond its own: where one past the typical length is expected to stop


class Growing(NamedTuple):
    """A sequence as the reserve sees it."""

    held: int  # blocks it holds now
    known: int  # tokens it knows (computed or not)
    end: int  # tokens it is expected to hold when it ends
    frees: bool = True  # its blocks come back when it ends (False: in the long tail, not counted on)


class OutputLengths:
    """The output lengths of the latest finished sequences, and the estimate they give of the running ones."""

    def __init__(self, window: int = WINDOW, min_observed: int = MIN_OBSERVED, percentile: int = PERCENTILE) -> None:
        if window < 1 or not 1 <= min_observed <= window or not 0 <= percentile < 100:
            raise ValueError(f"need 1 <= min_observed ({min_observed}) <= window ({window}) and a percentile in"
                             f" [0, 100), got {percentile}")
        self.min_observed, self.percentile = min_observed, percentile
        self._latest: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []  # the window's lengths in order
        self.typical = 0  # the output length a new sequence is expected to reach (0: too few finished yet)

    def observe(self, length: int) -> None:
        """Adds a finished sequence's output length; the oldest one of a full window drops out."""
        if len(self._latest) == self._latest.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._latest[0])]
        self._latest.append(length)
        bisect.insort(self._sorted, length)
        count = len(self._sorted)
        self.typical = self._sorted[count * self.percentile // 100] if count >= self.min_observed else 0

    def expected_output(self, so_far: int) -> int:
        """The output length a sequence that has generated `so_far` tokens is expected to reach: the typical length
        while short of it, past it the tail percentile of the finished lengths beyond `so_far`; `so_far` itself
        without an estimate, or when no finished length is longer."""
        if not self.typical:
            return so_far
        if so_far < self.typical:
            return self.typical
        first = bisect.bisect_right(self._sorted, so_far)  # the lengths beyond it: from here on, not copied
        beyond = len(self._sorted) - first
        return self._sorted[first + beyond * TAIL_PERCENTILE // 100] if beyond else so_far

    def entry(self, seq: Sequence, max_model_len: int, held: int | None = None) -> Growing:
        """The sequence as the reserve sees it: the tokens it knows (prompt and output so far, computed or not),
        those it is expected to hold when it ends (no further than its own limit), and whether it is still short
        of the typical length. `held`: its blocks when not its table's (a sequence admitted in the step being
        planned: those it reuses from the prefix cache, not the free ones it takes)."""
        known, prompt = len(seq.token_ids), seq.num_prompt_tokens
        limit = min(seq.request.max_len, max_model_len)
        end = max(known, min(limit, prompt + self.expected_output(known - prompt)))
        return Growing(len(seq.block_table) if held is None else held, known, end,
                       frees=known - prompt < self.typical or not self.typical)


def forked_growth(first: Growing, block_size: int) -> Growing:
    """A sample forked from `first` once its prompt is computed: it shares the prompt's full blocks (neither taken
    nor given back by it) and grows its own output past them to the same expected end."""
    shared = first.known // block_size * block_size
    return Growing(0, first.known - shared, first.end - shared, first.frees)


def sharing_once(family: list[Growing], shared: int, block_size: int) -> list[Growing]:
    """Running samples of one request, which share the blocks of its prompt's first `shared` tokens: the one
    expected to end last is reckoned with them, the others without (as `forked_growth`), so that the shared blocks
    count as given back when the last ends, not when the first does (they are still held until then)."""
    blocks = shared // block_size
    if len(family) < 2 or not blocks:
        return family
    last = max(range(len(family)), key=lambda i: family[i].end - family[i].known)
    return [s if i == last else Growing(max(0, s.held - blocks), s.known - blocks * block_size,
                                        s.end - blocks * block_size, s.frees)
            for i, s in enumerate(family)]


def total_growth(seqs: list[Growing], block_size: int) -> int:
    """Blocks the sequences would take beyond those they hold, were they all to reach their expected ends at once:
    the reserve's upper bound, cheap to reckon."""
    return sum(max(0, blocks_for(s.end, block_size) - s.held) for s in seqs)


def peak_growth(seqs: list[Growing], block_size: int) -> int:
    """The most blocks the sequences are expected to take at any one time beyond those they hold, if each grows a
    token a step until its expected end and then frees every block it holds; one that does not free them (or has
    nothing more to grow) counts its growth in full throughout. Just before a sequence ends the others have grown
    the most since the last one freed its blocks, so the peak is at one of those moments; the blocks at each are
    bounded by a ceiling over the sum rather than summed per sequence (a block too many at most per sequence,
    never too few), so that the whole is a sort and one pass."""
    ending = [s for s in seqs if s.frees and s.end > s.known]
    steady = total_growth([s for s in seqs if not s.frees or s.end <= s.known], block_size)
    growing = sorted((s.end - s.known, s.known) for s in ending)
    held = sum(s.held for s in ending)  # what they hold now, and give back as each ends
    known, alive, peak = sum(s.known for s in ending), len(ending), 0
    for remaining, seq_known in growing:  # `remaining` steps from now it ends; those after it in order still grow
        peak = max(peak, (known + alive * (remaining + block_size - 1)) // block_size - held)
        known, alive = known - seq_known, alive - 1
    return steady + peak
