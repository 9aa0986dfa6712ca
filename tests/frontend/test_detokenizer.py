"""Streaming detokenization and stop strings, against the real SmolLM2 tokenizer and tiny in-test ones."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.executor.model.registry import resolve_model
from pagedserve.services.executor.model.tokenizer import load_tokenizer
from pagedserve.services.frontend.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello, world! The quick brown fox.",
    " leading spaces and  double  spaces",
    "café, naïve, Ærøskøbing, São Paulo",
    "北京欢迎你。日本語のテキスト、한국어",
    "llamas 🦙🚀 and flags 🇫🇷 and 👩‍👩‍👧 families",
    "combining e\u0301 a\u0308 n\u0303 and zalgo z\u0351\u0352\u0353",
    "lines\nand\n\nblank lines\r\n\ttabs",
    "🦙",
]
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerFast:
    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def tiny_bpe() -> PreTrainedTokenizerFast:
    """Byte-level BPE with 300 ids, trained on ASCII: every non-ASCII character is split into byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>", "<sep>"], show_progress=False)
    tokenizer.train_from_iterator(["hello world, the quick brown fox jumps"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def stream(tokenizer, ids, chunks=None, prompt=(), skip_special_tokens=True):
    """Stream `ids` in chunks of the given sizes (default: one token at a time); returns the deltas."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    deltas, start = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detokenizer.add(ids[start : start + size]))
        start += size
    assert start >= len(ids)
    deltas.append(detokenizer.flush())
    return deltas


def random_chunks(rng, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 2, 3, 5, 8]))
    return sizes


def check_stream(tokenizer, ids, deltas, skip_special_tokens=True):
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    assert "".join(deltas) == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in d for d in deltas), deltas


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_token_by_token_and_random_chunks_equal_decode(smollm2, text):
    ids = smollm2.encode(text, add_special_tokens=False)
    assert smollm2.decode(ids) == text  # clean-up is off for this tokenizer: plain decode is the reference
    check_stream(smollm2, ids, stream(smollm2, ids))
    rng = random.Random(text)
    for _ in range(5):
        check_stream(smollm2, ids, stream(smollm2, ids, random_chunks(rng, len(ids))))


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_bpe_byte_tokens_never_emit_a_replacement_character(tiny_bpe, text):
    ids = tiny_bpe.encode(text)
    assert tiny_bpe.decode(ids) == text
    deltas = stream(tiny_bpe, ids)
    check_stream(tiny_bpe, ids, deltas)
    assert deltas[-1] == ""  # nothing left for flush: the text ends on a whole character


def test_emoji_is_held_until_its_last_byte(tiny_bpe):
    ids = tiny_bpe.encode("a🦙")
    assert len(ids) == 5  # "a" and one token per byte of the 4-byte emoji
    assert stream(tiny_bpe, ids) == ["a", "", "", "", "🦙", ""]


def test_special_tokens_inside_a_character(tiny_bpe):
    llama = tiny_bpe.encode("🦙")
    sep = tiny_bpe.convert_tokens_to_ids("<sep>")
    ids = tiny_bpe.encode("hi ") + llama[:2] + [sep, sep] + llama[2:] + tiny_bpe.encode(" ok")
    assert "".join(stream(tiny_bpe, ids)) == "hi 🦙 ok"
    # Kept, a special token cuts the byte run: decode itself yields U+FFFD, and so must the stream.
    kept = stream(tiny_bpe, ids, skip_special_tokens=False)
    check_stream(tiny_bpe, ids, kept, skip_special_tokens=False)
    assert REPLACEMENT in "".join(kept)


def test_flush_emits_an_incomplete_character_as_decode_does(smollm2, tiny_bpe):
    for tokenizer in (smollm2, tiny_bpe):
        ids = tokenizer.encode("ok 🦙", add_special_tokens=False)[:-1]
        deltas = stream(tokenizer, ids)
        assert deltas[-1].endswith(REPLACEMENT) and REPLACEMENT not in "".join(deltas[:-1])
        check_stream(tokenizer, ids, deltas)


def test_prompt_context_keeps_the_leading_space(smollm2):
    prompt = smollm2.encode("Hello", add_special_tokens=False)
    generated = smollm2.encode(" world", add_special_tokens=False)
    assert stream(smollm2, generated, prompt=prompt)[0] == " world"


def test_prompt_ending_inside_a_character(tiny_bpe):
    ids = tiny_bpe.encode("say 🦙 now")
    for cut in range(1, len(ids)):  # some cuts fall inside the emoji's bytes
        prompt, generated = ids[:cut], ids[cut:]
        check_stream(tiny_bpe, generated, stream(tiny_bpe, generated, prompt=prompt))


def test_sentencepiece_style_decoder_keeps_the_space_in_context():
    """A Metaspace decoder drops the leading space of the first token it sees: the window starting in the
    prompt is what keeps it, so the stream reads as `decode(prompt + generated)` after `decode(prompt)`."""
    vocab = {"▁Hello": 0, "▁world": 1, "▁again": 2, "<unk>": 3, "▁.": 4}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    metaspace = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", clean_up_tokenization_spaces=True
    )
    assert metaspace.decode([1, 2]) == "world again"
    assert stream(metaspace, [1, 2], prompt=[0]) == [" world", " again", ""]
    assert stream(metaspace, [1, 2]) == ["world", " again", ""]
    # This tokenizer's own clean-up would rewrite " ." into "."; the stream decodes with clean-up off.
    assert metaspace.decode([0, 4]) == "Hello."
    assert stream(metaspace, [0, 4]) == ["Hello", " .", ""]


class CountingTokenizer:
    """Delegates decode and records how many ids each call decoded."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_the_rust_decode_is_the_wrappers_with_clean_up_off(smollm2):
    """The detokenizer calls a fast tokenizer's Rust `decode` directly: on random windows of ids (special ones
    included), with and without skipping special tokens, it gives what transformers' decode gives."""
    rng = random.Random(7)
    specials = list(smollm2.all_special_ids)
    for _ in range(3000):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(smollm2))
               for _ in range(rng.randint(1, 9))]
        for skip in (True, False):
            assert smollm2.backend_tokenizer.decode(ids, skip_special_tokens=skip) == smollm2.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (ids, skip)


