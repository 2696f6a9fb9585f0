#!/usr/bin/env bash
# CPU training throughput, ddp_train next to PyTorch in the same run, on the same machine and threads.
# Cases: the default CNN at batch 256 and the MLP 784-1024-1024-10 at batch 1024 (samples/s), then
# in a second table the tiny GPT (configs/gpt_tiny.yaml) at 32 sequences of 128 tokens (target
# tokens/s, AdamW on both sides), one process with all cores (ddp_train: one rank, dist.threads =
# cores). ddp_train's figure is the median of its logged windows after the first (warm-up) one;
# PyTorch's the median of 3 timed windows after warm-up.
# Prints Markdown tables; `make bench` runs it (through benchmarks/bench.sh) where there is no GPU.
# BENCH_STEPS: steps per logged window instead of each case's own (for a quick smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/usr/bin/python3}
THREADS=${THREADS:-$(nproc)}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

ours() { # config batch steps [metric] -> samples/s (or the logged metric, e.g. tokens_per_s)
  local cfg=$1 batch=$2 steps=$3 metric=${4:-samples_per_s}
  rm -rf "$out/log"
  ./ddp_train "$cfg" --set train.global_batch_size="$batch" --set train.max_steps=$((steps * 4)) \
    --set log.every_steps="$steps" --set log.dir="$out/log" --set checkpoint.dir= --set data.val.x= \
    --set dist.threads="$THREADS" --set optim.schedule.name=constant --set optim.lr=0.01 >/dev/null
  "$PYTHON" - "$out/log/metrics.jsonl" "$metric" <<'PY'
import json, statistics, sys
key = sys.argv[2]
rows = [json.loads(l) for l in open(sys.argv[1]) if f'"{key}"' in l]
print(f"{statistics.median(r[key] for r in rows[1:]):.1f}")
PY
}

printf '| case | ddp_train samples/s | PyTorch samples/s | ratio |\n|---|---|---|---|\n'
while IFS='|' read -r name cfg batch steps; do
  steps=${BENCH_STEPS:-$steps}
  a=$(ours "$cfg" "$batch" "$steps")
  b=$("$PYTHON" benchmarks/torch_train.py "$cfg" "$batch" "$steps" "$THREADS")
  printf '| %s | %s | %s | %.2fx |\n' "$name" "$a" "$b" "$("$PYTHON" -c "print($a / $b)")"
done <<'CASES'
default CNN (configs/model.yaml), batch 256|configs/model.yaml|256|10
MLP 784-1024-1024-10, batch 1024|configs/mlp.yaml|1024|10
CASES

# Token models: target tokens/s (rows x T per second). ddp_train trains on the real tokens of
# data/fortunes.h5 with its config's AdamW (no_decay groups, clip_grad_norm) at a constant lr;
# PyTorch (torch_train.py) the twin on random token ids, LongTensor (B, T) in memory, the same AdamW.
echo
printf '| case | ddp_train tokens/s | PyTorch tokens/s | ratio |\n|---|---|---|---|\n'
while IFS='|' read -r name cfg batch steps; do
  steps=${BENCH_STEPS:-$steps}
  a=$(ours "$cfg" "$batch" "$steps" tokens_per_s)
  b=$("$PYTHON" benchmarks/torch_train.py "$cfg" "$batch" "$steps" "$THREADS")
  printf '| %s | %s | %s | %.2fx |\n' "$name" "$a" "$b" "$("$PYTHON" -c "print($a / $b)")"
done <<'CASES'
tiny GPT (configs/gpt_tiny.yaml), 32 x 128 tokens|configs/gpt_tiny.yaml|32|10
CASES
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')
torch=$("$PYTHON" -c 'import torch; print(torch.__version__)')
echo
echo "$(date -u +%Y-%m-%d), $cpu, $THREADS threads; $(./ddp_train --version | sed -n 5p | sed 's/^ *//'); PyTorch $torch"
