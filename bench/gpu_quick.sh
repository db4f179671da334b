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
mkdir -p "$OUT" bench/out
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
# The kernels compiled for the GPU, not interpreted: first the fused GDN decode kernel, which every later step takes
# on a GPU; where it fails there, the later steps run XLA's form instead (GDNSPEC_GDN_FUSED=0).
step fused-kernel 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_gdn_decode.py || {
    say "== the fused GDN kernel failed: the later steps run without it"
    export GDNSPEC_GDN_FUSED=0
}
# The 0.8B shape with random bf16 weights (what the GPU runs anyway): decode and verify steps against the roofline,
# and the compiled decode step's kernels (fusions, custom calls, loops) with and without the fused GDN kernel.
MODEL_08B=bench/out/qwen35-0.8b-bf16.gguf
step model-0.8b 60 "$PY" -m api.cli make-random --preset qwen35-0.8b --dtype bf16 "$MODEL_08B"
step step-0.8b 180 "$PY" -m bench.step --model "$MODEL_08B" --batches 1,16 --verify-t 1,4 --rounds 2 --profile \
    --hlo "$OUT/step-0.8b.hlo" --out "$OUT/step-0.8b.json"
# One-row products as pairs of rows (`layers.paired_row_dot`), which XLA keeps as matrix products, against step-0.8b.
step step-0.8b-paired-rows 90 env GDNSPEC_GPU_PAIR_ROWS=1 "$PY" -m bench.step --model "$MODEL_08B" --batches 1 \
    --verify-t 1 --profile --out "$OUT/step-0.8b-paired-rows.json"
# The few-row product kernel (`kernels.row_product`): its tests compiled, then the steps with it, against step-0.8b.
step row-kernel 60 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_row_product.py &&
    step step-0.8b-row-kernel 120 env GDNSPEC_GPU_ROW_KERNEL=1 "$PY" -m bench.step --model "$MODEL_08B" \
        --batches 1,16 --verify-t 1,4 --profile --hlo "$OUT/step-0.8b-row-kernel.hlo" \
        --out "$OUT/step-0.8b-row-kernel.json"
# The speculation table on the bundled model from a cold compilation cache (its warm-up is the cold start), then a
# second process on the same shapes from the warm cache, which holds the step executables themselves too
# (`executor.executables`; `warmup.step_store` counts its loads): its warm-up and wall time bound the time to a first
# token.
step speculation 360 "$PY" -m bench.speculation --streams 1,16 --max-seqs 16 --drafters "plain;mtp;ngram;mtp,ngram" \
    --repeats 2 --out "$OUT/speculation.json"
step warm-start 90 "$PY" -m bench.speculation --streams 1 --max-seqs 16 --drafters plain --repeats 1 \
    --out "$OUT/speculation-warm-start.json"
# The same steps with XLA's form of the GDN layers, for the kernel count and times before the fused kernel.
step step-0.8b-xla-gdn 150 env GDNSPEC_GDN_FUSED=0 "$PY" -m bench.step --model "$MODEL_08B" --batches 1,16 \
    --verify-t 1,4 --rounds 2 --profile --hlo "$OUT/step-0.8b-xla-gdn.hlo" --out "$OUT/step-0.8b-xla-gdn.json"
# The other kernels' tests, compiled.
step kernels 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py
# Block-quantized weights on the GPU (a llama-quantize Q4_K_M of the bundled target, carried in tests/data): the
# file's bytes dequantized inside each step.
step step-q4_k_m 90 "$PY" -m bench.step --model tests/data/bundled-target-q4_k_m.gguf --batches 1,16 \
    --verify-t 1,4 --out "$OUT/step-bundled-q4_k_m.json"
# What an iteration of a looping call costs by kind (plain, the head's catch-up, lookup, mtp). CUDA graphs (XLA's
# command buffers) were measured on the H200 and left out since: no gain for the step, 13-15% off a later
# iteration of every kind alike (docs/performance.md, "On a GPU").
step iteration-cost 120 "$PY" -m bench.iteration_cost --rounds 3 --out "$OUT/iteration-cost.json"
say "== done after $(($(date +%s) - start)) s"
