#!/usr/bin/env bash
# GPU training throughput, ddp_train next to PyTorch on the same GPU in one run (benchmarks/bench.sh
# runs it when both see a GPU; `make bench`). Prints a Markdown table: per case ddp_train's samples/s
# (the median of its logged windows after the first), PyTorch's eager and best samples/s
# (benchmarks/torch_gpu_train.py: the median of timed windows after warm-up, for each setting it can
# run), the ratio to the best, and the target; then the time from launch to the end of the first
# step of each. Both sides train from data in device memory (ddp_train: data.cache device, the real
# dataset; PyTorch: one synthetic batch). Then a second table: GPT-2 124M (configs/gpt2_124m.yaml at
# sequence 1024, fp32 and bf16), target tokens/s and MFU of ddp_train, PyTorch eager and PyTorch's best,
# both on random token ids. Timings are printed, never asserted.
# Knobs (defaults are right for a GPU; the smoke test, tests/test_bench.py, shrinks them for the
# CPU stand-in of tests/gpusim):
#   BENCH_DDP_BINARY    ddp_train to run (./ddp_train)
#   BENCH_STEPS         steps per timed window (50)
#   BENCH_WINDOWS       timed windows after one warm-up window (5)
#   BENCH_BATCH         one batch for every case instead of each case's own
#   BENCH_LAUNCHES      launches for the first-step row, the median is printed (3)
#   BENCH_ONLY          a bash regular expression: only the rows whose case matches it run (all; e.g.
#                       "ResNet|GPT|launch" for the rows a short GPU window left out)
#   BENCH_DDP_SET       extra KEY=VALUE overrides for every ddp_train run, space-separated
#                       (e.g. "train.cuda_graph=off dist.threads=4"; later ones win)
#   BENCH_DDP_AB        KEY=VALUE overrides, space-separated, each timed alone against the default in the
#                       same run: every ddp_train row runs again with it, and a list after the tables gives
#                       its figure and the default's ratio to it (e.g. "train.queue_ahead=false model.fuse=false")
#   BENCH_TORCH_PYTHON  the Python with PyTorch (PYTHON); BENCH_TORCH_DEVICE cuda (or cpu: smoke tests)
#   BENCH_TORCH_SETTINGS  the PyTorch settings to try (see torch_gpu_train.py)
#   BENCH_GPT_CONFIG    the GPT rows' config (configs/gpt2_124m.yaml; the smoke test gives a tiny one)
#   BENCH_GPT_SEQ       their sequence length, model.input (1024)
#   BENCH_GPT_BATCH     their batch in sequences (BENCH_BATCH, else 8: the fine-tuning recipe's per GPU)
#   BENCH_GPT_ATTENTION their model.attention values, a row each ("auto": fused on CUDA; "auto materialized"
#                       measures the fused kernels against the (B, H, T, T) path in the same run)
#   BENCH_PEAK_TFLOPS   the peaks MFU divides by, per precision ("fp32=67 tf32=494.7 bf16=989.4": an
#                       H100 SXM's dense figures; TF32 off in the fp32 rows, so fp32 is FP32's peak)
#   BENCH_RUN_TIMEOUT_S each ddp_train run's time limit (300; its dist.timeout_s too, for a step that
#                       never ends on the device)
#   BENCH_DDP_FALLBACK  KEY=VALUE overrides, space-separated, for a second try of a ddp_train run that
#                       fails ("model.fuse=false": the fused kernels off; "" for none): its cell then gives
#                       that figure, marked, so that one broken kernel does not cost a lent GPU window the
#                       row. A row that fails (by default or again) does not stop the table: it says
#                       "failed", the failures are listed under the tables (the runs' last lines go to
#                       stderr) and the script exits 1 at the end
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/usr/bin/python3}
TORCH_PYTHON=${BENCH_TORCH_PYTHON:-$PYTHON}
DDP=${BENCH_DDP_BINARY:-./ddp_train}
STEPS=${BENCH_STEPS:-50}
ONLY=${BENCH_ONLY:-.}
WINDOWS=${BENCH_WINDOWS:-5}
LAUNCHES=${BENCH_LAUNCHES:-3}
export BENCH_TORCH_DEVICE=${BENCH_TORCH_DEVICE:-cuda}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
RUN_LIMIT=${BENCH_RUN_TIMEOUT_S:-300}
FALLBACK=${BENCH_DDP_FALLBACK-model.fuse=false}
extra=() fallback=()
for kv in ${BENCH_DDP_SET:-}; do extra+=(--set "$kv"); done
for kv in $FALLBACK; do fallback+=(--set "$kv"); done
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
failures=()

