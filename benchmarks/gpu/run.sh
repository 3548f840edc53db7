#!/usr/bin/env bash
# The GPU check in one call, ending within 8 minutes (KVARN_GPU_CHECK_SECONDS, default 480): on a CUDA machine with PyTorch and Triton
# (as it is: no network, possibly an older torch/triton than the project pins), run the
# GPU-marked tests, the Triton kernel tests on the GPU, a CUDA-graph capture of the decode
# step, the static sm_90 report and the decode benchmark; write everything under $OUT.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu/run.sh
#   KVARN_GPU_STEPS="bench_decode_attention e2e_decode" ... runs only those steps
#   KVARN_GPU_BENCH_ARGS, KVARN_GPU_E2E_LENGTHS, KVARN_GPU_PYTEST_ARGS: the decode benchmark's
#   arguments (--quick), the e2e context lengths (4096 32768), more pytest arguments for the
#   GPU-marked tests (e.g. "-k autotune --tb=long"); KVARN_GPU_E2E_SECONDS: the e2e step's
#   limit (170); KVARN_GPU_PYTEST_WORKERS: pytest-xdist workers of the test steps (8; 0: none)
#
# Missing pure-Python packages (expecttest, gguf on the lent H200 image) come from wheels in
# .whl/ when that folder exists (fetch them beforehand with `pip download --no-deps`); test
# files that still cannot be imported are left out (listed in summary.json), never the run.
# The machine's own torch is used: KVARN_ALLOW_UNTESTED_TORCH=1 lets the compiler integration
# run outside the tested range with a warning (versions in env.json). Triton runs compiled
# (TRITON_INTERPRET=0), not interpreted as in CPU CI. Caches (Inductor, Triton) go to /tmp,
# never under $OUT (only a few files come back from there). summary.json is rewritten, valid,
# after every step, so a run cut short still reports the finished steps.
#
# Outputs (at most 8 files come back from the lent machine): env.json, summary.json, steps.log
# (each step's stderr), tests.log (every pytest run), cuda-graph.json,
# bench_decode_attention_gpu.json, e2e_decode_gpu.json, bench_prefill_attention_gpu.json. The static sm_90 report
# (benchmarks/gpu/static_report.py) needs no GPU and runs where the code is written.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
BUDGET="${KVARN_GPU_CHECK_SECONDS:-480}"     # whole run, start to end
export KVARN_ALLOW_UNTESTED_TORCH=1 PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=0
else
    export TRITON_INTERPRET=1     # a dry run on a CPU machine: the GPU steps say they skipped
