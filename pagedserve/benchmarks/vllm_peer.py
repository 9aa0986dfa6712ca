"""Where the benchmarks' peers live and how vLLM is started at its best: shared by bench offline and bench serve,
without torch (bench serve never imports it)."""

from __future__ import annotations

from pathlib import Path

# the peers live in the repository (benchmarks/peers/), never in the wheel: `--peer` runs from a checkout
PEERS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
DEFAULT_VLLM_VENV = PEERS_DIR / ".venv-vllm"


def vllm_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"--peer vllm: no vLLM venv at {venv}; create it with benchmarks/peers/setup-vllm.sh "
                         "(or give --peer-venv)")
    return python


def tuned_preloads(venv: Path) -> tuple[list[str], list[str]]:
    """What vLLM's CPU docs ask to preload, found on this machine (tcmalloc: Debian's libtcmalloc-minimal4;
    libiomp5: PyPI's intel-openmp in the peer venv), and the names of those missing."""
    found, missing = [], []
    tcmalloc = [Path(d) / "libtcmalloc_minimal.so.4" for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")]
    iomp = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so"))
    for name, candidates in (("libtcmalloc_minimal.so.4", tcmalloc), ("libiomp5.so", iomp)):
        present = [c for c in candidates if c.is_file()]
        if present:
            found.append(str(present[0]))
        else:
            missing.append(name)
    return found, missing
