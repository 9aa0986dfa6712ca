"""The model's own tokenizer and chat template, from its Hugging Face directory or from its GGUF metadata.

`local_files_only`: a model given as a local path must never reach out to a hub (none is reachable in
production pods anyway, and a silent download would change what is served).
"""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from .registry import ModelSource


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerFast:
    if source.kind == "gguf":
        # transformers rebuilds a fast tokenizer from the GGUF vocabulary and merges (seconds, once).
        tokenizer = AutoTokenizer.from_pretrained(
            source.path.parent, gguf_file=source.path.name, local_files_only=True
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(f"{source.name}: expected a fast tokenizer, got {type(tokenizer).__name__}")
    return tokenizer


def render_chat(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` ({"role", "content"} dicts) under the model's chat template, ending with
    the assistant's turn opened (the generation prompt)."""
    if tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not the rendered text")
    # The template writes its special tokens itself: adding BOS again would double it.
    return tokenizer.encode(text, add_special_tokens=False)