fi
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/kvarn-inductor-cache}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/kvarn-triton-cache}"
export KVARN_CACHE_DIR="${KVARN_CACHE_DIR:-/tmp/kvarn-cache}"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvarn-site .whl/*.whl \
        || echo "[gpu-check] wheel install failed" >&2
    export PYTHONPATH="/tmp/kvarn-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

# test files whose imports this machine lacks (e.g. expecttest): left out, not fatal
IGNORE=()
LEFT_OUT=""
if ! "$PY" -c "import expecttest" 2>/dev/null; then
    for f in $(grep -rl "^from expecttest\|^import expecttest" tests); do
        IGNORE+=(--ignore "$f"); LEFT_OUT="$LEFT_OUT $f"
    done
fi

summary="$OUT/summary.json"
STEPS_JSON=""
write_summary() {
    printf '{"out": "%s", "left_out": "%s", "elapsed_s": %d, "steps": {%s}}\n' \
        "$OUT" "${LEFT_OUT# }" "$SECONDS" "${STEPS_JSON#, }" > "$summary.tmp" && mv "$summary.tmp" "$summary"
}
step() {   # step NAME LIMIT_S COMMAND...: run within the limit and what is left of the budget
    local name="$1" limit="$2"; shift 2
    local left=$((BUDGET - SECONDS))
    if [ -n "${KVARN_GPU_STEPS:-}" ] && [[ " $KVARN_GPU_STEPS " != *" $name "* ]]; then
        STEPS_JSON="$STEPS_JSON, \"$name\": {\"rc\": null, \"skipped\": \"not in KVARN_GPU_STEPS\"}"
        write_summary; return
    fi
    if [ "$left" -lt 15 ]; then
        STEPS_JSON="$STEPS_JSON, \"$name\": {\"rc\": null, \"skipped\": \"time budget spent\"}"
        write_summary; return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    echo "===== $name" >> "$OUT/steps.log"
    timeout -k 5 "$limit" "$@" 2>> "$OUT/steps.log"
    local rc=$?
    STEPS_JSON="$STEPS_JSON, \"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit\": $limit}"
    write_summary
    echo "[gpu-check] $name: rc=$rc in $((SECONDS - t0)) s (limit $limit)" >&2
}
write_summary

"$PY" - > "$OUT/env.json" <<'EOF'
import json, sys, torch
env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available()}
from importlib import metadata
for name in ("triton", "transformers", "expecttest", "gguf"):
    try:
        env[name] = metadata.version(name)
    except Exception as err:  # noqa: BLE001
        env[name] = f"unavailable: {type(err).__name__}"
if torch.cuda.is_available():
    env["device"] = torch.cuda.get_device_name()
    env["capability"] = "sm%d%d" % torch.cuda.get_device_capability()
try:
    import kvarn_compile  # noqa: F401
    env["kvarn_import"] = "ok"
except Exception as err:  # noqa: BLE001
    env["kvarn_import"] = f"{type(err).__name__}: {err}"[:400]
print(json.dumps(env, indent=1))
EOF
cat "$OUT/env.json" >&2

# Most telling first: the kernel benchmark (with its sweep of the decode template's configs),
# the model end to end, the Triton kernel tests, a captured decode step, the Inductor
# template tests. Every pytest log goes to tests.log.
run_tests() {   # run_tests LABEL PYTEST-ARGS...: appended to tests.log under a header
    local label="$1"; shift
    echo "===== $label" >> "$OUT/tests.log"
    # -v: each test's outcome is logged as it ends (a step cut at its limit still says which
    # failed); short tracebacks, and one per-test limit where pytest-timeout is installed
    local limit=() workers=()
    "$PY" -c "import pytest_timeout" 2>/dev/null && limit=(--timeout 60)
    # the steps are mostly Triton compiles (CPU-bound): spread over worker processes where
    # pytest-xdist is installed and there is a GPU (KVARN_GPU_PYTEST_WORKERS, default 8; 0: one)
    if [ "$TRITON_INTERPRET" = "0" ] && [ "${KVARN_GPU_PYTEST_WORKERS:-8}" != "0" ] \
            && "$PY" -c "import xdist" 2>/dev/null; then
        workers=(-n "${KVARN_GPU_PYTEST_WORKERS:-8}")
    fi
    "$PY" -m pytest -v --tb=short -p no:cacheprovider -W ignore "${limit[@]}" "${workers[@]}" "$@" \
        >> "$OUT/tests.log" 2>&1
}
export -f run_tests; export OUT PY
# the files that hold GPU-marked tests (collecting the whole tree takes longer than the step)
GPU_FILES=$(grep -rl "pytest.mark.gpu" tests --include="test_*.py" | sort)
step bench_decode_attention 200 "$PY" benchmarks/bench_decode_attention_gpu.py ${KVARN_GPU_BENCH_ARGS:---quick} \
    --out "$OUT/bench_decode_attention_gpu.json" > /dev/null
step e2e_decode "${KVARN_GPU_E2E_SECONDS:-170}" env TORCH_LOGS=perf_hints "$PY" benchmarks/gpu/e2e_decode.py \
    --lengths ${KVARN_GPU_E2E_LENGTHS:-4096 32768} --profile-steps 4 --out "$OUT/e2e_decode_gpu.json" > /dev/null
step triton_tests 90 bash -c 'run_tests "$@"' _ triton_tests tests/kernels/test_triton.py
step cuda_graph 45 "$PY" benchmarks/gpu/check_cuda_graph.py --out "$OUT/cuda-graph.json"
step gpu_tests 80 bash -c 'run_tests "$@"' _ gpu_tests -m gpu $GPU_FILES "${IGNORE[@]}" --continue-on-collection-errors \
    ${KVARN_GPU_PYTEST_ARGS:-}
# the op's one-launch kernel against its reference (last: ~40 configs to compile)
step attention_tests 60 bash -c 'run_tests "$@"' _ attention_tests tests/kernels/test_triton_attention.py
# a prompt's attention against SDPA (last: it runs on what is left of the budget, or alone
# with KVARN_GPU_STEPS=bench_prefill_attention)
step bench_prefill_attention 90 "$PY" benchmarks/bench_prefill_attention_gpu.py \
    --out "$OUT/bench_prefill_attention_gpu.json" > /dev/null
tail -5 "$OUT/tests.log" >&2 2>/dev/null
cat "$summary" >&2
