"""scripts/scaling.py: the step timing ddp_train writes to metrics.jsonl, the all-reduce formulas and
the overlap timeline on made-up numbers, the projection's command line, and
benchmarks/scaling_validate.py's procedure end to end (its accuracy is `make bench-scaling`'s)."""
import json
import os
import subprocess
import sys
import unittest

from helpers import BINARY, ROOT, TINY_CNN, Workdir, run

sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import scaling  # noqa: E402
import scaling_validate  # noqa: E402

# Enough gradient (2.7 MB in 6 buckets of dist.bucket_mb 0.5) against little compute (8 samples per
# rank) that the all-reduce is a third of a 2-rank step: TINY_CNN's 604 bytes would leave the
# all-reduce model nothing to predict.
WIDE_MLP = """\
model:
  input: [1, 6, 6]
  layers:
    - flatten: {{}}
    - linear: {{out: 4096}}
    - relu: {{}}
    - linear: {{out: 128}}
    - relu: {{}}
    - linear: {{out: 3}}
data:
  path: {dir}/data.h5
  scale: 0.00392156862745098
train: {{epochs: 1000, global_batch_size: 16, seed: 3}}
dist: {{bucket_mb: 0.5, threads: 1}}
optim: {{name: sgd, lr: 0.01, momentum: 0.9}}
log: {{dir: {dir}/log, every_steps: 20}}
checkpoint: {{dir: ""}}
"""


