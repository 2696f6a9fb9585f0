#!/usr/bin/python3
"""Seconds from launching a command to the first stdout lines that match READY and DONE, the
median of N launches (gpu_bench.sh's first-step row, gpu_check.sh's startup stage).

  launch_time.py N READY DONE command...

Prints each launch on stderr (with ddp_train's "start-up:" and "cuda: GPU" lines, where its start-up time went) and
`DONE_MEDIAN READY_MEDIAN` on stdout; exits 1 naming the command when it fails or a line is missing."""
import re
import statistics
import subprocess
import sys
import time


def main():
    n, ready, done, cmd = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    got = []
    for i in range(n):
        seen, breakdown, t0 = {}, "", time.perf_counter()
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        for line in p.stdout:
            if line.startswith(("start-up:", "cuda: GPU")):  # where start-up went, and the device phase's part
                breakdown += ", " + line.strip()
            for key, pattern in (("ready", ready), ("done", done)):
                if key not in seen and re.match(pattern, line):
                    seen[key] = time.perf_counter() - t0
        if p.wait() != 0 or len(seen) != 2:
            sys.exit(f"launch_time.py: {' '.join(cmd)}: exit {p.returncode}, lines seen: {sorted(seen)}")
        got.append((seen["done"], seen["ready"]))
        print(f"launch {i + 1}: {seen['done']:.3f} s to DONE, {seen['ready']:.3f} s to READY{breakdown}",
              file=sys.stderr)
    print(" ".join(f"{statistics.median(g[k] for g in got):.3f}" for k in range(2)))


if __name__ == "__main__":
    main()
