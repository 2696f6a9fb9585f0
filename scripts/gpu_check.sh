#!/usr/bin/env bash
# gpu_check.sh: the GPU path checked on a GPU machine in one command, for the few minutes one is lent:
# build, data, the GPU suites, compute-sanitizer, the benchmark table, the start-up time and a
# Fashion-MNIST run, each stage with its own time limit, all within a budget, each logged, and one
# summary (summary.json, summary.md) of what passed, failed, timed out or was skipped, and why.
#
#   scripts/gpu_check.sh [--standin] [--stages LIST] OUT_DIR
#
# On a bare GPU machine, from the project root (docs/testing.md, "On a GPU machine"):
#   bash .device-carry/unpack.sh && source .device-carry/env.sh && bash scripts/gpu_check.sh "$OUT"
# It runs no `make deps` (that machine reaches no registry) and passes $DEVICE_MAKE_ARGS to make.
#
# Stages, in this order (--stages picks some, comma-separated, and runs them in its order; a failing
# stage does not stop the rest):
#   build      ddp_train and test_gpu for the GPU found (nvidia-smi's compute capability: one -gencode),
#              on every core
#   data       data/synthetic_cifar.h5; data/fashion_mnist.h5 from the four .gz files in GPU_CHECK_FMNIST
#              (default .device-data/fashion-mnist, carried; else /usr/share/datasets/fashion-mnist), or a
#              synthetic file of its shape when there are none (the fmnist stage then says so)
#   ops        test_gpu: every op on CUDA against the CPU backend (cmocka); where a test ends the process
#              (a GPU fault), the tests it did not report run again one a process
#   train      test_gpu_train          faults     test_gpu_faults
#   sanitizer  compute-sanitizer's memcheck, racecheck, synccheck and initcheck, each over test_gpu and over
#              20 steps of configs/model.yaml with CUDA graphs on
#   startup    launch to the end of step 1 (configs/model.yaml, one rank), the median of 3 launches
#   bench      make bench's GPU table (benchmarks/gpu_bench.sh) with PyTorch on the same GPU in the same run
#   fmnist     configs/model.yaml for 15 epochs on Fashion-MNIST: seconds and test accuracy
#   profile    the top kernels of one benchmark row (GPU_CHECK_PROFILE_ROW: gpt, GPT-2 124M at 8 x 1024
#              tokens; cnn, the default CNN at 256; resnet, ResNet-18 at 256; each in bf16), without CUDA
#              graphs so that each kernel is timed alone: Nsight Compute's gpu__time_duration over
#              GPU_CHECK_PROFILE_LAUNCHES launches (600) after the first GPU_CHECK_PROFILE_SKIP (600: past
#              the first step), clocks left alone (--clock-control none); profile.md in OUT_DIR
# Budget: GPU_CHECK_BUDGET_S seconds in all (default 510: a second call fits in a 15-minute window); a
# stage gets its own limit or what is left, and is skipped when less than 20 s are left. Each stage's
# limit: GPU_CHECK_LIMIT_<STAGE> (seconds). Knobs for the stages: GPU_CHECK_PYTHON (python3),
# GPU_CHECK_SANITIZER (compute-sanitizer), GPU_CHECK_SANITIZER_RUN_S (each run's share of the stage, 120),
# GPU_CHECK_SANITIZER_TOOLS / _TARGETS (which tools, over ops and/or train), GPU_CHECK_SANITIZER_BATCH (the
# training run's global batch, 256: racecheck's time grows with it), GPU_CHECK_TRAIN_TESTS /
# GPU_CHECK_FAULT_TESTS (test names for
# tests/pyrun.py; default the whole suites), GPU_CHECK_EPOCHS (15), the BENCH_* knobs of gpu_bench.sh.
#
# --standin: the same stages against the CPU stand-in build (build/sim, tests/gpusim) at small sizes,
# PyTorch on the CPU, a few tests per suite: what tests/test_gpu_check.py runs in `make test`, so that a
# real run cannot fail on a typo. OUT_DIR gets NN-stage.log per stage, env.log, summary.json, summary.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
STANDIN=0
STAGES=all
while [ $# -gt 1 ]; do
  case "$1" in
    --standin) STANDIN=1 ;;
    --stages) STAGES=$2; shift ;;
    *) echo "gpu_check: unknown option $1 (usage: scripts/gpu_check.sh [--standin] [--stages LIST] OUT_DIR)" >&2; exit 2 ;;
  esac
  shift