def write_metrics(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def record(**kw):
    r = {"step_s": 0.010, "data_s": 0.0, "forward_s": 0.002, "backward_s": 0.004, "backward_mpi_s": 0.0,
         "comm_wait_s": 0.0, "update_s": 0.001, "agree_s": 0.0, "world_size": 1, "local_size": 1, "threads": 1,
         "grad_accum": 1, "rank_batch": 32, "flops_per_sample": 1e6,
         "buckets": [{"bytes": 4e6, "ready_s": 0.001, "mpi_s": 0.0}, {"bytes": 4e6, "ready_s": 0.004, "mpi_s": 0.0}]}
    r.update(kw)
    return r


class Metrics(unittest.TestCase):
    def test_step_timing_fields(self):
        """A 2-rank run logs the step's parts and each bucket's size and ready time."""
        w = Workdir()
        try:
            w.dataset(n=64)
            cfg = w.config(TINY_CNN)
            rc, out, err = run([cfg, "--set", "dist.bucket_mb=0.0001", "--set", "log.every_steps=4",
                                "--set", "dist.threads=1"], np_=2)
            self.assertEqual(rc, 0, out + err)
            steps = [r for r in w.metrics() if "loss" in r]
            self.assertTrue(steps)
            for r in steps:
                self.assertEqual((r["world_size"], r["local_size"], r["threads"], r["grad_accum"]), (2, 2, 1, 1))
                self.assertEqual(r["rank_batch"], 4)
                self.assertGreater(r["flops_per_sample"], 0)
                # conv 4x1x3x3 + 4, linear 3x36 + 3: 151 floats, cut into buckets of 26 floats from the end
                self.assertEqual(sum(b["bytes"] for b in r["buckets"]), 151 * 4)
                self.assertEqual([b["bytes"] for b in r["buckets"]], [104] * 5 + [84])
                for k in ("step_s", "forward_s", "backward_s", "update_s"):
                    self.assertGreater(r[k], 0, k)
                parts = sum(r[k] for k in ("data_s", "forward_s", "backward_s", "comm_wait_s", "update_s", "agree_s"))
                self.assertLessEqual(parts, r["step_s"] * 1.001)
                ready = [b["ready_s"] for b in r["buckets"]]
                self.assertEqual(ready, sorted(ready))  # the buffer's end is ready first
                self.assertLessEqual(ready[-1], r["backward_s"])
                for b in r["buckets"]:
                    self.assertLessEqual(b["mpi_s"], b["ready_s"])
                self.assertLessEqual(r["backward_mpi_s"], r["backward_s"])
                self.assertAlmostEqual(r["comm_wait_s"] * 1e3, r["comm_ms"], delta=0.002)
        finally:
            w.cleanup()


class Model(unittest.TestCase):
    def test_allreduce_formulas(self):
        net = scaling.Network("nvlink4", "ib-ndr400", 8)
        a_i, b_i = scaling.LINKS["nvlink4"]["alpha_s"], scaling.LINKS["nvlink4"]["bw"]
        a_e, b_e = scaling.LINKS["ib-ndr400"]["alpha_s"], scaling.LINKS["ib-ndr400"]["bw"]
        n = 25 * 2 ** 20
        for size in (8, n):  # one node: ring 14 alpha + 7/4 n/B against a chain's 14 alpha + 2 n/B
            t, algo = net.allreduce(size, 8)
            self.assertEqual(algo, "ring")
            self.assertAlmostEqual(t, 14 * a_i + 2 * 7 / 8 * size / b_i, places=12)
        # 64 GPUs on 8 nodes, 25 MiB: reduce-scatter and all-gather in the node, n/8 across nodes
        t, algo = net.allreduce(n, 64)
        self.assertTrue(algo.startswith("hierarchical"), algo)
        rs = 7 * a_i + 7 / 8 * n / b_i
        across = min(2 * 7 * a_e + 2 * 7 / 8 * (n / 8) / b_e, 2 * 3 * a_e + 2 * (n / 8) / b_e)
        self.assertAlmostEqual(t, 2 * rs + across, places=12)
        # 512 GPUs, a small message: the tree's log2 latency beats the ring's 2(p-1) steps
        t, algo = net.allreduce(4096, 512)
        self.assertNotEqual(algo, "ring")
        self.assertLess(t, 2 * 511 * a_i)
        self.assertEqual(net.allreduce(n, 1), (0.0, "none"))

    def test_overlap_timeline(self):
        """Bucket k's all-reduce starts when it is ready and after bucket k-1's; the step waits for the last."""
        w = Workdir()
        try:
            path = w.file("m.jsonl")
            write_metrics(path, [record(), record()])
            prof = scaling.Profile(path, skip=0)
            net = scaling.Network("nvlink4", "nvlink4", 8)
            t8 = net.allreduce(4e6, 8)[0]
            parts, _ = scaling.predict(prof, net, 8, "async", host_sleep_s=0)
            end = max(max(0.001 + t8, 0.004) + t8, 0)
            self.assertAlmostEqual(parts["exposed"], max(0, end - 0.004), places=12)
            host = 0.010 - 0.002 - 0.004 - 0.001
            agree = 3 * scaling.LINKS["nvlink4"]["alpha_s"]  # log2(8) steps of the all-gather
            self.assertAlmostEqual(parts["step"], 0.002 + 0.004 + parts["exposed"] + 0.001 + host + agree, places=12)
            one, _ = scaling.predict(prof, net, 1, "async", host_sleep_s=0)
            self.assertAlmostEqual(one["step"], 0.010, places=12)
            # host progress: nothing overlaps, and 4 ranks on 2 cores take turns
            serial, _ = scaling.predict(prof, scaling.Network("nvlink4", "nvlink4", 4), 4, "host", cores=2,
                                        host_sleep_s=0)
            self.assertEqual(serial["share"], 2)
            t4 = net.allreduce(4e6, 4)[0]
            self.assertAlmostEqual(serial["step"], 2 * 0.010 + 2 * t4 + 2 * scaling.LINKS["nvlink4"]["alpha_s"],
                                   places=12)
        finally:
            w.cleanup()

    def test_projection_command_line(self):
        w = Workdir()
        try:
            path = w.file("m.jsonl")
            write_metrics(path, [record(step=i) for i in range(3)])
            p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "scaling.py"), path, "--gpus",
                                "8,64,512", "--intra", "nvlink4", "--inter", "ib-ndr400", "--gpu", "h100", "--json"],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            rows = json.loads(p.stdout)["rows"]
            self.assertEqual([r["gpus"] for r in rows], [8, 64, 512])
            self.assertEqual([r["nodes"] for r in rows], [1, 8, 64])
            eff = [r["efficiency"] for r in rows]
            self.assertTrue(all(0 < e <= 1 for e in eff), eff)
            self.assertEqual(eff, sorted(eff, reverse=True))
            # compute by FLOPs: 3 x 1 MFLOP x 32 samples at 40% of 989 TFLOP/s
            self.assertAlmostEqual(rows[0]["compute_s"] - 20 * 2e6 / 3.35e12, 96e6 / (0.4 * 989e12), places=12)
            p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "scaling.py"), path, "--intra",
                                "measured", "--gpus", "2"], capture_output=True, text=True)
            self.assertEqual(p.returncode, 2)
            self.assertIn("no allreduce_bench measurement for 2 ranks", p.stderr)
        finally:
            w.cleanup()


