"""A plain (non-editable) build ships the `pagedserve` package and nothing else; only the executor loads torch."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import pagedserve
from pagedserve.kernels.cpu_native import HEADERS, SOURCES


def test_wheel_ships_the_package_and_nothing_else(tmp_path: Path) -> None:
    root = Path(pagedserve.__file__).parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(root)],
        check=True, timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("pagedserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"pagedserve"}, top_level
    kernel_sources = [f"kernels/{path.name}" for path in (*SOURCES, *HEADERS)]  # what the CPU kernels build from
    for module in ("cli.py", "operator/__init__.py", "kernels/__init__.py", "services/block_manager/manager.py",
                   "protos/block_manager_pb2.py", "protos/block_manager.proto", "benchmarks/blocks.py",
                   *kernel_sources):
        assert f"pagedserve/{module}" in names, module
    assert not any(name.startswith(("pagedserve/tests/", "pagedserve/benchmarks/peers")) for name in names)
    assert not any(name.endswith(("vllm_offline.py", "setup-vllm.sh")) for name in names)  # the peers stay out


# One pod image runs all three containers, but only the executor's may load torch (~300 MB of RSS).
# Each component runs what its container runs at start, short of serving: its CLI, and for the frontend
# the tokenizer of the default model (transformers' AutoTokenizer and GGUF reader import torch).
CONTAINER_STARTS = {
    "frontend": (
        "from pagedserve.cli import build_parser\n"
        "argv = ['frontend', '--block-manager', 'unix:bm.sock', '--executor', 'unix:ex.sock']\n"
        "build_parser(argv).parse_args(argv)\n"
        "from pagedserve.services.executor.model.registry import resolve_model\n"
        "from pagedserve.services.executor.model.tokenizer import load_tokenizer, render_chat\n"
        "render_chat(load_tokenizer(resolve_model('smollm2-135m')), [{'role': 'user', 'content': 'hi'}])\n"
    ),
    "block-manager": (
        "from pagedserve.cli import build_parser\n"
        "argv = ['block-manager', '--geometry-from', 'unix:ex.sock']\n"
        "build_parser(argv).parse_args(argv)\n"
        "import pagedserve.services.block_manager.server\n"
    ),
    # the fleet's router: its CLI, its server module and the tokenizer it hashes prompts with
    "router": (
        "from pagedserve.cli import build_parser\n"
        "argv = ['router', '--endpoints', '127.0.0.1:1,127.0.0.1:2']\n"
        "build_parser(argv).parse_args(argv)\n"
        "import pagedserve.services.router.server\n"
        "from pagedserve.services.executor.model.registry import resolve_model\n"
        "from pagedserve.services.executor.model.tokenizer import load_tokenizer, render_chat\n"
        "render_chat(load_tokenizer(resolve_model('smollm2-135m')), [{'role': 'user', 'content': 'hi'}])\n"
    ),
    "executor": "import pagedserve.services.executor.server\n",
    "operator": (
        "from pagedserve.cli import build_parser\n"
        "argv = ['operator', '--namespace', 'x']\n"
        "build_parser(argv).parse_args(argv)\n"
        "import pagedserve.operator.handlers\n"
    ),
    # not a container: the supervisor of `pagedserve serve`, which only starts the three processes
    "serve": (
        "from pagedserve.cli import build_parser\n"
        "argv = ['serve', '--num-blocks', '64']\n"
        "build_parser(argv).parse_args(argv)\n"
        "import pagedserve.services.frontend.stack\n"
    ),
}


def loaded(component: str, modules: tuple[str, ...] = ("torch",)) -> list[str]:
    """Which of `modules` the component imports, in a fresh interpreter (one component's import of torch
    cannot hide another's)."""
    code = CONTAINER_STARTS[component] + f"import sys; print([m for m in {modules!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return list(ast.literal_eval(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("component", ["frontend", "block-manager", "serve", "router"])
def test_only_the_executor_container_loads_torch(component: str) -> None:
    assert not loaded(component), f"the {component} imported torch"


def test_the_executor_loads_torch() -> None:
    assert loaded("executor") == ["torch"]  # else the check above proves nothing


def test_the_operator_needs_no_model_stack() -> None:
    """`pagedserve operator` runs in a small pod: it must not import torch (or the executor) at all."""
    assert loaded("operator", ("torch", "transformers", "pagedserve.services.executor")) == []
    refused = subprocess.run([sys.executable, "-m", "pagedserve", "operator"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and "--namespace NS (repeatable) or --all-namespaces" in refused.stderr


def test_the_router_runs_no_engine() -> None:
    """`pagedserve router` forwards requests: it must not load the pods' engine, scheduler or block manager."""
    unwanted = ("pagedserve.services.frontend.engine", "pagedserve.services.frontend.scheduler",
                "pagedserve.services.block_manager.manager", "pagedserve.services.executor.runner")
    assert loaded("router", unwanted) == []
