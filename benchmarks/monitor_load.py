"""What the monitor costs training (issue 14): one 2-rank run with monitor.listen on, alternating
phases without clients and with the bounded load of tests/test_monitor.py (4 client threads, 50
requests/s each: 2,000 requests per 10 s, cycling GET /health, /metrics, /status and /history), and
the training throughput of each phase from metrics.jsonl (log.every_steps 1: the samples of the
phase's steps over the sum of their step times). It prints one line per phase, the mean of each
kind and the overhead, and the CPU time of rank 0's HTTP thread per request. The clients run on the
same machine, so on a small one their own CPU use is part of the overhead.

    /usr/bin/python3 benchmarks/monitor_load.py [--workload cnn|small] [--history recent|all]
                                                [--phase-s 15] [--rounds 3] [--np 2] [--binary ./ddp_train]

cnn: configs/model.yaml on data/fashion_mnist.h5 (make data), about 0.26 s a step on 2 cores;
small: tests/test_monitor.py's 1-2 ms step, where per-request costs show most.
--history recent (the test's load): /history?since= 20 steps back; all: /history?since=0 every time, a
naive poller of the whole file (issue 25: thousands of records, the costliest request there is)."""
import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers import ENV, Workdir  # noqa: E402
from test_monitor import MONITOR_CNN, TOKEN, write_token  # noqa: E402


def request(addr, path, method="GET", token=None):
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request(method, path, headers={"Authorization": "Bearer " + token} if token else {})
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def launch(cmd):
    """Starts the ddp_train job of cmd (its output drained by a thread); returns the process and the
    monitor's HOST:PORT from its start-up line. Exits naming the output when the job ends first."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=ENV)
    lines = []
    threading.Thread(target=lambda: [lines.append(l) for l in p.stdout], daemon=True).start()
    while True:
        if p.poll() is not None:
            sys.exit("ddp_train exited:\n" + "".join(lines))
        for line in list(lines):
            m = re.match(r"monitor: listening on http://(\S+) ", line)
            if m:
                return p, m.group(1)
        time.sleep(0.1)


def phase_rate(records, s0, s1, batch):
    """(steps, samples/s) of the training records {step: record} of steps s0+1..s1: their samples over
    the sum of their step times."""
    steps = [records[s] for s in range(s0 + 1, s1 + 1) if s in records]
    return steps, len(steps) * batch / (sum(r["step_ms"] for r in steps) / 1e3) if steps else float("nan")


def descends_from(pid, ancestor):
    """Whether process pid is a descendant of process ancestor."""
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent
        except OSError:
            return False
        if pid == ancestor:
            return True
    return False


def rank0_pid(mpirun_pid, binary):
    """The ddp_train process of rank 0 under this mpirun (not another run's on the same machine)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if (cmd and os.path.basename(cmd[0].decode()) == os.path.basename(binary) and b"OMPI_COMM_WORLD_RANK=0" in env
                and descends_from(int(pid), mpirun_pid)):
            return int(pid)
    return None


def http_thread_cpu_s(pid):
    """CPU seconds of libmicrohttpd's thread (named MHD-single) in process pid; 0 when not found."""
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        if "(MHD-single)" in text:
            fields = text.rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return 0.0


