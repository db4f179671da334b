#!/usr/bin/env bash
# The GPU measurements this project needs next, in order of need, within a time budget: for a GPU machine held for
# minutes, where `make gpu-check` (the whole suite compiled for the GPU, then every benchmark) takes far longer.
#
#   bench/gpu_quick.sh [OUT] [BUDGET_S]      # default bench/results/gpu, 540 s
#
# Each step runs under `timeout` with what is left of the budget, and a step that would start with under 30 s left is
# skipped; a step's failure is logged and the next one runs. The log is OUT/gpu-quick.log, each benchmark's JSON
# beside it. Every step shares one persistent compilation cache (JAX_COMPILATION_CACHE_DIR), so a rerun after a time
# limit loads the executables compiled before it instead of compiling them again.
#
# GPU_PYTHON (default python3) is a Python whose JAX has CUDA. Python packages it lacks travel as wheels: `make
# gpu-wheels` downloads the ones a stock JAX image lacks (msgspec, gguf, websockets) into .whl/ (git-ignored), and
# this script installs whatever .whl/ holds into a scratch folder first.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu}
BUDGET=${2:-540}
PY=${GPU_PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu-quick.log"
: >"$LOG"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/gdnspec-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export PYTHONUNBUFFERED=1
start=$(date +%s)

say() { echo "$*" | tee -a "$LOG"; }

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS (or what is left of the budget).
step() {
    local name=$1 limit=$2 left rc
    shift 2
    left=$((BUDGET - ($(date +%s) - start)))
    if ((left < 30)); then
        say "== $name: skipped, ${left} s of the budget left"
        return 0
    fi
    ((limit > left)) && limit=$left
    say "== $name (at most ${limit} s): $*"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    say "== $name: exit $rc after $(($(date +%s) - start)) s"
    return $rc
}

if compgen -G ".whl/*.whl" >/dev/null; then
    step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gdnspec-site .whl/*.whl && export PYTHONPATH="/tmp/gdnspec-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# Whether JAX sees the GPU, outside the budget; GDNSPEC_GPU_QUICK_ANY_BACKEND=1 runs the steps on whatever backend
# JAX has (a dry run of this script on a CPU).
say "== device: $PY"
if ! timeout 120 "$PY" -c "import jax, os; print(jax.__version__, jax.devices()); \
assert jax.default_backend() == 'gpu' or os.environ.get('GDNSPEC_GPU_QUICK_ANY_BACKEND') == '1'" >>"$LOG" 2>&1; then
    say "no GPU backend: stopping"
    exit 1
fi
# Whether Runtime.compile's side-by-side compilations serve the calls under this JAX (every warm-up relies on it).
step compiled-side-by-side 120 "$PY" -m pytest -q -x tests/test_model_drafters.py -k compiled_side
# What an iteration costs by kind (plain, the head's catch-up, lookup, mtp) on one row: XLA's GPU while loop reads
# its condition on the host each trip, and an MTP iteration runs several loops.
step iteration-cost 150 "$PY" -m bench.iteration_cost --rounds 5 --out "$OUT/iteration-cost.json"
# The same with loops and conditionals in CUDA graphs, their conditions evaluated on the device.
step iteration-cost-command-buffers 150 env \
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
    "$PY" -m bench.iteration_cost --rounds 5 --out "$OUT/iteration-cost-command-buffers.json"
# Block-quantized weights on the GPU (a llama-quantize Q4_K_M of the bundled target, carried in tests/data): the
# file's bytes dequantized inside each step, against bf16 copies made at load.
step step-q4_k_m 120 "$PY" -m bench.step --model tests/data/bundled-target-q4_k_m.gguf --batches 1,32 \
    --verify-t 1,4 --rounds 3 --out "$OUT/step-bundled-q4_k_m.json"
step step-q4_k_m-bf16 120 "$PY" -m bench.step --model tests/data/bundled-target-q4_k_m.gguf --batches 1,32 \
    --verify-t 1,4 --rounds 3 --dequantize-at-load --out "$OUT/step-bundled-q4_k_m-bf16.json"
# End to end: does speculation pay at one stream (one batch size to compile), then `mtp,ngram` at 16 streams, whose
# last GPU run predates a fix (docs/performance.md, "On a GPU").
step speculation-1 300 "$PY" -m bench.speculation --streams 1 --drafters "plain;mtp;ngram;mtp,ngram" --repeats 1 \
    --out "$OUT/speculation-quick-1.json"
step speculation-16 300 "$PY" -m bench.speculation --streams 16 --drafters "plain;mtp,ngram" --repeats 1 \
    --out "$OUT/speculation-quick-16.json"
say "== done after $(($(date +%s) - start)) s"