done
[ $# -eq 1 ] || { echo "usage: scripts/gpu_check.sh [--standin] [--stages LIST] OUT_DIR" >&2; exit 2; }
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "gpu_check: cannot make $1" >&2; exit 2; }
ALL="build data ops train faults sanitizer startup bench fmnist profile"
for s in ${STAGES//,/ }; do
  [ "$s" = all ] || [[ " $ALL " == *" $s "* ]] || { echo "gpu_check: unknown stage $s (stages: $ALL)" >&2; exit 2; }
done

export ROOT=$PWD OUT STANDIN
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
NPROC=$(nproc)
export NPROC
if [ "$STANDIN" = 1 ]; then
  export PY=${GPU_CHECK_PYTHON:-/usr/bin/python3} BIN=$ROOT/build/sim/ddp_train TEST_GPU=$ROOT/build/sim/tests/test_gpu
  export SIM=build/sim BUILD=build/cuda DDP_TRAIN_GPU_BINARY=$ROOT/build/sim/ddp_train GPUSIM_DEVICES=${GPUSIM_DEVICES:-1}
  export EPOCHS=${GPU_CHECK_EPOCHS:-1} FMNIST_STEPS=12 LAUNCHES=1 SANITIZER_BATCH=4
  BUDGET=${GPU_CHECK_BUDGET_S:-900}
else
  export PY=${GPU_CHECK_PYTHON:-python3} BIN=$ROOT/ddp_train TEST_GPU=$ROOT/build/cuda/tests/test_gpu
  export BUILD=build/cuda DDP_TRAIN_GPU_BINARY=$ROOT/ddp_train
  export EPOCHS=${GPU_CHECK_EPOCHS:-15} FMNIST_STEPS=0 LAUNCHES=3 SANITIZER_BATCH=${GPU_CHECK_SANITIZER_BATCH:-256}
  BUDGET=${GPU_CHECK_BUDGET_S:-510}
fi
export SANITIZER=${GPU_CHECK_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}

# ---- the stages: each a function run under `timeout` in a shell of its own, writing to its log ----

stage_build() {
  local targets=(ddp_train) arch
  if [ "$STANDIN" = 1 ]; then
    targets+=(build/sim/ddp_train build/sim/tests/test_gpu)
  else
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')
    [ -n "$arch" ] || { echo "nvidia-smi gives no compute capability"; return 1; }
    echo "compute capability ${arch:0:${#arch}-1}.${arch: -1}: building for sm_$arch only"
    targets+=("CUDA_ARCH=-gencode arch=compute_$arch,code=sm_$arch" build/cuda/tests/test_gpu)
  fi
  # the dashboard's Chart.js: Debian's libjs-chart.js, which ../shared/device/stage.sh does not stage; carry
  # /usr/share/javascript/chart.js/chart.min.js as .device-data/chart.min.js where that machine lacks it
  [ -f /usr/share/javascript/chart.js/chart.min.js ] || [ ! -f .device-data/chart.min.js ] ||
    targets+=(CHARTJS=.device-data/chart.min.js)
  echo "make -j$NPROC CUDA=1 ${DEVICE_MAKE_ARGS:-} ${targets[*]}"
  # shellcheck disable=SC2086 # DEVICE_MAKE_ARGS is a list of VAR=value words
  make -j"$NPROC" CUDA=1 ${DEVICE_MAKE_ARGS:-} "${targets[@]}"
}

stage_data() {
  mkdir -p data
  [ -s data/synthetic_cifar.h5 ] || "$PY" scripts/make_synthetic.py data/synthetic_cifar.h5 || return 1
  local fm=${GPU_CHECK_FMNIST:-.device-data/fashion-mnist}
  [ -f "$fm/train-images-idx3-ubyte.gz" ] || fm=/usr/share/datasets/fashion-mnist
  if [ -s data/fashion_mnist.h5 ] && ! [ -f data/fashion_mnist.synthetic ]; then
    echo "data/fashion_mnist.h5 is there"
  elif [ -f "$fm/train-images-idx3-ubyte.gz" ]; then
    "$PY" scripts/make_fashion_mnist.py "$fm" data/fashion_mnist.h5 && rm -f data/fashion_mnist.synthetic
  else
    echo "no Fashion-MNIST .gz files (GPU_CHECK_FMNIST=$fm): a synthetic data/fashion_mnist.h5 of its shape"
    "$PY" - <<'PY' && touch data/fashion_mnist.synthetic
import os, h5py, numpy as np
rng = np.random.default_rng(0)
tmp = f"data/fashion_mnist.h5.tmp.{os.getpid()}"  # renamed when whole: another check may be writing it too
with h5py.File(tmp, "w") as f:  # the layout of scripts/make_fashion_mnist.py
    for split, n in (("train", 60000), ("test", 10000)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = (rng.integers(0, 64, (n, 1, 28, 28)) + 19 * y[:, None, None, None]).astype(np.uint8)
        f[f"{split}/images"], f[f"{split}/labels"], f[f"{split}/images_flat"] = x, y, x.reshape(n, 784)
os.replace(tmp, "data/fashion_mnist.h5")
PY
  fi
}

# test_gpu as TAP. A test that ends the process (a GPU fault breaks its context for good) takes the
# tests after it with it: then every test the run did not report runs again, each in a process of its
# own, so that one broken kernel costs a window its own tests only; one that ends its process alone is
# reported here as "not ok", with the exit status.
stage_ops() {
  local tap one rc one_rc name
  tap=$(mktemp) one=$(mktemp)
  CMOCKA_MESSAGE_OUTPUT=TAP "$TEST_GPU" 2>&1 | tee "$tap"
  rc=${PIPESTATUS[0]}
  if ! grep -qE '^# (not )?ok - gpu$' "$tap"; then # cmocka's last line is missing: the run ended early
    echo "# test_gpu ended early (exit $rc): each test it did not report, in a process of its own"
    for name in $("$TEST_GPU" --list); do
      grep -qE "^(not )?ok [0-9]+ (- |# SKIP )$name\$" "$tap" && continue
      CMOCKA_MESSAGE_OUTPUT=TAP "$TEST_GPU" "$name" >"$one" 2>&1
      one_rc=$?
      cat "$one"
      grep -qE '^# (not )?ok - gpu$' "$one" ||
        echo "not ok 0 - $name # its process ended (exit $one_rc) before reporting it"
    done
    rc=1
  fi
  rm -f "$tap" "$one"
  [ "$rc" -eq 0 ] # cmocka's status counts the failed tests, and 3 would read as "skipped" here
}

suite() { # default test names, override -> runs them through tests/pyrun.py
  local names=${2:-$1}
  # shellcheck disable=SC2086 # a list of test names
  "$PY" tests/pyrun.py $names
}
stage_train() {
  local quick=
  [ "$STANDIN" = 1 ] && quick="test_gpu_train.GpuTraining.test_two_ranks_over_nccl_equal_one_rank
    test_gpu_train.GpuTraining.test_cuda_graph_replay_equals_eager_over_nccl
    test_gpu_train.GpuPrecision.test_fp16_overflow_skips_the_step_halves_the_scale_and_recovers"
  suite test_gpu_train "${GPU_CHECK_TRAIN_TESTS:-$quick}"
}
stage_faults() {
  local quick=
  [ "$STANDIN" = 1 ] && quick=test_gpu_faults.GpuFaults.test_nan_exits_4_naming_the_rank_and_keeps_the_last_checkpoint
  suite test_gpu_faults "${GPU_CHECK_FAULT_TESTS:-$quick}"
}

# Every tool over the op tests and over 20 steps with CUDA graphs on. Each run counts as clean when the
# program exits 0 and scripts/sanitizer_report.py finds no error in its output (its "sanitizer: N
# errors" line is what the summary reads; NCCL's probes of kernels built for other GPUs are not
# errors). A run past its share of the stage's time is cut off and said so.
stage_sanitizer() {
  [ -x "$SANITIZER" ] || { echo "compute-sanitizer not found ($SANITIZER)"; return 3; }
  local tool target failed=0 share=${GPU_CHECK_SANITIZER_RUN_S:-120} run_log
  run_log=$(mktemp)
  for tool in ${GPU_CHECK_SANITIZER_TOOLS:-memcheck racecheck synccheck initcheck}; do
    for target in ${GPU_CHECK_SANITIZER_TARGETS:-ops train}; do
      echo "=== $tool $target ==="
      local args=(--tool "$tool")
      [ "$tool" = memcheck ] && args+=(--leak-check full)
      if [ "$target" = ops ]; then
        timeout "$share" "$SANITIZER" "${args[@]}" env CMOCKA_MESSAGE_OUTPUT=TAP "$TEST_GPU" >"$run_log" 2>&1
      else
        timeout "$share" "$SANITIZER" "${args[@]}" "$BIN" configs/model.yaml --device cuda --set train.max_steps=20 \
          --set train.cuda_graph=on --set log.every_steps=5 --set log.dir="$OUT/sanitizer-run" --set checkpoint.dir= \
          --set data.val.x= --set train.global_batch_size="$SANITIZER_BATCH" >"$run_log" 2>&1
      fi
      local rc=$?
      cat "$run_log"
      "$PY" scripts/sanitizer_report.py "$run_log" || failed=1
      echo "=== $tool $target: exit $rc ==="
      [ $rc -ne 0 ] && failed=1
    done
  done
  rm -f "$run_log"
  return $failed
}

stage_startup() { # "training:" ends start-up, "step 1/" the first step
  local medians first ready
  medians=$("$PY" benchmarks/launch_time.py "$LAUNCHES" '^training:' '^step 1/' "$BIN" configs/model.yaml \
    --device cuda --set train.max_steps=1 --set log.every_steps=1 --set log.dir="$OUT/startup-run" \
    --set checkpoint.dir= --set data.val.x=) || return 1
  read -r first ready <<<"$medians"
  echo "first step: $first s (median of $LAUNCHES), start-up $ready s"
}

stage_bench() {
  if [ "$STANDIN" = 1 ]; then # the smoke sizes of tests/test_bench.py, PyTorch on the CPU
    export BENCH_STEPS=1 BENCH_WINDOWS=1 BENCH_BATCH=4 BENCH_LAUNCHES=1 BENCH_TORCH_DEVICE=cpu \
      BENCH_GPT_CONFIG=configs/gpt_tiny.yaml BENCH_GPT_SEQ=16 BENCH_GPT_BATCH=2 \
      BENCH_TORCH_SETTINGS="eager cuda-graph"
  else # windows that fit the budget; max-autotune's minutes of tuning per case do not
    export BENCH_STEPS=${BENCH_STEPS:-30} BENCH_WINDOWS=${BENCH_WINDOWS:-3} BENCH_LAUNCHES=${BENCH_LAUNCHES:-3}
    # a run that hangs must not eat the stage: the slowest row (GPT-2 in fp32, 120 steps) takes about 30 s
    export BENCH_RUN_TIMEOUT_S=${BENCH_RUN_TIMEOUT_S:-90}
    export BENCH_TORCH_SETTINGS=${BENCH_TORCH_SETTINGS:-eager channels-last sdpa cuda-graph reduce-overhead}
  fi
  BENCH_DDP_BINARY=$BIN BENCH_TORCH_PYTHON=$PY PYTHON=$PY bash benchmarks/gpu_bench.sh
}

stage_fmnist() {
  [ -f data/fashion_mnist.synthetic ] && { echo "data/fashion_mnist.h5 is synthetic (no .gz files carried)"; return 3; }
  local extra=()
  if [ "$STANDIN" = 1 ]; then # the first 1024 and 256 rows, batches of 64: the stand-in is slow
    "$PY" - "$OUT/fmnist_small.h5" <<'PY' || return 1
import sys, h5py
with h5py.File("data/fashion_mnist.h5", "r") as src, h5py.File(sys.argv[1], "w") as dst:
    for split, n in (("train", 1024), ("test", 256)):
        for name in ("images", "labels"):
            dst[f"{split}/{name}"] = src[f"{split}/{name}"][:n]
PY
    extra=(--set data.path="$OUT/fmnist_small.h5" --set train.global_batch_size=64 --set train.max_steps="$FMNIST_STEPS")
  fi
  local t0 rc
  t0=$(date +%s.%N)
  "$BIN" configs/model.yaml --device cuda --set train.epochs="$EPOCHS" --set data.cache=device --set log.every_steps=100 \
    --set log.dir="$OUT/fmnist-run" --set checkpoint.dir= "${extra[@]}"
  rc=$?
  echo "fmnist: $EPOCHS epochs, exit $rc, $("$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" \
    "$t0" "$(date +%s.%N)") s from launch to exit"
  return $rc
}

# The stand-in has no Nsight Compute: its GPUSIM_PROFILE table (CPU seconds) goes through the same
# summary, so that the stage's plumbing is what `make test` ran.
stage_profile() {
  local row=${GPU_CHECK_PROFILE_ROW:-gpt} args=()
  case $row in
    gpt)
      local cfg=configs/gpt2_124m.yaml seq=1024 batch=8
      [ "$STANDIN" = 1 ] && cfg=configs/gpt_tiny.yaml seq=16 batch=2
      "$PY" - "$cfg" "$OUT/profile_tokens.h5" $((batch * 4)) "$seq" <<'PY' || return 1
import sys, h5py, numpy as np, yaml
cfg, path, rows, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
(kind, args), = yaml.safe_load(open(cfg))["model"]["layers"][0].items()
with h5py.File(path, "w") as f:
    f["train/tokens"] = np.random.default_rng(0).integers(0, args["vocab"], (rows, seq + 1)).astype(np.int32)
PY
      args=("$cfg" --set "model.input=[$seq]" --set data.path="$OUT/profile_tokens.h5" --set data.train.x=/train/tokens
        --set train.global_batch_size="$batch" --set train.batch_size=0 --set train.grad_accum=1 --set model.init_from=) ;;
    cnn) args=(configs/model.yaml --set train.global_batch_size=256 --set data.cache=device) ;;
    resnet) args=(configs/resnet18_cifar.yaml --set train.global_batch_size=256 --set data.cache=device) ;;
    *) echo "GPU_CHECK_PROFILE_ROW is gpt, cnn or resnet, not $row"; return 2 ;;
  esac
  [ "$STANDIN" = 1 ] && [ "$row" != gpt ] && args+=(--set train.global_batch_size=4)
  args+=(--device cuda --set train.precision=bf16 --set train.cuda_graph=off --set train.max_steps=3 --set train.epochs=3
    --set data.val.x= --set log.dir= --set checkpoint.dir=)
  echo "profile: $row: ${args[*]}"
  if [ "$STANDIN" = 1 ]; then
    GPUSIM_PROFILE=1 "$BIN" "${args[@]}" 2>"$OUT/profile.txt" || { tail -n 20 "$OUT/profile.txt"; return 1; }
    "$PY" scripts/kernel_profile.py gpusim "$OUT/profile.txt" | tee "$OUT/profile.md"
    return "${PIPESTATUS[0]}"
  fi
  command -v ncu >/dev/null || { echo "ncu (Nsight Compute) not found"; return 3; }
  ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip "${GPU_CHECK_PROFILE_SKIP:-600}" \
    --launch-count "${GPU_CHECK_PROFILE_LAUNCHES:-600}" "$BIN" "${args[@]}" >"$OUT/profile.csv" ||
    { tail -n 20 "$OUT/profile.csv"; return 1; }
  "$PY" scripts/kernel_profile.py ncu "$OUT/profile.csv" | tee "$OUT/profile.md"
  return "${PIPESTATUS[0]}"
}

