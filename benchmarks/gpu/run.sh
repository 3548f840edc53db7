#!/usr/bin/env bash
# The GPU check in one call (at most ~8 minutes): on a CUDA machine with PyTorch and Triton,
# run the GPU-marked tests and the GPU benchmarks, and write everything under $OUT.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu/run.sh
#
# What it needs that a CUDA image may lack is installed from wheels in .whl/ when that folder
# exists (an offline machine: fetch them beforehand with `pip download`), else from the
# package index. The machine's own torch is used: if it is outside kvarn_compile's tested
# range, KVARN_ALLOW_UNTESTED_TORCH=1 lets the compiler integration run with a warning (the
# versions land in $OUT/env.json). Triton runs compiled (TRITON_INTERPRET=0), not
# interpreted as in CPU CI. Without a GPU (a dry run) every step still runs: the GPU tests
# and benchmarks say they skipped.
#
# Outputs: env.json, gpu-tests.log + gpu-tests.xml, bench_decode_attention_gpu.json,
# summary.json (each step's exit status and seconds).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export KVARN_ALLOW_UNTESTED_TORCH=1 PYTHONUNBUFFERED=1
# compiled Triton on a GPU; on a CPU-only machine (a dry run) the interpreter, as in CI
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=0
else
    export TRITON_INTERPRET=1
fi
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$OUT/inductor-cache}"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvarn-site .whl/*.whl
    export PYTHONPATH="/tmp/kvarn-site:${PYTHONPATH:-}"
else
    # only what the image may lack; --no-deps keeps the machine's torch
    "$PY" -m pip install -q --no-deps expecttest gguf 2>/dev/null || true
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

summary="$OUT/summary.json"
echo "{" > "$summary"
step() {   # step NAME TIMEOUT_S COMMAND...: run, log exit status and seconds
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "  \"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - t0))}," >> "$summary"
    echo "[gpu-check] $name: rc=$rc in $((SECONDS - t0)) s" >&2
}

"$PY" - > "$OUT/env.json" <<'EOF'
import json, torch
env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
try:
    import triton
    env["triton"] = triton.__version__
except Exception as err:  # noqa: BLE001
    env["triton"] = f"unavailable: {err}"
if torch.cuda.is_available():
    env["device"] = torch.cuda.get_device_name()
    env["capability"] = "sm%d%d" % torch.cuda.get_device_capability()
print(json.dumps(env, indent=1))
EOF
cat "$OUT/env.json" >&2

step gpu_tests 300 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider -x \
    --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
tail -5 "$OUT/gpu-tests.log" >&2
step bench_decode_attention 150 "$PY" benchmarks/bench_decode_attention_gpu.py --quick \
    > "$OUT/bench_decode_attention_gpu.json"
echo "  \"out\": \"$OUT\"" >> "$summary"
echo "}" >> "$summary"
cat "$summary" >&2
