"""docs/structure.md names every module of the package, and nothing that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

import pagedserve

ROOT = Path(pagedserve.__file__).parents[1]
PACKAGE = ROOT / "pagedserve"
DOC = ROOT / "docs" / "structure.md"
# what is generated or only marks a package: named through its source or folder instead
UNNAMED = re.compile(r"(_pb2\.py|_pb2_grpc\.py|\.pyi|/__init__\.py)$")
OWN_FILES = {".py", ".c", ".h", ".proto", ".sh"}


def named_paths() -> set[str]:
    """Every backticked path in the first column of the doc's tables."""
    names: set[str] = set()
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names.update(name for name in re.findall(r"`([^`]+)`", first_cell) if "/" in name or "." in name)
    return names


def resolve(name: str) -> Path | None:
    """A name is relative to the package folder, or else to the repository root."""
    for base in (PACKAGE, ROOT):
        if (base / name).exists():
            return base / name
    return None


def test_every_named_path_exists() -> None:
    missing = sorted(name for name in named_paths() if resolve(name) is None)
    assert not missing, f"docs/structure.md names what does not exist: {missing}"


def test_every_module_is_named() -> None:
    resolved = [path for path in map(resolve, named_paths()) if path is not None]
    named_files = {path for path in resolved if path.is_file()}
    named_dirs = [path for path in resolved if path.is_dir()]
    candidates = [path for path in PACKAGE.rglob("*") if path.suffix in OWN_FILES and "__pycache__" not in path.parts]
    candidates += [path for folder in ("scripts", "benchmarks/peers") for path in (ROOT / folder).iterdir()
                   if path.suffix in OWN_FILES]
    candidates += [path for path in (ROOT / "tests").iterdir() if path.is_dir() and path.name != "__pycache__"]
    unnamed = sorted(
        str(path.relative_to(ROOT)) for path in candidates
        if path not in named_files and path not in named_dirs
        and not any(file.is_relative_to(path) for file in named_files)  # a folder of tests named file by file
        and not (path.is_file() and UNNAMED.search(str(path)) and path != PACKAGE / "__init__.py")
        and not (path.is_file() and path.is_relative_to(ROOT / "tests"))
    )
    assert not unnamed, f"docs/structure.md misses: {unnamed}"


def test_the_check_sees_the_tree() -> None:
    """Both checks above would pass on an empty table: the doc must name the core modules."""
    names = named_paths()
    assert {"services/block_manager/block_pool.py", "operator/policy.py", "cli.py"} <= names
    assert resolve("services/block_manager/block_pool.py") == PACKAGE / "services/block_manager/block_pool.py"
