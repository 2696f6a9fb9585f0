"""scripts/scaling.py's model against measurement on this machine (make bench-scaling): for each
rank count, build/allreduce_bench measures the all-reduce (the `measured` link preset), ddp_train
trains the config on that many ranks (one thread each, a fixed batch per rank: weak scaling), and
the model predicts the run's step time from the run's own compute times (forward, backward less its
MPI calls, update, host work) and the measured all-reduce; the prediction is set against the run's
measured step time (medians of the logged intervals after the first). With more ranks than cores the
ranks take turns on the cores and their wall-clock compute times show whatever interleaving the
scheduler chose, so the checked prediction takes the compute of the run with one rank per core
(np = cores) times the share (ranks x threads / cores) instead. A third prediction takes the compute
from the 1-rank run (what a projection from one GPU does); it is reported, not checked: on this
machine two ranks computing side by side each run slower than one alone (shared caches and memory
bandwidth), which the network model does not claim to predict.

Another process using the CPUs spoils both measurements (a rank descheduled mid-collective stalls
every rank): each measurement counts the CPU time used by processes other than its own, and one
in which they took more than --busy-limit of the machine is repeated (up to --attempts times), then
reported as busy.

    /usr/bin/python3 benchmarks/scaling_validate.py [--config configs/model.yaml] [--nps 2,4]
        [--rank-batch 32] [--steps 60] [--every 5] [--set KEY=VALUE ...] [--json]

Exits 0 when every rank count was measured quiet and predicted within --tolerance (15%), 1 when one
was not within it, 2 when the machine stayed busy. --two-nodes adds 2 ranks on two nodes: the network
namespaces of tests/netns_cluster.py (a CPU each, TCP over a veth pair; root and sshd needed)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import scaling  # noqa: E402

BENCH = os.path.join(ROOT, "build", "allreduce_bench")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_busy_s():
    """Busy CPU seconds of the whole machine since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / TICK


def tree_cpu_s(pid):
    """CPU seconds of a process and of its children it has reaped (utime, stime, cutime, cstime)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in v[11:15]) / TICK
    except OSError:
        return 0.0


def children_of(pids):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) in pids:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def others_share(fn, own_pids=()):
    """Runs fn(); returns (its result, the share of the machine's CPU time that processes other than
    this one, its children and own_pids (with what they reaped) used meanwhile, 0..1). own_pids: the
    two-node cluster's sshds, which start node B's ranks; their sessions are given 2 s to end and be
    reaped, so that the ranks' CPU time is theirs by the end."""
    own = lambda: sum(tree_cpu_s(p) for p in own_pids)  # noqa: E731
    t0, b0, o0, x0 = time.monotonic(), cpu_busy_s(), os.times(), own()
    out = fn()
    deadline = time.monotonic() + 2
    while own_pids and children_of(own_pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    t1, b1, o1, x1 = time.monotonic(), cpu_busy_s(), os.times(), own()
    mine = sum(o1[:4]) - sum(o0[:4]) + x1 - x0  # user, system, children's user and system
    wall = max(t1 - t0, 1e-9)
    return out, max(0.0, (b1 - b0 - mine) / (wall * os.cpu_count()))


def quietly(fn, busy_limit, attempts, what, log, own_pids=()):
    """fn() until a run where other processes took at most busy_limit of the CPUs: (result, share,
    quiet). The last attempt's result when none was quiet."""
    for i in range(attempts):
        out, share = others_share(fn, own_pids)
        if share <= busy_limit:
            return out, share, True
        log(f"  {what}: other processes used {share * 100:.0f}% of the CPUs; again in 5 s ({i + 1}/{attempts})")
        time.sleep(5)
    return out, share, False


class Local:
    """mpirun on this machine: every rank on one node."""

    name, nodes, own_pids = "one node", 1, ()

    def __init__(self, mpirun="mpirun"):
        self.mpirun = mpirun

    def run(self, np_, argv, timeout):
        cmd = [self.mpirun, "--oversubscribe", "-np", str(np_)] + argv
        p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT)
        return cmd, p.returncode, p.stderr


class TwoNodes:
    """mpirun from node A of tests/netns_cluster.py's two network namespaces (one CPU each, TCP over a
    veth pair, ssh): one rank per node."""

    name, nodes = "two nodes", 2

    def __init__(self, cluster):
        self.c = cluster
        self.own_pids = tuple(cluster.node_pid(n) for n in "ab")

    def run(self, np_, argv, timeout):
        cmd = ["mpirun", "-np", str(np_), "--hostfile", self.c.hostfile(1), "--map-by", "ppr:1:node",
               "--bind-to", "none"] + argv
        rc, _, err = self.c.run("a", cmd, env=self.c.mpi_env(ENV), timeout=timeout, cwd=ROOT)
        return cmd, rc, err


