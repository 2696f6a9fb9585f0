#!/usr/bin/env bash
# CPU training throughput, ddp_train against PyTorch measured in the same run on the same machine and
# threads, in one Markdown table; `make bench` runs it (through benchmarks/bench.sh) where there is no GPU.
#
# Rows (one process with THREADS threads, all cores by default, unless said otherwise):
#   default CNN (configs/model.yaml), batch 256, samples/s, windows of 10 steps;
#   MLP 784-1024-1024-10 (configs/mlp.yaml), batch 1024, samples/s, windows of 10 steps;
#   ResNet-18 CIFAR (configs/resnet18_cifar.yaml, data/synthetic_cifar.h5), batch 64, samples/s, windows of
#     3 steps (about 15 s a run on 2 cores);
#   tiny GPT (configs/gpt_tiny.yaml), 32 x 128 tokens, target tokens/s, AdamW (no_decay groups,
#     clip_grad_norm) on both sides, windows of 10 steps;
#   the same with train.recompute blocks on ddp_train's side only (PyTorch keeps every activation): what
#     recomputing costs is this row's ddp_train figure against the row above's;
#   `make run`: `mpirun -np 2 ./ddp_train configs/model.yaml` with dist.threads=1 (a rank per core, bound by
#     mpirun) against PyTorch DDP (benchmarks/torch_ddp_train.py: 2 processes of 1 thread, gloo), global
#     batch 256 (128 a process), samples/s of the global batch, windows of 10 steps.
#
# Each side trains WINDOWS windows of `steps` steps in a fresh process; its figure is the median of the
# windows after the first (warm-up) one: ddp_train's logged samples_per_s (tokens_per_s) of metrics.jsonl,
# PyTorch's timed by benchmarks/torch_train.py (torch_ddp_train.py), so both train the same steps. ddp_train
# reads the config's real data (constant lr, SGD with Nesterov momentum or the config's AdamW, no validation,
# no checkpoints); PyTorch the same model (scripts/ddp_model.py) and optimizer on random data in memory.
# A row is PAIRS paired runs: for i in 1..PAIRS, ddp_train then PyTorch back to back (PyTorch first on even
# i, to cancel drift). The table gives each side's median and min-max over the pairs, and the median (and
# min-max) of the per-pair ratios ddp_train / PyTorch.
#
# GFLOP/s = throughput x training FLOPs per sample (per token), the same figure for both sides: 3 x the
# forward FLOPs per sample that ddp_train computes from the model (its `--dry-run` "forward FLOPs per
# sample", the flops_per_sample of metrics.jsonl; multiply-adds counted as 2 FLOPs, so forward + backward
# = 3 x forward = 6 x MACs; the GPT's attention products T x T per head included, the masked half too).
# For the GPT, per target token: flops_per_sample / T. The figures are printed under the table.
#
# Environment: BENCH_ONLY (a bash regular expression: only the rows whose case matches it run; all),
# BENCH_STEPS (steps per window for every row instead of its own, for a quick smoke run),
# BENCH_PAIRS (5), BENCH_WINDOWS (windows per run, the first the warm-up: 4), THREADS (nproc), PYTHON
# (/usr/bin/python3, with torch and PyYAML), MPIRUN (mpirun). Any run that fails stops the script with its
# output's last lines and a non-zero exit status.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/usr/bin/python3}
THREADS=${THREADS:-$(nproc)}
MPIRUN=${MPIRUN:-mpirun}
PAIRS=${BENCH_PAIRS:-5}
WINDOWS=${BENCH_WINDOWS:-4}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

