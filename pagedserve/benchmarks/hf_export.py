"""A pagedserve model (a registered name, a GGUF file or an HF directory) as a Hugging Face directory that
other engines load: config.json, model.safetensors (fp32), generation_config.json and the tokenizer files.

transformers reads the GGUF itself (`from_pretrained(folder, gguf_file=name)`, dequantized to fp32, for
the model and the tokenizer alike) and `save_pretrained` writes the directory. The result is cached by the
weights digest, `<cache>/<name>-<digest>`, so a re-exported or replaced file gets a new directory. A
directory is only ever complete: it is written beside its final name and renamed at the end.

    python -m pagedserve.benchmarks.hf_export [MODEL] [--cache-dir DIR]   (prints the directory)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# beside the CPU kernels' cache (kernels/cpu_native.py), never inside the installed package
DEFAULT_CACHE_DIR = Path(os.environ.get("PAGEDSERVE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or
                         Path.home() / ".cache") / "pagedserve") / "hf-models"


def export_hf(model: str = "smollm2-135m", cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The Hugging Face directory of `model`, exported on first use. An HF directory is returned as it is."""
    # absolute, so that the file also runs as a script by its path
    from pagedserve.services.executor.model.registry import resolve_model

    source = resolve_model(model)
    if source.kind == "hf":
        return source.path
    target = cache_dir / f"{source.name}-{source.digest.removeprefix('sha256:')[:16]}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private
        _save_from_gguf(source.path, staging)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target  # if a concurrent export won the rename, its directory is just as good


def _save_from_gguf(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
    model: Any = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it, but for an architecture
    # its GGUF quantizer does not keep in blocks the weights are already plain fp32 tensors (checked here).
    assert all(p.dtype == torch.float32 for p in model.parameters()), "GGUF weights left packed: not exportable"
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="a registered name, .gguf file or HF dir")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    print(export_hf(args.model, args.cache_dir))


if __name__ == "__main__":
    main()