# config batch precision metric [more ddp_train arguments] -> samples/s (or the logged metric); as many
# epochs as steps, so that a small dataset (2048 rows of synthetic CIFAR: 8 steps of 256) does not end the
# run before its windows. A run that fails or passes RUN_LIMIT returns 1: its last lines go to stderr,
# and why it failed (the exit status and its error line) to $out/why.
ours() {
  local log cfg=$1 batch=$2 precision=$3 metric=$4 rc=0
  shift 4
  log=$(mktemp -d "$out/run.XXXX")
  echo "no reason recorded" >"$out/why"
  timeout --kill-after=10 "$RUN_LIMIT" "$DDP" "$cfg" --device cuda --set train.global_batch_size="$batch" \
    --set train.precision="$precision" --set train.max_steps=$((STEPS * (WINDOWS + 1))) \
    --set train.epochs=$((STEPS * (WINDOWS + 1))) --set log.every_steps="$STEPS" --set log.dir="$log" \
    --set checkpoint.dir= --set data.val.x= --set data.drop_last=true --set data.cache=device \
    --set optim.schedule.name=constant --set optim.lr=0.01 --set dist.timeout_s="$RUN_LIMIT" "$@" \
    ${extra[@]+"${extra[@]}"} >"$log/out" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    local why="exit $rc"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="past BENCH_RUN_TIMEOUT_S = $RUN_LIMIT s"
    { echo "gpu_bench: ddp_train $cfg ($precision, batch $batch${*:+, $*}): $why; its last lines:"
      tail -n 20 "$log/out"; } >&2
    echo "$why: $(grep -m1 -E '^ddp_train: (error|bug)' "$log/out" || tail -n 1 "$log/out")" >"$out/why"
    return 1
  fi
  if ! "$PYTHON" - "$log/metrics.jsonl" "$metric" <<'PY'; then
import json, statistics, sys
key = sys.argv[2]
rows = [json.loads(l) for l in open(sys.argv[1]) if f'"{key}"' in l]
if len(rows) < 2:
    sys.exit(f"{sys.argv[1]}: {len(rows)} lines with {key}, want a warm-up window and at least one more")
print(f"{statistics.median(r[key] for r in rows[1:]):.1f}")
PY
    echo "exit 0, but its metrics.jsonl has no timed window" >"$out/why"
    return 1
  fi
}

