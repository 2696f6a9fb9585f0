#!/usr/bin/python3
"""Seconds from launching a command to the first stdout lines that match READY and DONE, the
median of N launches (gpu_bench.sh's first-step row, gpu_check.sh's startup stage).

  launch_time.py [--timeout S] N READY DONE command...

Prints each launch on stderr (with ddp_train's "start-up:" and "cuda: GPU" lines, where its start-up time went) and
`DONE_MEDIAN READY_MEDIAN` on stdout; exits 1 naming the command when it fails, a line is missing or a launch
runs past S seconds (then killed)."""
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time


def kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended as the time ran out
        pass


def main():
    args, limit = sys.argv[1:], None
    if args[:1] == ["--timeout"]:
        limit, args = float(args[1]), args[2:]
    n, ready, done, cmd = int(args[0]), args[1], args[2], args[3:]
    got = []
    for i in range(n):
        seen, breakdown, t0 = {}, "", time.perf_counter()
        # with a limit, a session of its own, so that a launch past it is killed with whatever it started;
        # then a signal that ends this script (a stage's timeout) ends the launch too, being outside its group
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                             start_new_session=limit is not None)
        killer = None
        if limit:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, lambda signum, frame, pid=p.pid: (kill_group(pid), sys.exit(128 + signum)))
            killer = threading.Timer(limit, kill_group, (p.pid,))
            killer.daemon = True
            killer.start()
        for line in p.stdout:
            if line.startswith(("start-up:", "cuda: GPU")):  # where start-up went, and the device phase's part
                breakdown += ", " + line.strip()
            for key, pattern in (("ready", ready), ("done", done)):
                if key not in seen and re.match(pattern, line):
                    seen[key] = time.perf_counter() - t0
        p.wait()
        if killer:
            killer.cancel()
        if p.returncode != 0 or len(seen) != 2:
            late = f" (killed past --timeout {limit:g} s)" if limit and time.perf_counter() - t0 >= limit else ""
            sys.exit(f"launch_time.py: {' '.join(cmd)}: exit {p.returncode}{late}, lines seen: {sorted(seen)}")
        got.append((seen["done"], seen["ready"]))
        print(f"launch {i + 1}: {seen['done']:.3f} s to DONE, {seen['ready']:.3f} s to READY{breakdown}",
              file=sys.stderr)
    print(" ".join(f"{statistics.median(g[k] for g in got):.3f}" for k in range(2)))


if __name__ == "__main__":
    main()
