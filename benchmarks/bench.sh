#!/usr/bin/env bash
# `make bench`: the GPU table (benchmarks/gpu_bench.sh) when ddp_train --info shows a GPU and PyTorch
# sees one too (torch.cuda.is_available(), or BENCH_TORCH_DEVICE=cpu to run PyTorch's side on the CPU);
# otherwise says why and prints the CPU table (benchmarks/cpu_bench.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/usr/bin/python3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ddp=${BENCH_DDP_BINARY:-./ddp_train}
torch_python=${BENCH_TORCH_PYTHON:-$PYTHON}

info=$("$ddp" --info 2>/dev/null || true)
why=
if ! grep -q '^  GPU ' <<<"$info"; then
  why="$ddp --info shows none"
elif [ "${BENCH_TORCH_DEVICE:-cuda}" = cuda ] &&
  ! "$torch_python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  why="PyTorch in $torch_python sees none; BENCH_TORCH_PYTHON names another Python"
fi
if [ -n "$why" ]; then
  echo "no GPU: CPU table ($why)"
  echo
  bash benchmarks/cpu_bench.sh
  echo
  echo "start-up (benchmarks/startup.py):"
  echo
  exec "${PYTHON:-/usr/bin/python3}" benchmarks/startup.py --runs "${BENCH_PAIRS:-5}"
fi
if [ "${BENCH_TORCH_DEVICE:-cuda}" = cuda ]; then
  echo "GPU table: ddp_train ($ddp) and PyTorch on the same GPU"
else
  echo "GPU table: ddp_train ($ddp) on the GPU, PyTorch on $BENCH_TORCH_DEVICE (BENCH_TORCH_DEVICE)"
fi
echo
exec bash benchmarks/gpu_bench.sh