export -f stage_build stage_data stage_ops suite stage_train stage_faults stage_sanitizer stage_startup \
  stage_bench stage_fmnist stage_profile

# ---- the runner: limits, the budget, the record of each stage ----
declare -A LIMIT=([build]=240 [data]=90 [ops]=120 [train]=300 [faults]=180 [sanitizer]=600 [startup]=60 [bench]=420
  [fmnist]=180 [profile]=150)
T0=$SECONDS
RECORD=$OUT/stages.tsv
: >"$RECORD"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "mode: $([ "$STANDIN" = 1 ] && echo "CPU stand-in (build/sim)" || echo GPU)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1)"
  echo "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -n 1)"
  echo "cores: $NPROC; budget: $BUDGET s"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

# --stages runs its stages in the order given (the slowest last, where a window is short); the others
# are recorded as not asked for
ORDER=$ALL
[ "$STAGES" = all ] || ORDER=${STAGES//,/ }
for name in $ALL; do
  [[ " $ORDER " == *" $name "* ]] || printf '%s\tskipped\t0\t0\tnot asked for (--stages %s)\n' "$name" "$STAGES" >>"$RECORD"
done
n=0
for name in $ORDER; do
  n=$((n + 1))
  log="$OUT/$(printf %02d $n)-$name.log"
  left=$((BUDGET - (SECONDS - T0)))
  var=GPU_CHECK_LIMIT_${name^^}
  limit=${!var:-${LIMIT[$name]}}
  if [ "$left" -lt 20 ]; then
    printf '%s\tskipped\t0\t%s\tno time left in the budget of %s s\n' "$name" "$limit" "$BUDGET" >>"$RECORD"
    echo "== $name: skipped (no time left)"
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit $limit s)"
  t=$SECONDS
  timeout --kill-after=10 "$limit" bash -c "stage_$name" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=passed why= ;;
    124 | 137) status="timed out" why="past its limit of $limit s" ;;
    3) status=skipped why=$(tail -n 1 "$log") ;;
    *) status=failed why="exit $rc" ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" $((SECONDS - t)) "$limit" "$why" >>"$RECORD"
  echo "== $name: $status in $((SECONDS - t)) s${why:+ ($why)}"
