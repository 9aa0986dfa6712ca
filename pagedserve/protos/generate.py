"""Generate the Python gRPC code for every .proto in this folder, or check that it is current.

The generated files are committed; `make protos` regenerates them, and `--check` (run by `make test` and
the test suite) fails when what is committed differs from what the protos produce, so they cannot go stale.
The protos are compiled from a temporary tree `pagedserve/protos/*.proto`, so that generated imports
read `from pagedserve.protos import x_pb2` and work inside the installed package.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate_into(out_dir: Path) -> list[Path]:
    """Compile all protos into out_dir/pagedserve/protos and return the generated files."""
    from grpc_tools import protoc

    src_root = out_dir / "src"
    package_dir = src_root / "pagedserve" / "protos"
    package_dir.mkdir(parents=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    for proto in protos:
        shutil.copy(proto, package_dir / proto.name)
    gen_root = out_dir / "gen"
    gen_root.mkdir()
    plugin = Path(sys.executable).parent / "protoc-gen-mypy"
    grpc_plugin = Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{src_root}",
        f"-I{include}",
        f"--python_out={gen_root}",
        f"--grpc_python_out={gen_root}",
        f"--plugin=protoc-gen-mypy={plugin}",
        f"--plugin=protoc-gen-mypy_grpc={grpc_plugin}",
        f"--mypy_out={gen_root}",
        f"--mypy_grpc_out={gen_root}",
        *[f"pagedserve/protos/{proto.name}" for proto in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((gen_root / "pagedserve" / "protos").iterdir())


def committed_files() -> list[Path]:
    return sorted(p for p in PROTO_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate_into(Path(tmp))
        if args.check:
            stale = [g.name for g in generated if not (PROTO_DIR / g.name).exists()
                     or (PROTO_DIR / g.name).read_bytes() != g.read_bytes()]
            extra = sorted({p.name for p in committed_files()} - {g.name for g in generated})
            if stale or extra:
                print(f"generated protobuf code is stale: {stale + extra}; run `make protos`", file=sys.stderr)
                return 1
            return 0
        for old in committed_files():
            old.unlink()
        for g in generated:
            shutil.copy(g, PROTO_DIR / g.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