die() {
  echo "cpu_bench.sh: $*" >&2
  exit 1
}
for v in BENCH_PAIRS BENCH_WINDOWS THREADS BENCH_STEPS; do
  [[ -z ${!v:-} || ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer, not '${!v}'"
done
((WINDOWS >= 2)) || die "BENCH_WINDOWS must be >= 2 (a warm-up window and a timed one)"

ours() { # ranks config batch steps metric [--set KEY=VALUE ...] -> "figure forward-FLOPs-per-unit" from ddp_train's
  # metrics.jsonl
  local ranks=$1 cfg=$2 batch=$3 steps=$4 metric=$5 threads=$THREADS
  shift 5
  local launch=()
  if ((ranks > 1)); then
    launch=("$MPIRUN" --oversubscribe -np "$ranks")
    threads=1
  fi
  rm -rf "$out/log"
  if ! "${launch[@]}" ./ddp_train "$cfg" --device cpu --set train.global_batch_size="$batch" \
    --set train.max_steps=$((steps * WINDOWS)) --set log.every_steps="$steps" --set log.dir="$out/log" \
    --set checkpoint.dir= --set data.val.x= --set dist.threads="$threads" --set optim.schedule.name=constant \
    --set optim.lr=0.01 "$@" </dev/null >"$out/run.txt" 2>&1; then
    tail -n 20 "$out/run.txt" >&2
    die "ddp_train failed: ${launch[*]:+${launch[*]} }./ddp_train $cfg (batch $batch, $steps steps a window)"
  fi
  "$PYTHON" - "$out/log/metrics.jsonl" "$metric" "$WINDOWS" <<'PY'
import json, statistics, sys
path, key, windows = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [r for r in map(json.loads, open(path)) if key in r]
if len(rows) != windows:
    sys.exit(f"cpu_bench.sh: {path} has {len(rows)} windows with {key}, not {windows}")
flops = rows[0]["flops_per_sample"]
if key == "tokens_per_s":  # per target token: flops_per_sample / T
    flops /= round(rows[0]["tokens_per_s"] / rows[0]["samples_per_s"])
print(f"{statistics.median(r[key] for r in rows[1:])} {flops}")
PY
}

theirs() { # ranks config batch steps -> PyTorch's samples/s (target tokens/s)
  local ranks=$1 cfg=$2 batch=$3 steps=$4 figure cmd
  if ((ranks > 1)); then
    cmd=("$PYTHON" benchmarks/torch_ddp_train.py "$cfg" "$batch" "$steps" "$WINDOWS" "$ranks")
  else
    cmd=("$PYTHON" benchmarks/torch_train.py "$cfg" "$batch" "$steps" "$THREADS" "$WINDOWS")
  fi
  figure=$("${cmd[@]}" </dev/null) || die "PyTorch failed: ${cmd[*]}"
  [[ $figure =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "${cmd[*]} printed '$figure', not a number"
  echo "$figure"
}

row() { # name unit ranks config batch steps metric [ddp_train's --set ...]: PAIRS paired runs -> one table row
  local name=$1 unit=$2 ranks=$3 cfg=$4 batch=$5 steps=${BENCH_STEPS:-$6} metric=$7 i a b
  shift 7
  [[ $name =~ ${BENCH_ONLY:-.} ]] || return 0
  : >"$out/pairs"
  for ((i = 1; i <= PAIRS; i++)); do
    if [ -t 2 ]; then echo "cpu_bench.sh: $name, pair $i of $PAIRS" >&2; fi
    if ((i % 2)); then
      a=$(ours "$ranks" "$cfg" "$batch" "$steps" "$metric" "$@")
      b=$(theirs "$ranks" "$cfg" "$batch" "$steps")
    else
      b=$(theirs "$ranks" "$cfg" "$batch" "$steps")
      a=$(ours "$ranks" "$cfg" "$batch" "$steps" "$metric" "$@")
    fi
    echo "$a $b" >>"$out/pairs"
  done
  "$PYTHON" - "$out/pairs" "$name" "$unit" "$cfg" "$out/flops" <<'PY'
import statistics, sys
pairs = [tuple(map(float, l.split())) for l in open(sys.argv[1])]  # (ddp_train, forward FLOPs, PyTorch)
name, unit = sys.argv[2], sys.argv[3]
ours, flops, theirs = [p[0] for p in pairs], pairs[0][1], [p[2] for p in pairs]
ratios = [a / b for a, b in zip(ours, theirs)]
med = statistics.median
span = lambda v, f="{:.1f}": f"{f.format(med(v))} ({f.format(min(v))}–{f.format(max(v))})"
gflops = lambda v: f"{med(v) * 3 * flops / 1e9:.1f}"
print(f"| {name} | {unit} | {span(ours)} | {gflops(ours)} | {span(theirs)} | {gflops(theirs)} | "
      f"{span(ratios, '{:.2f}x')} |")
with open(sys.argv[5], "a") as f:  # training FLOPs per sample (token), for the note under the table
    f.write(f"{sys.argv[4]} {3 * flops / 1e6:.2f} MFLOP a {'token' if unit == 'tokens/s' else 'sample'}\n")
PY
}

steps_note="each row's own steps"
[ -z "${BENCH_STEPS:-}" ] || steps_note="$BENCH_STEPS steps (BENCH_STEPS)"
echo "CPU training throughput: the median (min–max) of $PAIRS paired runs of $WINDOWS windows of $steps_note"
echo
printf '| case | unit | ddp_train | ddp_train GFLOP/s | PyTorch | PyTorch GFLOP/s | ddp_train / PyTorch |\n'
printf '|---|---|---|---|---|---|---|\n'
: >"$out/flops"
row "default CNN (configs/model.yaml), batch 256" samples/s 1 configs/model.yaml 256 10 samples_per_s
row "MLP 784-1024-1024-10 (configs/mlp.yaml), batch 1024" samples/s 1 configs/mlp.yaml 1024 10 samples_per_s
row "ResNet-18 CIFAR (configs/resnet18_cifar.yaml), batch 64" samples/s 1 configs/resnet18_cifar.yaml 64 3 samples_per_s
row "tiny GPT (configs/gpt_tiny.yaml), 32 x 128 tokens" tokens/s 1 configs/gpt_tiny.yaml 32 10 tokens_per_s
row "tiny GPT, train.recompute blocks (PyTorch: every activation kept)" tokens/s 1 configs/gpt_tiny.yaml 32 10 \
  tokens_per_s --set train.recompute=blocks
row "make run: default CNN, 2 ranks x 1 thread (PyTorch: DDP, gloo), global batch 256" samples/s 2 \
  configs/model.yaml 256 10 samples_per_s

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
torch=$("$PYTHON" -c 'import torch; print(torch.__version__)')
echo
echo "ddp_train: the median of its logged windows after the first; PyTorch: benchmarks/torch_train.py (the"
echo "make run row: benchmarks/torch_ddp_train.py), the same model and optimizer on random data in memory, timed"
echo "the same way. Every row but the last: one process of $THREADS threads. ddp_train / PyTorch: the median of"
echo "the per-pair ratios. GFLOP/s: the median x the training FLOPs (3 x ddp_train's forward FLOPs), for both"
echo "sides: $(awk '!seen[$0]++' "$out/flops" | sed ':a;N;$!ba;s/\n/; /g')."
echo
echo "$(date -u +%Y-%m-%d), $cpu, $THREADS threads; $(./ddp_train --version | sed -n 5p | sed 's/^ *//'); PyTorch $torch"