done

# ---- the summary: summary.json and summary.md from the record and the logs ----
"$PY" - "$OUT" <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
env = dict(l.split(": ", 1) for l in open(os.path.join(out, "env.log")).read().splitlines() if ": " in l)
stages = []
for line in open(os.path.join(out, "stages.tsv")):
    name, status, seconds, limit, why = line.rstrip("\n").split("\t")
    logs = glob.glob(os.path.join(out, f"[0-9][0-9]-{name}.log"))
    text = open(logs[0], errors="replace").read() if logs else ""
    s = {"stage": name, "status": status, "seconds": int(seconds), "limit_s": int(limit), "why": why,
         "log": os.path.basename(logs[0]) if logs else None}
    if name == "ops":
        s["passed"] = len(re.findall(r"^ok \d+ ", text, re.M))
        s["failed"] = re.findall(r"^not ok \d+ - (\S+)", text, re.M)
    elif name in ("train", "faults"):
        s["passed"] = len([l for l in re.findall(r"^ok - (.*)$", text, re.M) if "# SKIP" not in l])
        s["skipped"] = re.findall(r"^ok - (\S+) # SKIP (.*)$", text, re.M)
        s["failed"] = re.findall(r"^not ok - (\S+)", text, re.M)
    elif name == "sanitizer":
        runs = []
        for tool, target, body, rc in re.findall(r"^=== (\w+) (\w+) ===\n(.*?)^=== \1 \2: exit (\d+) ===$", text, re.M | re.S):
            errs = re.findall(r"^sanitizer: (\d+) errors", body, re.M)
            runs.append({"tool": tool, "target": target, "exit": int(rc),
                         "errors": int(errs[-1]) if errs else None})
        s["runs"] = runs
    elif name == "startup":
        m = re.search(r"first step: ([\d.]+) s \(median of (\d+)\), start-up ([\d.]+) s", text)
        if m:
            s["first_step_s"], s["startup_s"] = float(m.group(1)), float(m.group(3))
    elif name == "bench":
        s["tables"] = [l for l in text.splitlines() if l.startswith("|")]
        s["notes"] = [l for l in text.splitlines() if l and not l.startswith("|")][-12:]
    elif name == "profile":
        s["kernels"] = [l for l in text.splitlines() if l.startswith("| ") and not l.startswith("| kernel")]
    elif name == "fmnist":
        acc = re.findall(r"val_acc ([\d.]+)", text)
        done = re.search(r"done: (\d+) steps in ([\d.]+) s", text)
        wall = re.search(r"exit \d+, ([\d.]+) s from launch to exit", text)
        s["val_acc"] = float(acc[-1]) if acc else None
        s["steps"], s["train_s"] = (int(done.group(1)), float(done.group(2))) if done else (None, None)
        s["wall_s"] = float(wall.group(1)) if wall else None
    stages.append(s)
