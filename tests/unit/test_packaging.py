"""A plain (non-editable) build ships every top-level folder as a subpackage of `pagedserve`, nothing else."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pagedserve


def test_wheel_maps_top_level_folders_under_pagedserve(tmp_path: Path) -> None:
    root = Path(pagedserve.__file__).parent
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(root)],
        check=True, timeout=300, capture_output=True,
    )
    (wheel,) = tmp_path.glob("pagedserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"pagedserve"}, top_level
    for module in ("cli.py", "operator/__init__.py", "kernels/__init__.py", "services/block_manager/manager.py",
                   "protos/block_manager_pb2.py", "protos/block_manager.proto", "benchmarks/blocks.py"):
        assert f"pagedserve/{module}" in names, module
    assert not any(name.startswith("pagedserve/tests/") for name in names)
