#!/usr/bin/env bash
# gpu_window.sh: a lent GPU window's plan in one command, built from scripts/gpu_check.sh runs.
#   1. build and data;
#   2. the checks of results at once, as parallel gpu_check.sh runs sharing the one GPU: the op tests and
#      GpuTraining; GpuPrecision, the GPU tests of recomputation, the memory estimate and train.batch_size
#      auto, and the fault tests; compute-sanitizer's memcheck, synccheck and initcheck; racecheck alone
#      (the slowest, its training run at GPU_CHECK_SANITIZER_BATCH rows, 8: on an H100 racecheck takes 4 s a
#      step at 8 rows and 12 s at 32);
#   3. the timings alone on the GPU: start-up, Fashion-MNIST, the benchmark rows (BENCH_ONLY picks them),
#      then one row's top kernels (GPU_CHECK_PROFILE_ROW), where the budget leaves time.
# Each run writes its gpu_check folder and its output under OUT_DIR; OUT_DIR/summary.md joins their summaries.
#
#   scripts/gpu_window.sh [--standin] OUT_DIR
#
# Budgets: GPU_WINDOW_PREPARE_S (120), GPU_WINDOW_PARALLEL_S (250, each parallel run), GPU_WINDOW_TIMING_S
# (215): 585 s at most, so that a second call fits in a 15-minute window. --standin runs the same plan on
# the CPU stand-in with gpu_check.sh's short test lists, to find typos before a window.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
mode=()
[ "${1:-}" = --standin ] && mode=(--standin) && shift
[ $# -eq 1 ] || { echo "usage: scripts/gpu_window.sh [--standin] OUT_DIR" >&2; exit 2; }
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "gpu_window: cannot make $1" >&2; exit 2; }

check() { # NAME BUDGET STAGES [VAR=value ...]: one gpu_check.sh run into OUT/NAME
  local name=$1 budget=$2 stages=$3
  shift 3
  echo "gpu_window: $name ($stages, budget $budget s) from $(date -u +%H:%M:%S)"
  env GPU_CHECK_BUDGET_S="$budget" "$@" bash scripts/gpu_check.sh ${mode[@]+"${mode[@]}"} --stages "$stages" \
    "$OUT/$name" >"$OUT/$name.out" 2>&1
}

# the test lists of step 2 (on the stand-in, gpu_check.sh's own short lists)
training=() newer=()
if [ ${#mode[@]} -eq 0 ]; then
  training=(GPU_CHECK_TRAIN_TESTS=test_gpu_train.GpuTraining)
  memory=""
  for c in default_cnn default_cnn_bf16 resnet18 gpt_tiny gpt2_shaped resnet18_recompute gpt_tiny_recompute; do
    memory+=" test_memory.Estimate.test_${c}_gpu"
  done
  newer=("GPU_CHECK_TRAIN_TESTS=test_gpu_train.GpuPrecision test_recompute.Recompute.test_on_the_gpu_with_cuda_graphs \
test_auto_batch$memory")
fi

check 1-prepare "${GPU_WINDOW_PREPARE_S:-120}" build,data
parallel=${GPU_WINDOW_PARALLEL_S:-250}
check 2-ops-training "$parallel" ops,train ${training[@]+"${training[@]}"} &
check 3-precision-newer-faults "$parallel" train,faults ${newer[@]+"${newer[@]}"} &
# each run's share: on the stand-in test_gpu takes about 25 s alone and two to four times that beside
# the other parts on 2 cores
share=60
[ ${#mode[@]} -gt 0 ] && share=120
check 4-sanitizer "$parallel" sanitizer "GPU_CHECK_SANITIZER_TOOLS=memcheck synccheck initcheck" \
  GPU_CHECK_SANITIZER_RUN_S=$share &
check 5-racecheck "$parallel" sanitizer GPU_CHECK_SANITIZER_TOOLS=racecheck \
  GPU_CHECK_SANITIZER_RUN_S=$((parallel - 25)) GPU_CHECK_SANITIZER_BATCH="${GPU_CHECK_SANITIZER_BATCH:-8}" &
wait
check 6-timing "${GPU_WINDOW_TIMING_S:-215}" startup,fmnist,bench,profile

for f in "$OUT"/[0-9]-*/summary.md; do
  echo "## ${f%/summary.md}" | sed "s|$OUT/||"
  sed 1d "$f" | grep -v "not asked for"
done >"$OUT/summary.md"
cat "$OUT/summary.md"