def test_decode_window_stays_small(smollm2):
    counting = CountingTokenizer(smollm2)
    text = " ".join(TEXTS) * 4
    ids = smollm2.encode(text, add_special_tokens=False)
    assert len(ids) > 400
    prompt = smollm2.encode("The answer is", add_special_tokens=False)
    check_stream(smollm2, ids, stream(counting, ids, prompt=prompt))
    assert max(counting.lengths) <= 10  # a few tokens: 4-byte characters split into bytes, plus the new one
    # A long run of skipped special tokens adds no text, and does not widen the window either.
    counting.lengths.clear()
    eos = smollm2.eos_token_id
    run = ids[:3] + [eos] * 200 + ids[3:6]
    check_stream(smollm2, run, stream(counting, run))
    assert max(counting.lengths) <= 10


def test_add_after_flush_is_refused(smollm2):
    detokenizer = IncrementalDetokenizer(smollm2)
    assert detokenizer.add(smollm2.encode("hi", add_special_tokens=False)) == "hi"
    assert detokenizer.flush() == "" and detokenizer.flush() == ""
    with pytest.raises(ValueError, match="flush"):
        detokenizer.add([1])


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=40), prompt_text=st.text(max_size=10), seed=st.integers(0, 2**32 - 1))
def test_property_random_text_streams_to_decode(smollm2, text, prompt_text, seed):
    rng = random.Random(seed)
    ids = smollm2.encode(text, add_special_tokens=False)
    prompt = smollm2.encode(prompt_text, add_special_tokens=False)
    check_stream(smollm2, ids, stream(smollm2, ids, random_chunks(rng, len(ids)), prompt=prompt))