class Validation(unittest.TestCase):
    """benchmarks/scaling_validate.py's procedure end to end, on 2 and 4 ranks on this machine and on
    2 ranks on two nodes (tests/netns_cluster.py): the all-reduce measured, the runs profiled, and a
    prediction for each row from its parts. How close the prediction comes is a timing, and timings
    are benchmarks (`make bench-scaling`, which exits 1 past its tolerance), not tests: on the
    2-vCPU machines here the all-reduce alone takes 150 or 650 us at 512 KiB from one launch to the
    next, so a 15% bound failed one run in two on code that had passed it (docs/scaling.md)."""

    def check(self, nps, cluster=None):
        w = Workdir()
        try:
            bench = w.file("allreduce_bench")
            p = subprocess.run(["mpicc", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-o", bench,
                                os.path.join(ROOT, "benchmarks", "allreduce_bench.c"), "-lm"],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            w.dataset(n=2000)
            cfg = w.config(WIDE_MLP)
            notes = []
            rows, one = scaling_validate.validate(cfg, nps, rank_batch=8, steps=100, every=20, tolerance=0.15,
                                                  busy_limit=1.0, attempts=1, workdir=w.path, log=notes.append,
                                                  bench=bench, binary=BINARY, cluster=cluster)
            text = scaling_validate.table(rows, one)
            print("\n" + "\n".join(notes + [text]), file=sys.stderr)
            expect = [(n, 1) for n in sorted(nps)] + ([(2, 2)] if cluster else [])
            self.assertEqual([(r["ranks"], r["nodes"]) for r in rows], expect, text)
            self.assertEqual((one.world_size, len(one.buckets), one.grad_bytes), (1, 6, 4 * (36 * 4096 + 4096 +
                             4096 * 128 + 128 + 128 * 3 + 3)))
            cores = os.cpu_count()
            for r in rows:
                self.assertGreater(r["measured_s"], 0, text)
                self.assertGreater(r["measured_comm_s"], 0, text)  # the ranks waited in MPI for the gradients
                self.assertGreater(r["parts"]["comm_total"], 0, text)  # and the model charges 6 all-reduces
                oversubscribed = r["ranks"] // r["nodes"] * r["threads"] > cores // r["nodes"]  # per node
                self.assertEqual(r["checked_basis"], f"{cores} rank(s) x share" if oversubscribed else "same run")
        finally:
            w.cleanup()

    def test_predicts_2_and_4_ranks(self):
        """4 ranks on 2 cores take turns: their prediction takes the compute of the run with one rank per
        core, times the share."""
        self.check([2, 4])

    def test_predicts_2_ranks_on_two_nodes(self):
        """One rank per node, a CPU each, TCP over the cluster's veth pair."""
        from netns_cluster import Cluster, ClusterError
        why = Cluster.why_not()
        if why:
            self.skipTest(f"no two-node cluster here: {why}")
        c = Cluster()
        try:
            try:
                c.start()
            except ClusterError as e:
                self.skipTest(f"the two-node cluster could not be built: {e}")
            self.check([], cluster=c)
        finally:
            c.close()


if __name__ == "__main__":
    unittest.main()