def run_bench(launcher, np_, out, max_bytes, budget_s=0.15, samples=15, bench=BENCH):
    cmd, rc, err = launcher.run(np_, [bench, "--out", out, "--max-bytes", str(max_bytes), "--budget-s", str(budget_s),
                                      "--samples", str(samples), "--ops", "iallreduce"], 600)
    if rc:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}: {err[-2000:]}")
    with open(out) as f:
        return json.load(f)


def run_train(launcher, np_, config, log_dir, rank_batch, steps, every, sets=(),
              binary=os.path.join(ROOT, "ddp_train")):
    argv = [binary, config, "--set", f"train.global_batch_size={rank_batch * np_}", "--set",
            f"train.max_steps={steps}", "--set", "train.epochs=1000", "--set", "dist.threads=1", "--set",
            f"log.dir={log_dir}", "--set", f"log.every_steps={every}", "--set", "checkpoint.dir="]
    for s in sets:
        argv += ["--set", s]
    cmd, rc, err = launcher.run(np_, argv, 1200)
    if rc:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}: {err[-2000:]}")
    return scaling.Profile(os.path.join(log_dir, "metrics.jsonl"), skip=1)


def validate(config, nps, rank_batch, steps, every, sets=(), tolerance=0.15, busy_limit=0.1, attempts=3,
             workdir=None, log=print, mpirun="mpirun", bench=BENCH, binary=os.path.join(ROOT, "ddp_train"),
             cluster=None):
    """Measures and predicts; returns a list of rows (dicts), one per rank count on one node (in
    increasing order), then (cluster: a started netns_cluster.Cluster) 2 ranks on two nodes; and the
    1-rank profile.

    Each row's prediction is checked (`checked_error`, `passed`) with compute times from a run in
    which no core was shared: the row's own run where ranks x threads fit the node's cores; else, as
    a rank's wall-clock compute times then include the turns other ranks took on its core (as much
    as the scheduler happened to interleave them), the run with exactly one rank per core, times the
    share (the 1-rank run when there is none). The prediction from the 1-rank run (what a
    projection does) is reported beside it."""
    tmp = tempfile.TemporaryDirectory(prefix="ddp_scaling_") if workdir is None else None
    wd = workdir or tmp.name
    local = Local(mpirun)
    cases = [(local, n) for n in sorted(nps)] + ([(TwoNodes(cluster), 2)] if cluster else [])
    try:
        def train(launcher, n):
            log_dir = os.path.join(wd, f"np{n}-{launcher.nodes}-{time.monotonic_ns()}")
            return run_train(launcher, n, config, log_dir, rank_batch, steps, every, sets, binary)

        one, share1, quiet1 = quietly(lambda: train(local, 1), busy_limit, attempts, "1 rank", log)
        profiles = {1: (one, share1, quiet1)}  # one node, by rank count
        max_bytes = 4
        while max_bytes < 2 * max(max(b for b, _ in one.buckets), scaling.AGREE_BYTES * max(list(nps) + [2])):
            max_bytes *= 2
        rows = []
        for launcher, n in cases:
            out = os.path.join(wd, f"allreduce_np{n}_{launcher.nodes}.json")
            fitted, bshare, bquiet = quietly(lambda: run_bench(launcher, n, out, max_bytes, bench=bench), busy_limit,
                                             attempts, f"allreduce_bench -np {n} ({launcher.name})", log,
                                             launcher.own_pids)
            prof, tshare, tquiet = quietly(lambda: train(launcher, n), busy_limit, attempts,
                                           f"ddp_train -np {n} ({launcher.name})", log, launcher.own_pids)
            if launcher is local:
                profiles[n] = (prof, tshare, tquiet)
            measured = {(fitted["ranks"], fitted["nodes"]): fitted}
            cores = os.cpu_count() // launcher.nodes  # a node's share of this machine
            sleep = fitted["host_sleep_s"]
            net = scaling.Network("measured", "measured", prof.local_size, measured)
            same, _ = scaling.predict(prof, net, n, "host", cores, sleep)
            cross, _ = scaling.predict(one, net, n, "host", cores, sleep)
            shared = same["share"] > 1
            full = max((k for k in profiles if k * one.threads <= cores), default=1)
            ref, rshare, rquiet = profiles[full] if shared else (prof, tshare, tquiet)
            checked, _ = scaling.predict(ref, net, n, "host", cores, sleep) if shared else (same, None)
            err = lambda parts: parts["step"] / prof.step_s - 1  # noqa: E731
            rows.append({
                "ranks": n, "nodes": launcher.nodes, "measured_s": prof.step_s, "parts": same,
                "predicted_s": same["step"], "error": err(same),
                "cross_predicted_s": cross["step"], "cross_error": err(cross),
                "checked_basis": f"{full} rank(s) x share" if shared else "same run",
                "checked_predicted_s": checked["step"], "checked_error": err(checked),
                "passed": abs(err(checked)) <= tolerance, "shared_cores": shared,
                "quiet": bquiet and tquiet and rquiet, "others_share": max(bshare, tshare, rshare),
                "compute_s": prof.compute_s(), "compute_1_s": one.compute_s(), "threads": prof.threads,
                "measured_comm_s": prof.backward_mpi_s + prof.comm_wait_s + prof.agree_s,
                "predicted_comm_s": same["comm_total"] + same["agree"] + same["wake"],
                "fit": fitted["ops"]["iallreduce"]["segments"]})
        return rows, one
    finally:
        if tmp:
            tmp.cleanup()


