"""The committed generated protobuf code must be exactly what the .proto files produce."""

import subprocess
import sys
from pathlib import Path

import pagedserve


def test_generated_code_is_current() -> None:
    script = Path(pagedserve.__file__).parent / "protos" / "generate.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_package_does_not_expose_a_top_level_operator() -> None:
    import operator

    assert hasattr(operator, "itemgetter")  # the standard library's, not ./operator
    import pagedserve.operator  # noqa: F401  (the project's lives under the package)