# NAME, then ours' arguments -> sets cell (the row's ddp_train cell) and figure (its number, or - where
# it failed). A failed run is listed in failures and tried again with BENCH_DDP_FALLBACK's overrides.
measure() {
  local name=$1 v
  shift
  if v=$(ours "$@"); then
    cell=$v figure=$v
    return 0
  fi
  failures+=("- $name: ddp_train $(cat "$out/why")")
  cell=failed figure=-
  [ ${#fallback[@]} -gt 0 ] || return 0
  if v=$(ours "$@" "${fallback[@]}"); then
    cell="$v ($FALLBACK; the default failed)" figure=$v
  else
    failures+=("- $name: ddp_train with $FALLBACK $(cat "$out/why")")
  fi
}

# PyTorch's figures for a row: NAME, then torch_gpu_train.py's arguments -> sets eager, best, setting
# and tried (its line), dashes where no setting ran (listed in failures)
theirs() {
  local name=$1 line
  shift
  if ! line=$("$TORCH_PYTHON" benchmarks/torch_gpu_train.py "$@"); then
    failures+=("- $name: PyTorch ran no setting (its errors are above)")
    line=$(printf -- '-\t-\t-\tnone ran')
  fi
  IFS=$'\t' read -r eager best setting tried <<<"$line"
}

launch() { # N READY DONE command... -> median seconds from launch to the stdout lines matching DONE, READY
  "$PYTHON" benchmarks/launch_time.py "$@"
}

# a / b as "1.23x", or - where either is not a number (a failed run)
ratio() { "$PYTHON" -c "import sys; a, b = sys.argv[1:]
try: print(f'{float(a) / float(b):.2f}x')
except ValueError: print('-')" "$1" "$2"; }

info=$("$DDP" --info)
printf '| case | ddp_train samples/s | PyTorch eager samples/s | PyTorch best samples/s | PyTorch best setting |'
printf ' ddp_train / PyTorch best | target |\n|---|---|---|---|---|---|---|\n'
notes=() variants=()
while IFS='|' read -r label cfg batch precision target; do
  batch=${BENCH_BATCH:-$batch}
  name="$label, $precision, batch $batch"
  [[ $name =~ $ONLY ]] || continue
  measure "$name" "$cfg" "$batch" "$precision" samples_per_s
  a=$figure a_cell=$cell
  for kv in ${BENCH_DDP_AB:-}; do
    v=$(ours "$cfg" "$batch" "$precision" samples_per_s --set "$kv") || v="failed ($(cat "$out/why"))"
    variants+=("- $name, $kv: $v samples/s; the default $(ratio "$a" "$v") of it")
  done
  theirs "$name" "$cfg" "$batch" "$precision" "$STEPS" "$WINDOWS"
  printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$name" "$a_cell" "$eager" "$best" "$setting" \
    "$(ratio "$a" "$best")" "${target:--}"
  notes+=("- $name: $tried")
done <<'CASES'
default CNN (configs/model.yaml)|configs/model.yaml|256|fp32|>= 3x
default CNN (configs/model.yaml)|configs/model.yaml|256|tf32|>= 3x
default CNN (configs/model.yaml)|configs/model.yaml|256|bf16|>= 3x
MLP 784-1024-1024-10 (configs/mlp.yaml)|configs/mlp.yaml|1024|tf32|
ResNet-18 CIFAR (configs/resnet18_cifar.yaml)|configs/resnet18_cifar.yaml|256|bf16|>= 1.5x
CASES

# Launch to the end of the first step, last, when the files and libraries are in the page cache for both.
# ddp_train: one process started directly (MPI's singleton start, as `./ddp_train CONFIG`); "training:" is
# printed when start-up is over, "step 1/" when the first step has finished (log.every_steps=1).
batch=${BENCH_BATCH:-256}
ours_s=- ours_ready=- torch_s=- torch_ready=-
if [[ "launch to end of first step" =~ $ONLY ]]; then
  a=$(launch --timeout "$RUN_LIMIT" "$LAUNCHES" '^training:' '^step 1/' "$DDP" configs/model.yaml --device cuda \
    --set train.global_batch_size="$batch" --set train.max_steps=1 --set log.every_steps=1 \
    --set log.dir="$out/first" --set checkpoint.dir= --set data.val.x= --set dist.timeout_s="$RUN_LIMIT" \
    ${extra[@]+"${extra[@]}"}) ||
    { a="- -" && failures+=("- launch to end of first step: ddp_train failed (its output is above)"); }
  b=$(launch --timeout "$RUN_LIMIT" "$LAUNCHES" '^ready' '^first step' "$TORCH_PYTHON" \
    benchmarks/torch_gpu_train.py --first-step \
    configs/model.yaml "$batch" fp32) ||
    { b="- -" && failures+=("- launch to end of first step: PyTorch failed (its output is above)"); }
  read -r ours_s ours_ready <<<"$a"
  read -r torch_s torch_ready <<<"$b"
  printf '| launch to end of first step (s, lower is better), default CNN, fp32, batch %s | %s | %s | - |' \
    "$batch" "$([ "$ours_s" = - ] && echo failed || echo "$ours_s s")" \
    "$([ "$torch_s" = - ] && echo failed || echo "$torch_s s")"
  printf ' eager | %s | <= 0.5 s |\n' "$(ratio "$ours_s" "$torch_s")"
fi

# GPT-2 124M at sequence 1024 (or BENCH_GPT_CONFIG / BENCH_GPT_SEQ): target tokens/s and MFU, fp32 and
# bf16. ddp_train: the config with model.input [SEQ], one rank, its AdamW (no_decay groups,
# clip_grad_norm 1.0) at a constant lr 1e-4, no gradient accumulation, on random token ids (a file
# written here, one distinct row per sequence of the run, in host memory: data.cache device is not
# available for token models yet, so each step's 8 x 1025 tokens are copied ahead, overlapping the step
# before); PyTorch: the twin, the same AdamW and clipping, one random batch on the device.
gpt_cfg=${BENCH_GPT_CONFIG:-configs/gpt2_124m.yaml}
gpt_label="GPT-2 124M ($gpt_cfg)"
[ -n "${BENCH_GPT_CONFIG:-}" ] && gpt_label="GPT ($gpt_cfg)"
gpt_seq=${BENCH_GPT_SEQ:-1024}
gpt_batch=${BENCH_GPT_BATCH:-${BENCH_BATCH:-8}}
gpt_flops=$("$TORCH_PYTHON" benchmarks/torch_gpu_train.py --flops-per-token "$gpt_cfg" "$gpt_seq")
peaks=${BENCH_PEAK_TFLOPS:-fp32=67 tf32=494.7 bf16=989.4}
"$PYTHON" - "$gpt_cfg" "$out/gpt_tokens.h5" $((gpt_batch * STEPS * (WINDOWS + 1))) "$gpt_seq" <<'PY'
import sys, h5py, numpy as np, yaml
cfg, path, rows, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
(kind, args), = yaml.safe_load(open(cfg))["model"]["layers"][0].items()
vocab = args["vocab"]
with h5py.File(path, "w") as f:
    f["train/tokens"] = np.random.default_rng(0).integers(0, vocab, (rows, seq + 1)).astype(
        np.uint16 if vocab <= 65536 else np.int32)
PY
mfu() { # tokens/s precision -> percent of the precision's peak (- for a failed run's -)
  [ "$1" = - ] && echo - && return
  "$PYTHON" -c "import sys; p = dict(kv.split('=') for kv in sys.argv[3].split()); \
print(f'{100 * float(sys.argv[1]) * $gpt_flops / (float(p[sys.argv[2]]) * 1e12):.2f}%')" "$1" "$2" "$peaks"
}
echo
printf '| case | ddp_train tokens/s | ddp_train MFU | PyTorch eager tokens/s | PyTorch eager MFU |'
printf ' PyTorch best tokens/s | PyTorch best MFU | PyTorch best setting | ddp_train / PyTorch best |\n'
printf '|---|---|---|---|---|---|---|---|---|\n'
for precision in fp32 bf16; do
  name="$gpt_label, seq $gpt_seq, $precision, batch $gpt_batch"
  [[ $name =~ $ONLY ]] || continue
  theirs "$name" --seq "$gpt_seq" "$gpt_cfg" "$gpt_batch" "$precision" "$STEPS" "$WINDOWS"
  eager_mfu=$(mfu "$eager" "$precision")
  for attention in ${BENCH_GPT_ATTENTION:-auto}; do
    gpt_args=(--set "model.input=[$gpt_seq]" --set data.path="$out/gpt_tokens.h5" --set data.train.x=/train/tokens
      --set train.batch_size=0 --set train.grad_accum=1 --set train.epochs=1 --set model.init_from=
      --set optim.lr=0.0001 --set data.cache=auto --set model.attention="$attention")
    measure "$name, attention $attention" "$gpt_cfg" "$gpt_batch" "$precision" tokens_per_s "${gpt_args[@]}"
    a=$figure
    for kv in ${BENCH_DDP_AB:-}; do
      v=$(ours "$gpt_cfg" "$gpt_batch" "$precision" tokens_per_s "${gpt_args[@]}" --set "$kv") ||
        v="failed ($(cat "$out/why"))"
      variants+=("- $name, attention $attention, $kv: $v tokens/s; the default $(ratio "$a" "$v") of it")
    done
    printf '| %s, attention %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$name" "$attention" "$cell" \
      "$(mfu "$a" "$precision")" "$eager" "$eager_mfu" "$best" "$(mfu "$best" "$precision")" "$setting" \
      "$(ratio "$a" "$best")"
  done
  notes+=("- $name (tokens/s): $tried")
done

echo
echo "Targets (issue 12, to be measured on a GPU): the default CNN at >= 3x PyTorch's best, ResNet-18 at"
echo ">= 1.5x, launch to the end of the first step in <= 0.5 s."
echo
echo "MFU: target tokens/s x $gpt_flops FLOPs per token (6 N + 12 L T C: N the parameters less the"
echo "position embedding, L layers, T = $gpt_seq, C the width) / the precision's peak ($peaks TFLOP/s)."
echo
echo "Launch to the end of the first step, median of $LAUNCHES: ddp_train $ours_s s, of which $ours_ready s"
echo "to its \"training:\" line (MPI, config, data into memory, CUDA, model and buffers); PyTorch $torch_s s,"
echo "of which $torch_ready s to \"ready\" (python start, import torch, model, data and optimizer on the device)."
echo
echo "PyTorch settings (samples/s):"
printf '%s\n' "${notes[@]}"
echo
if [ ${#variants[@]} -gt 0 ]; then
  echo "ddp_train with each of BENCH_DDP_AB in turn, beside the default's figure above:"
  printf '%s\n' "${variants[@]}"
  echo
fi
if [ ${#failures[@]} -gt 0 ]; then
  echo "Runs that failed (their last lines are in the output above):"
  printf '%s\n' "${failures[@]}"
  echo
fi
gpu=$(grep -m1 '^  GPU 0:' <<<"$info" | sed 's/^  GPU 0: //; s/, .*//' || true)
torch=$("$TORCH_PYTHON" -c 'import torch
cuda = f" (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})" if torch.version.cuda else ""
print(f"PyTorch {torch.__version__}{cuda}")')
echo "$(date -u +%Y-%m-%d), GPU 0: $gpu; $(head -n 1 <<<"$info" | cut -d: -f1):" \
  "$(grep -m1 'CUDA runtime' <<<"$info" | sed 's/^ *//'); $torch on $BENCH_TORCH_DEVICE;" \
  "windows of $STEPS steps, median of $WINDOWS${BENCH_DDP_SET:+; ddp_train with $BENCH_DDP_SET}"
if grep -q 'CPU stand-in' <<<"$info"; then
  echo "ddp_train ran on the CPU stand-in (tests/gpusim): a smoke run, these figures say nothing about speed."
fi
[ ${#failures[@]} -eq 0 ]