def load(addr, seconds, done, failures, history="recent"):
    """4 clients at 50 requests/s each for `seconds`. done: [requests, /history answers, their bytes]."""
    paths = ["/health", "/metrics", "/status", "/history?since=%d" if history == "recent" else "/history?since=0"]
    latest = [0]

    def client(k):
        n = int(seconds * 50)
        t0 = time.monotonic()
        for i in range(n):
            path = paths[(i + k) % 4]
            if "%d" in path:
                path = path % max(0, latest[0] - 20)
            try:
                status, body = request(addr, path)
                if status != 200:
                    failures.append(f"{path}: {status}")
                elif path == "/health":
                    latest[0] = max(latest[0], json.loads(body)["step"])
                elif path.startswith("/history"):
                    done[1] += 1
                    done[2] += len(body)
            except Exception as e:  # noqa: BLE001
                failures.append(f"{path}: {e!r}")
            done[0] += 1
            pause = t0 + (i + 1) / 50 - time.monotonic()
            if pause > 0:
                time.sleep(pause)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("cnn", "small"), default="cnn")
    ap.add_argument("--history", choices=("recent", "all"), default="recent")
    ap.add_argument("--phase-s", type=float, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--binary", default=os.path.join(ROOT, "ddp_train"))
    a = ap.parse_args()
    w = Workdir()
    token = write_token(w)
    if a.workload == "cnn":
        cfg = os.path.join(ROOT, "configs", "model.yaml")
        batch = 256
        sets = ["train.epochs=100", f"log.dir={w.file('log')}", f"checkpoint.dir={w.file('ckpt')}",
                "monitor.listen=127.0.0.1:0"]
    else:
        w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)
        cfg = w.config(MONITOR_CNN, steps=10 ** 9, log_every=1)
        batch = 32
        sets = []
    sets += ["log.every_steps=1", "train.eval_every_steps=0", "checkpoint.every_epochs=0",
             f"monitor.token_file={token}"]
    cmd = ["mpirun", "--oversubscribe", "-np", str(a.np), a.binary, cfg]
    for s in sets:
        cmd += ["--set", s]
    p, addr = launch(cmd)
    pid = rank0_pid(p.pid, a.binary)
    while json.loads(request(addr, "/health")[1]).get("step", 0) < 3:  # past the first steps' warm-up
        time.sleep(0.2)
    phases = []  # (kind, first step, last step, requests, failures, HTTP-thread CPU s)
    history_bytes = []  # mean bytes of a /history answer, per load phase
    kinds = ["idle"] + ["load", "idle"] * a.rounds
    for kind in kinds:
        s0 = json.loads(request(addr, "/health")[1])["step"]
        cpu0 = http_thread_cpu_s(pid) if pid else 0.0
        done, failures = [0, 0, 0], []
        if kind == "load":
            load(addr, a.phase_s, done, failures, a.history)
        else:
            time.sleep(a.phase_s)
        s1 = json.loads(request(addr, "/health")[1])["step"]
        cpu1 = http_thread_cpu_s(pid) if pid else 0.0
        phases.append((kind, s0, s1, done[0], len(failures), cpu1 - cpu0))
        if kind == "load":
            history_bytes.append(done[2] / max(done[1], 1))
    request(addr, "/stop", "POST", token=TOKEN)
    rc = p.wait(timeout=600)
    records = {r["step"]: r for r in (json.loads(l) for l in open(w.file("log/metrics.jsonl"))) if "loss" in r}
    print(f"workload {a.workload}, /history {a.history}, {a.np} ranks, global batch {batch}, phases of {a.phase_s:.0f} s; "
          f"ddp_train exit {rc} (75: stopped by POST /stop)")
    print("| phase | steps | samples/s | requests | failed | HTTP thread CPU s |")
    print("|---|---|---|---|---|---|")
    rates = {"idle": [], "load": []}
    for kind, s0, s1, n, bad, cpu in phases:
        steps, sps = phase_rate(records, s0, s1, batch)
        rates[kind].append(sps)
        print(f"| {kind} | {len(steps)} | {sps:.1f} | {n} | {bad} | {cpu:.2f} |")
    idle = sum(rates["idle"]) / len(rates["idle"])
    busy = sum(rates["load"]) / len(rates["load"])
    n = sum(ph[3] for ph in phases)
    cpu = sum(ph[5] for ph in phases if ph[0] == "load")
    print(f"mean samples/s without clients {idle:.1f}, with 200 requests/s {busy:.1f}: "
          f"overhead {100 * (1 - busy / idle):.2f}%; HTTP thread {1e3 * cpu / max(n, 1):.2f} ms CPU per request; "
          f"a /history answer {sum(history_bytes) / len(history_bytes) / 1024:.0f} KiB on average")
    w.cleanup()


if __name__ == "__main__":
    main()
