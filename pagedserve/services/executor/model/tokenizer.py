"""The model's own tokenizer and chat template, from its Hugging Face directory or from its GGUF metadata.

Without `AutoTokenizer`: its module imports transformers' configuration code, and with it torch, and so
does transformers' GGUF reader; the frontend tokenizes in a container that must not load torch. So a
GGUF's tokenizer metadata is read by `gguf_file` and handed to the builder transformers itself uses for
GGUF files; a directory's tokenizer.json is loaded as it is, by the generic fast tokenizer class (for the
byte-level vocabularies of Llama 3, Qwen2 and SmolLM2, AutoTokenizer's per-model classes rebuild the same).

`local_files_only`: a model given as a local path must never reach out to a hub (none is reachable in
production pods anyway, and a silent download would change what is served).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

from .gguf_file import GGUFFile
from .registry import ModelSource

# special token -> the GGUF key of its id
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerFast:
    if source.kind == "gguf":
        return _tokenizer_from_gguf(source.path)
    return PreTrainedTokenizerFast.from_pretrained(source.path, local_files_only=True)


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


def _tokenizer_from_gguf(path: Path) -> PreTrainedTokenizerFast:
    """What `AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)` builds (same vocabulary,
    merges, special tokens and chat template)."""
    gguf = GGUFFile(path)
    metadata = {key: value for key, value in gguf.metadata.items() if key.startswith("tokenizer.")}
    vocabulary, config = (
        {name: metadata[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING[group].items()
         if f"tokenizer.{key}" in metadata}
        for group in ("tokenizer", "tokenizer_config")
    )
    if vocabulary.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary by default
        config.setdefault("add_bos_token", True)
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        config[name] = vocabulary["tokens"][metadata[key]] if key in metadata else None
    backend, extra = convert_gguf_tokenizer(gguf.metadata["general.architecture"], vocabulary)
    return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=str(path.parent), **config, **extra)