json.dump({"env": env, "stages": stages}, open(os.path.join(out, "summary.json"), "w"), indent=1)

def detail(s):
    if not s["log"]:
        return s["why"]
    if s["stage"] == "ops" and "passed" in s:
        return f"{s['passed']} passed, {len(s['failed'])} failed" + (": " + ", ".join(s["failed"]) if s["failed"] else "")
    if s["stage"] in ("train", "faults") and "passed" in s:
        d = f"{s['passed']} passed, {len(s['failed'])} failed, {len(s['skipped'])} skipped"
        return d + (": " + ", ".join(s["failed"]) if s["failed"] else "")
    if s["stage"] == "sanitizer" and s.get("runs"):
        return "; ".join(f"{r['tool']} {r['target']}: " + ("no summary (exit %d)" % r["exit"] if r["errors"] is None
                                                           else f"{r['errors']} errors") for r in s["runs"])
    if s["stage"] == "startup" and "first_step_s" in s:
        return f"launch to the end of step 1: {s['first_step_s']:.3f} s (start-up {s['startup_s']:.3f} s)"
    if s["stage"] == "profile" and s.get("kernels"):
        return "top kernels: " + "; ".join(" ".join(k.strip("| ").split(" | ")[i] for i in (0, 3)) for k in s["kernels"][:3])
    if s["stage"] == "fmnist" and s.get("wall_s") is not None:
        acc = f"{100 * s['val_acc']:.2f}%" if s["val_acc"] is not None else "no accuracy logged"
        return f"{s['steps']} steps, {s['train_s']} s training, {s['wall_s']} s from launch; test accuracy {acc}"
    return s["why"]

md = [f"# GPU check: {env.get('mode', '?')}, {env.get('date', '')}", "",
      f"- GPU: {env.get('gpu', 'none')}", f"- {env.get('nvcc', '')}".rstrip(), f"- python: {env.get('python', '')}",
      f"- git: {env.get('git', '')}", "", "| stage | status | seconds | details |", "|---|---|---|---|"]
md += [f"| {s['stage']} | {s['status']} | {s['seconds']} | {detail(s)} |" for s in stages]
bench = next((s for s in stages if s["stage"] == "bench" and s.get("tables")), None)
if bench:
    md += ["", "## Benchmarks", ""] + bench["tables"] + [""] + bench["notes"]
prof = next((s for s in stages if s["stage"] == "profile" and s.get("kernels")), None)
if prof:
    md += ["", "## Top kernels", "", "| kernel | launches | total ms | share | mean us |", "|---|---|---|---|---|"]
    md += prof["kernels"]
open(os.path.join(out, "summary.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