def table(rows, one):
    lines = [f"1 rank: {one.step_s * 1e3:.3f} ms/step (compute {one.compute_s() * 1e3:.3f} ms), "
             f"{one.grad_bytes / 1e6:.2f} MB of gradients in {len(one.buckets)} bucket(s)",
             "predicted with the compute times of: the same run; the checked basis (the same run, or with more "
             "ranks than cores the run with one rank per core, times the share); the 1-rank run",
             f"{'ranks':>5} {'nodes':>5} {'measured ms':>11} {'same run':>15} {'checked':>15} {'1 rank':>15} "
             f"{'share':>5} {'comm model ms':>13} {'comm measured ms':>16} {'quiet':>5}"]
    for r in rows:
        p = r["parts"]
        cell = lambda s, e: f"{s * 1e3:.3f} ({e * 100:+.1f}%)"  # noqa: E731
        lines.append(f"{r['ranks']:>5} {r['nodes']:>5} {r['measured_s'] * 1e3:>11.3f} "
                     f"{cell(r['predicted_s'], r['error']):>15} "
                     f"{cell(r['checked_predicted_s'], r['checked_error']):>15} "
                     f"{cell(r['cross_predicted_s'], r['cross_error']):>15} {p['share']:>5.2f} "
                     f"{r['predicted_comm_s'] * 1e3:>13.3f} {r['measured_comm_s'] * 1e3:>16.3f} "
                     f"{'yes' if r['quiet'] else 'NO':>5}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "model.yaml"))
    ap.add_argument("--nps", default="2,4")
    ap.add_argument("--rank-batch", type=int, default=32, help="samples per rank per step (weak scaling)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5, help="log.every_steps: one timing record per this many steps")
    ap.add_argument("--set", action="append", default=[], help="more --set options for ddp_train")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--busy-limit", type=float, default=0.1)
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--two-nodes", action="store_true",
                    help="also 2 ranks on two nodes (tests/netns_cluster.py: network namespaces, root, sshd)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not os.path.exists(BENCH):
        print(f"scaling_validate.py: {BENCH} is missing: make build/allreduce_bench", file=sys.stderr)
        return 2
    mpirun = os.environ.get("MPIRUN", "mpirun")
    log = (lambda s: print(s, file=sys.stderr)) if a.json else print
    cluster = None
    if a.two_nodes:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from netns_cluster import Cluster  # noqa: E402
        why = Cluster.why_not()
        if why:
            print(f"scaling_validate.py: no two-node cluster here: {why}", file=sys.stderr)
            return 2
        cluster = Cluster()
    try:
        if cluster:
            cluster.start()
        rows, one = validate(a.config, [int(x) for x in a.nps.split(",")], a.rank_batch, a.steps, a.every, a.set,
                             a.tolerance, a.busy_limit, a.attempts, log=log, mpirun=mpirun, cluster=cluster)
    finally:
        if cluster:
            cluster.close()
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{os.path.relpath(a.config, ROOT)}, {a.rank_batch} samples per rank, 1 thread per rank, "
              f"{os.cpu_count()} cores; medians of {a.every}-step intervals")
        print(table(rows, one))
    if not all(r["quiet"] for r in rows):
        return 2
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
