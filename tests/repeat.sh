#!/usr/bin/env bash
# Runs the test suites N times in a row and reports every test that failed in any run: a test
# that fails one run in twenty blocks everyone's landing.
#   tests/repeat.sh N [SUITE...]      no suites: everything run.sh runs (as `make test` does)
# Takes run.sh's environment (BUILD, SIM, DDP_TRAIN_GPU_BINARY, PYTHON); `make repeat N=20` sets it.
# Each run's log is kept in the directory printed at the end.
set -u
cd "$(dirname "$0")/.."
n=${1:?usage: tests/repeat.sh N [SUITE...]}
shift
logs=$(mktemp -d /tmp/ddp_train_repeat_XXXXXX)
passed=0
for i in $(seq 1 "$n"); do
  t0=$SECONDS
  if DDP_TRAIN_SUITES="$*" bash tests/run.sh >"$logs/run-$i.log" 2>&1; then passed=$((passed + 1)); fi
  echo "run $i of $n: $(tail -n 1 "$logs/run-$i.log") ($((SECONDS - t0)) s)"
done
echo "$passed of $n runs passed; logs in $logs"
failures=$(grep -h "^not ok" "$logs"/run-*.log | grep -v "# SKIP" | sed 's/^not ok [0-9]* *-* *//' | sort | uniq -c | sort -rn)
if [ -n "$failures" ]; then
  echo "tests that failed (runs, test):"
  echo "$failures"
fi
[ "$passed" -eq "$n" ]
