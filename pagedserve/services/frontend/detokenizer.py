"""Streaming text: token ids to text deltas (`IncrementalDetokenizer`) and stop strings (`StopStringMatcher`).

Per sample, on the event loop: `text, stopped = stop.feed(detokenizer.add(new_ids))`; at the end of the stream
for another reason, `stop.feed(detokenizer.flush())[0] + stop.flush()` releases what both held back.

Decode settings: every decode here is `tokenizer.decode(ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)` (for a fast tokenizer, its Rust tokenizer's `decode`, which is the
same). The clean-up pass rewrites text across token boundaries (" ." -> "."), so windows cleaned up one at
a time need not add up to the cleaned-up whole. With it off, the deltas of a
byte-level BPE tokenizer concatenate to exactly `decode(generated_ids)` under the same settings (SmolLM2's
tokenizer has clean-up off anyway, so that is its plain `decode`). For a SentencePiece-style tokenizer
(Metaspace decoder) the deltas are `decode(prompt + generated)` minus `decode(prompt)`: the first word keeps
the leading space that a standalone decode of the generated ids drops.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from ..common.errors import InvalidRequest

REPLACEMENT = "\ufffd"  # what a decode yields for UTF-8 bytes it cannot (yet) complete
CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output for word-boundary context (as vLLM)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class IncrementalDetokenizer:
    """Token ids in, text deltas out, with O(1) work per token.

    It keeps a small window of ids, `window[:read]` already turned into text (`prefix_text`) and
    `window[read:]` not yet. Each `add` decodes only the window and emits what it adds beyond `prefix_text`;
    then the window slides to start at the old read point. Decoding from a few tokens back, rather than
    from the new tokens alone, keeps what the decoder does at a word boundary (a SentencePiece decoder
    drops the leading space of the first token it sees).

    A character whose UTF-8 bytes span several tokens decodes to U+FFFD until its last byte arrives: while
    the window's text ends in U+FFFD, nothing is emitted and the window does not slide, so the window
    always starts on a character boundary and its text is an exact slice of the full decode. (A real
    U+FFFD in the output is held only until the next token.) Valid UTF-8 holds back at most 3 bytes, so the
    window stays a few tokens long; only a model emitting endless invalid bytes could widen it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A fast tokenizer's decode with clean-up off is its Rust tokenizer's decode: called directly, without
        # transformers' wrapper, it costs 1.7 µs for a window of 7 ids instead of 4.5 (two per token, per sample,
        # on the event loop that shares the GIL with the engine thread)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        context = list(prompt_token_ids[max(0, len(prompt_token_ids) - CONTEXT_TOKENS) :])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT):
            # The prompt may end inside a character (prompts can be raw ids): its bytes would merge with the
            # output's. The output is then decoded on its own, as `decode(generated_ids)` would.
            context, context_text = [], ""
        self._window: list[int] = context
        self._read = len(context)  # window[:read] is decoded into prefix_text (and emitted, past the context)
        self._prefix_text = context_text
        self._flushed = False

    def add(self, token_ids: Sequence[int]) -> str:
        """The text these tokens add; "" while they end inside a character."""
        if self._flushed:
            raise ValueError("add() after flush(): the stream has ended")
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT):
            return ""
        if len(text) <= len(self._prefix_text):
            # Tokens with no text (skipped special tokens): dropping them changes no decode and keeps the
            # window from growing through a long run of them.
            del self._window[self._read :]
            return ""
        delta = text[len(self._prefix_text) :]
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever is held back, an incomplete character's U+FFFD included."""
        if self._flushed:
            return ""
        self._flushed = True
        if len(self._window) == self._read:
            return ""
        return self._decode(self._window)[len(self._prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens))
        return str(
            self._tokenizer.decode(
                token_ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
            )
        )


class StopStringMatcher:
    """Cuts the text stream at the first stop string, which is not emitted (as OpenAI and vLLM do).

    A stop string may span deltas, so `feed` holds back the longest tail of the text that could still
    grow into one. The match is the occurrence that completes first (ties: the longest), so where the
    stream stops does not depend on how the text was cut into deltas.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):  # one stop string, not a sequence of one-character ones
            stop = [stop]
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for i, s in enumerate(stop):
            if not s:
                raise InvalidRequest(f"stop[{i}]: a stop string must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidRequest(f"stop[{i}]: a stop string has at most {MAX_STOP_CHARS} characters, got {len(s)}")
        self._stops = tuple(dict.fromkeys(stop))
        # Proper prefixes only: a whole stop string in the text is a match, never held back.
        self._prefixes = frozenset(s[:k] for s in self._stops for k in range(1, len(s)))
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._max_held = max((len(s) - 1 for s in self._stops), default=0)
        self._pending = ""
        self._stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string matched). Not to be called again after a match."""
        if self._stopped:
            raise ValueError("feed() after a stop string matched: the stream has ended")
        if not self._stops:
            return delta, False
        text = self._pending + delta
        start = self._match_start(text)
        if start is not None:
            self._stopped, self._pending = True, ""
            return text[:start], True
        cut = len(text) - self._held_length(text)
        self._pending = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """At the end of the stream for another reason: the held-back text, which never became a stop string."""
        held, self._pending = self._pending, ""
        return held

    def _match_start(self, text: str) -> int | None:
        best: tuple[int, int] | None = None  # (end, start) of the match
        for s in self._stops:
            start = text.find(s)  # the first occurrence of one string is also its first to complete
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _held_length(self, text: str) -> int:
        for length in range(min(len(text), self._max_held), 0, -1):
            if text[-length] in self._first_chars and text[-length:] in self._prefixes:
                return length
        return 0
