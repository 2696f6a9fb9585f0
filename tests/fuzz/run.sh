#!/usr/bin/env bash
# Runs the libFuzzer harnesses side by side (each is one process on one core; make test's 30 s for
# three takes 30 s of the clock, not 90), each for SECONDS or RUNS executions (0: no limit),
# whichever comes first, over the committed seeds and regression inputs; new inputs go to
# CORPUS_DIR/<harness> (a temporary directory when CORPUS_DIR is unset). One TAP line per harness:
# ok with its execution count, or not ok with the finding: its input and full log are saved under
# FINDINGS_DIR (default build/fuzz/findings). Exits nonzero on any finding.
#   tests/fuzz/run.sh SECONDS RUNS HARNESS...     (make fuzz; make test runs each for 30 s)
set -u
cd "$(dirname "$0")/../.."
seconds=${1:?usage: tests/fuzz/run.sh SECONDS RUNS HARNESS...}
runs=${2:?}
shift 2
FUZZ=${FUZZ:-build/fuzz}
findings=${FINDINGS_DIR:-$FUZZ/findings}
mkdir -p "$findings"
tmp=$(mktemp -d /tmp/ddp_train_fuzz_XXXXXX)
trap 'rm -rf "$tmp"' EXIT
# A size read from a corrupt file is refused by malloc past 2 GB (max_allocation_size_mb) with a
# NULL, as a normal build refuses what it cannot map, instead of being allocated and zeroed
# (HDF5 itself mallocs what a corrupt heap claims: 4.3 GB seen); HDF5 1.10's leaks on its own
# error paths are suppressed (tests/fuzz/lsan.supp); a small quarantine keeps the h5_probe fork
# cheap.
export ASAN_OPTIONS=allocator_may_return_null=1:max_allocation_size_mb=2048:quarantine_size_mb=8:detect_leaks=1
export LSAN_OPTIONS=suppressions=$PWD/tests/fuzz/lsan.supp UBSAN_OPTIONS=print_stacktrace=1
fuzz_one() { # harness, number: its TAP line to $tmp/<harness>.tap; the exit code is the finding's
  local h=$1 n=$2 corpus=${CORPUS_DIR:-$tmp}/$1 log=$tmp/$1.log t0=$SECONDS rc execs
  mkdir -p "$corpus"
  # -seed=1: the same mutations on every machine; -timeout: a hang is a finding
  "$FUZZ/fuzz_$h" -seed=1 -max_total_time="$seconds" -runs="$([ "$runs" -gt 0 ] && echo "$runs" || echo -1)" \
    -timeout=25 -rss_limit_mb=4096 -malloc_limit_mb=4096 -max_len=65536 -print_final_stats=1 -artifact_prefix="$findings/$h-" \
    "$corpus" "tests/fuzz/corpus/$h" "tests/fuzz/regressions/$h" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  if [ "$rc" -eq 0 ]; then
    echo "ok $n - fuzz_$h: ${execs:-?} executions in $((SECONDS - t0)) s, no finding" >"$tmp/$h.tap"
  else
    cp "$log" "$findings/$h.log"
    {
      echo "not ok $n - fuzz_$h: a finding after ${execs:-?} executions (exit $rc); its input and log are in $findings"
      grep -E "ERROR|SUMMARY|fuzz_$h:|^    #[0-9]+ " "$log" | tail -n 60 | sed 's/^/# /'
    } >"$tmp/$h.tap"
  fi
  return "$rc"
}

n=0 pids=()
for h in "$@"; do
  n=$((n + 1))
  fuzz_one "$h" "$n" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
for h in "$@"; do
  cat "$tmp/$h.tap"
done
exit $status