@settings(max_examples=50, deadline=None)
@given(text=st.text(min_size=1, max_size=20), cut=st.integers(0, 100), seed=st.integers(0, 2**32 - 1))
def test_property_byte_tokens_cut_anywhere(tiny_bpe, text, cut, seed):
    """Every non-ASCII character is several byte tokens here, and the prompt/output cut may split one."""
    ids = tiny_bpe.encode(text)
    cut %= len(ids) + 1
    prompt, generated = ids[:cut], ids[cut:]
    chunks = random_chunks(random.Random(seed), len(generated))
    check_stream(tiny_bpe, generated, stream(tiny_bpe, generated, chunks, prompt=prompt))


# ---- stop strings ------------------------------------------------------------------------------------


def feed_all(matcher, deltas):
    out = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_string_spanning_deltas():
    out, stopped = feed_all(StopStringMatcher(["</answer>"]), ["The answer is 42</", "ans", "wer> and more"])
    assert stopped and "".join(out) == "The answer is 42"
    assert out[0] == "The answer is 42"  # "</" is held back from the first delta


def test_overlapping_prefixes_stop_at_the_first_complete_string():
    matcher = StopStringMatcher(["ab", "abc", "xyz"])
    assert matcher.feed("a") == ("", False)
    assert matcher.feed("b") == ("", True)


def test_stop_string_at_the_very_start():
    assert StopStringMatcher(["\n\n"]).feed("\n\nrest") == ("", True)


def test_held_back_text_released_by_flush():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.flush() == "STO"
    assert matcher.flush() == ""


def test_a_held_back_prefix_that_breaks_is_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("AR") == ("STAR", False)


def test_multiple_stop_strings_first_to_complete_wins():
    assert StopStringMatcher(["world", "lo"]).feed("hello world") == ("hel", True)
    # "bcd" completes before "abcde", although "abcde" starts first: the same as when fed a character at a time.
    assert StopStringMatcher(["abcde", "bcd"]).feed("xabcdef") == ("xa", True)
    out, stopped = feed_all(StopStringMatcher(["abcde", "bcd"]), list("xabcdef"))
    assert stopped and "".join(out) == "xa"
    # Two complete at once: the longer one wins, which emits less.
    assert StopStringMatcher(["bc", "abc"]).feed("xabcd") == ("x", True)


def test_no_stop_strings_pass_everything_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_feed_after_stop_is_refused():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == ("a", True)
    assert matcher.flush() == ""
    with pytest.raises(ValueError):
        matcher.feed("more")


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        ([""], r"stop\[0\]: .*empty"),
        (["ok", ""], r"stop\[1\]: .*empty"),
        (["x" * 257], r"stop\[0\]: .*256 characters, got 257"),
        ([f"s{i}" for i in range(17)], r"stop: at most 16 stop strings, got 17"),
    ],
)
def test_stop_validation(stop, message):
    with pytest.raises(InvalidRequest, match=message):
        StopStringMatcher(stop)


def test_stop_limits_are_inclusive():
    StopStringMatcher([f"s{i}" for i in range(16)])
    StopStringMatcher(["x" * 256])


def reference_stop(text, stops):
    """The text before the occurrence that completes first (ties: the longest), and whether one did."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[: min(ends)[1]], True) if ends else (text, False)


@settings(max_examples=50, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=30),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_stop_matching_ignores_how_text_is_cut(text, stops, seed):
    rng = random.Random(seed)
    deltas, start = [], 0
    while start < len(text):
        size = rng.randint(0, 5)
        deltas.append(text[start : start + size])
        start += size
    out, stopped = feed_all(StopStringMatcher(stops), deltas)
    assert ("".join(out), stopped) == reference_stop(text, stops)
