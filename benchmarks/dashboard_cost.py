"""What the dashboard page costs training (issue 29): one run of configs/model.yaml on Fashion-MNIST
with monitor.listen on, alternating phases with the browser on about:blank and with the dashboard
open in it (Debian's chromium, headless, driven by selenium: it polls /status and /history once a
second and redraws its charts). The training throughput of each phase comes from metrics.jsonl
(log.every_steps 1, the page's busiest case: the samples of the phase's steps over the sum of their
step times). It prints one line per phase, the mean of each kind and the drop, and the CPU time of
the browser's processes in each phase.

    /usr/bin/python3 benchmarks/dashboard_cost.py [--layout apart|shared] [--phase-s 20] [--rounds 3]
                                                  [--binary ./ddp_train] [--screenshot docs/dashboard.png]

--layout apart (the default): what the training node pays when the browser is elsewhere (a laptop,
through an ssh tunnel): 1 rank of 1 thread, bound to core 0 by mpirun, and the browser held to the
other cores. shared: 2 ranks on a 2-core machine with the browser on the same cores, the worst case,
where the browser's own drawing is part of the cost.
--screenshot saves the page at the end of the last open phase (the README's picture)."""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from helpers import Workdir  # noqa: E402
from monitor_load import http_thread_cpu_s, launch, phase_rate, rank0_pid, request  # noqa: E402
from test_dashboard import browser  # noqa: E402
from test_monitor import TOKEN, write_token  # noqa: E402


def tree_cpu_s(root_pid):
    """CPU seconds (user + system) of process root_pid and its descendants now alive."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, keep = 0.0, {root_pid}
    for _ in range(8):  # parents before children: a few passes reach every depth that matters
        for pid, (ppid, _) in stats.items():
            if ppid in keep:
                keep.add(pid)
    for pid in keep:
        total += stats.get(pid, (0, 0.0))[1]
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layout", choices=("apart", "shared"), default="apart")
    ap.add_argument("--binary", default=os.path.join(ROOT, "ddp_train"))
    ap.add_argument("--screenshot", default="")
    a = ap.parse_args()
    w = Workdir()
    token = write_token(w)
    cfg = os.path.join(ROOT, "configs", "model.yaml")
    batch = 256
    np_ = 1 if a.layout == "apart" else 2
    sets = ["dist.threads=1"] if a.layout == "apart" else []
    sets += ["train.epochs=100", f"log.dir={w.file('log')}", f"checkpoint.dir={w.file('ckpt')}",
            "monitor.listen=127.0.0.1:0", "log.every_steps=1", "train.eval_every_steps=50",
            "checkpoint.every_steps=200", f"monitor.token_file={token}"]
    cmd = ["mpirun", "--oversubscribe", "-np", str(np_), "--bind-to", "core", a.binary, cfg]
    for s in sets:
        cmd += ["--set", s]
    p, addr = launch(cmd)
    pid = rank0_pid(p.pid, a.binary)
    with open(f"/proc/{pid}/status") as f:
        rank_cpus = re.search(r"Cpus_allowed_list:\s*(\S+)", f.read()).group(1)
    if a.layout == "apart":  # this process, chromedriver and the browser it starts: off rank 0's core
        others = os.sched_getaffinity(0) - {int(c) for c in rank_cpus.split(",") if c.isdigit()}
        if not others or "-" in rank_cpus:
            sys.exit(f"--layout apart needs rank 0 on one core and another core free (rank 0: {rank_cpus})")
        os.sched_setaffinity(0, others)
    profile = tempfile.mkdtemp(prefix="ddp-chromium-")
    d = browser(profile)
    driver_pid = d.service.process.pid
    d.get("about:blank")
    while json.loads(request(addr, "/health")[1]).get("step", 0) < 3:  # past the first steps' warm-up
        time.sleep(0.2)
    phases = []  # (kind, first step, last step, browser CPU s, HTTP thread CPU s)
    for kind in ["closed"] + ["open", "closed"] * a.rounds:
        d.get(f"http://{addr}/" if kind == "open" else "about:blank")
        s0 = json.loads(request(addr, "/health")[1])["step"]
        b0, h0 = tree_cpu_s(driver_pid), http_thread_cpu_s(pid) if pid else 0.0
        time.sleep(a.phase_s)
        s1 = json.loads(request(addr, "/health")[1])["step"]
        b1, h1 = tree_cpu_s(driver_pid), http_thread_cpu_s(pid) if pid else 0.0
        phases.append((kind, s0, s1, b1 - b0, h1 - h0))
        if kind == "open" and a.screenshot and len(phases) == 2 * a.rounds:
            d.set_window_size(1400, 1060)  # the header, the cards, the charts and the rank table
            time.sleep(2)
            d.save_screenshot(a.screenshot)
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)
    request(addr, "/stop", "POST", token=TOKEN)
    rc = p.wait(timeout=600)
    records = {r["step"]: r for r in (json.loads(l) for l in open(w.file("log/metrics.jsonl"))) if "loss" in r}
    print(f"configs/model.yaml, {np_} rank{'s' if np_ > 1 else ''} (rank 0 on cpus {rank_cpus}; the browser on "
          f"cpus {','.join(map(str, sorted(os.sched_getaffinity(0))))}), global batch {batch}, phases of "
          f"{a.phase_s:.0f} s; ddp_train exit {rc} (75: stopped by POST /stop)")
    print("| phase | steps | samples/s | browser CPU s | rank 0's HTTP thread CPU s |")
    print("|---|---|---|---|---|")
    rates = {"closed": [], "open": []}
    for kind, s0, s1, bcpu, hcpu in phases:
        steps, sps = phase_rate(records, s0, s1, batch)
        rates[kind].append(sps)
        print(f"| {kind} | {len(steps)} | {sps:.1f} | {bcpu:.2f} | {hcpu:.3f} |")
    closed = sum(rates["closed"]) / len(rates["closed"])
    opened = sum(rates["open"]) / len(rates["open"])
    open_s = a.phase_s * a.rounds
    bcpu = sum(ph[3] for ph in phases if ph[0] == "open")
    print(f"mean samples/s with the page closed {closed:.1f}, open {opened:.1f}: drop {100 * (1 - opened / closed):.2f}%; "
          f"the browser used {100 * bcpu / open_s:.1f}% of a core while the page was open")
    w.cleanup()


if __name__ == "__main__":
    main()
