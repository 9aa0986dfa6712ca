#!/usr/bin/env bash
# The first time a GPU is at hand: everything that needs one, in one run of under ten minutes.
#
#   scripts/gpu-check.sh [OUT_DIR]        (after `make install`; default OUT_DIR: gpu-check)
#
# Runs, each with its own time limit, writing OUT_DIR/<step>.log and OUT_DIR/<step>.json:
#   kernel-tests   the kernel tests compiled for the device (not the interpreter)
#   kernels        bench kernels: decode bandwidth vs the device's copy bandwidth, vs SDPA on unpaged K/V
#   model          bench model: SmolLM2 in bf16 and fp16 (Triton kernels) vs HF transformers, greedy + logprobs
#   executor       bench executor on the GPU (bf16): throughput vs HF generate(), a decode step vs its matmuls and its bound
#   serve          bench serve on the GPU: the three-process stack under the ShareGPT-shaped workload
#   overhead       bench overhead with the real executor on the GPU (64 and 256 sequences), overlapped/serial
#   overhead-cores bench overhead with the stand-in on this host's many cores (no GPU): the design's own overhead,
#                  without the two-core contention of CI machines; host-step: the same steps' CPU in one process
# then OUT_DIR/gpu.md: one table of every step's status and its JSON keys, for docs/gpu.md.
# Without a visible CUDA GPU it says so and exits 2 before running anything.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
PY=${PYTHON:-.venv/bin/python}
unset TRITON_INTERPRET

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: no CUDA GPU is visible here (torch.cuda.is_available() is False); nothing was run." >&2
  echo "gpu-check: run it on a machine with an NVIDIA GPU and its driver (nvidia-smi works)." >&2
  exit 2
fi
mkdir -p "$OUT"
{ nvidia-smi || true; "$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; } \
  > "$OUT/device.txt" 2>&1

status=0
step() {  # step NAME SECONDS COMMAND...: runs it, records its exit code
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name $rc $((SECONDS - start))" >> "$OUT/steps.txt"
  echo "gpu-check: $name: exit $rc in $((SECONDS - start)) s" >&2
  [ "$rc" -eq 0 ] || status=1
}
: > "$OUT/steps.txt"
bench() { "$PY" -m pagedserve bench "$@"; }

# the CPU's C kernels (test_cpu_native.py, test_cpu_layer_ops.py): CI runs them; the GPU image may have no compiler
step kernel-tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels --ignore=tests/kernels/test_cpu_native.py --ignore=tests/kernels/test_cpu_layer_ops.py
step kernels 60 bench kernels --json --out "$OUT/kernels.json"
step model 90 bench model --device cuda --dtypes bfloat16,float16 --json --out "$OUT/model.json"
step executor 90 bench executor --device cuda --dtype bfloat16 --repeats 1 --decode-bound --json --out "$OUT/executor.json"
step serve 120 bench serve --device cuda --json --out "$OUT/serve.json" --plot "$OUT/serve.png"
step overhead 120 bench overhead --device cuda --seqs 64,256 --repeats 1 --json --out "$OUT/overhead.json"
step overhead-cores 60 bench overhead --seqs 64,256 --step-ms 10,2 --modes overlap --repeats 1 --json --out "$OUT/overhead-cores.json"
step host-step 30 bench host-step --seqs 1,64,256 --json --out "$OUT/host-step.json"

"$PY" - "$OUT" <<'EOF' > "$OUT/gpu.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("# GPU check\n\n```\n" + (out / "device.txt").read_text().strip() + "\n```\n")
print("| step | exit | seconds |\n| --- | --- | --- |")
for line in (out / "steps.txt").read_text().split("\n"):
    if line:
        print("| {} | {} | {} |".format(*line.split()))
for path in sorted(out.glob("*.json")):
    print(f"\n## {path.stem}\n\n| key | value |\n| --- | --- |")
    for key, value in json.loads(path.read_text()).items():
        print(f"| `{key}` | {json.dumps(value)} |")
EOF
echo "gpu-check: results in $OUT/ (gpu.md: the table)" >&2
exit $status
