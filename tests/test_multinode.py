"""Two nodes for real on one machine: `mpirun --hostfile` from node A reaches node B through ssh
(tests/netns_cluster.py: two network namespaces, each with its hostname, its share of the CPUs and
an sshd), 2 ranks on each. --info and the start-up table name both hosts and their local ranks;
the gradients cross the test network that OMPI_MCA_btl_tcp_if_include names; the trained model
equals `mpirun -np 4` on one node; each node's ranks take their threads from their own CPUs; and a
node that dies, or drops off the network, ends the job within seconds naming it, with the last
checkpoint intact. Then scripts/slurm/ddp_train_multinode.sbatch on a two-node Slurm built on the
same kind of cluster. Skipped, with the reason, where the namespaces, sshd or Slurm are not available."""
import os
import re
import shutil
import time
import unittest

import h5py
import numpy as np

from helpers import BINARY, ENV, ROOT, TINY_CNN, Workdir, run
from netns_cluster import Cluster, ClusterError

# TINY_CNN with a wide hidden layer: 164k parameters, so the gradients dominate the network's bytes
WIDE_CNN = TINY_CNN.replace("    - linear: {{out: 3}}\n",
                            "    - linear: {{out: 4096}}\n    - relu: {{}}\n    - linear: {{out: 3}}\n")


def final_params(path):
    with h5py.File(path, "r") as f:
        return {k: f["model"][k][...] for k in f["model"]}


def placement(out):
    """{rank: (host, local rank, local size, threads, cpus)} from the start-up table."""
    rows = re.findall(r"^  rank (\d+) +(\S+) +local rank (\d+) of (\d+), (\d+) threads?, cpus (\S+)$", out, re.M)
    return {int(r): (h, int(lr), int(ls), int(t), c) for r, h, lr, ls, t, c in rows}


def cpu_text(cpus):
    """Like ddp_train's cpus column: "0-3,8"."""
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(f"{cpus[i]}-{cpus[j]}" if j > i else str(cpus[i]))
        i = j + 1
    return ",".join(parts)


class ClusterCase(unittest.TestCase):
    """A test on the cluster its class built (setUpClass sets cls.cluster, or cls.skip with the
    reason): a work directory with a small dataset and a config of MODEL."""
    MODEL = TINY_CNN

    @classmethod
    def tearDownClass(cls):
        if cls.cluster:
            cls.cluster.close()  # every process of both nodes, the daemons included

    def setUp(self):
        if self.skip:
            self.skipTest(self.skip)
        self.c = self.cluster
        self.w = Workdir()
        self.addCleanup(self.w.cleanup)
        self.w.dataset(n=64)
        self.cfg = self.w.config(self.MODEL)


class TwoNodes(ClusterCase):
    MODEL = WIDE_CNN

    @classmethod
    def setUpClass(cls):
        cls.skip = Cluster.why_not()
        cls.cluster = None
        if cls.skip:
            return
        cls.cluster = Cluster()
        try:
            cls.cluster.start()
        except ClusterError as e:
            cls.cluster.close()
            cls.cluster = None
            cls.skip = f"the two-node cluster could not be built: {e}"
        except BaseException:
            cls.cluster.close()
            raise

    def setUp(self):
        super().setUp()
        self.env = self.c.mpi_env(ENV)

    def mpirun_cmd(self, args, np_=4, slots=2):
        """ddp_train from node A over the hostfile (the README's command line). --bind-to none: the
        ranks keep their node's CPUs (Open MPI's default binding, to a core or a socket of the whole
        machine, would ignore the taskset that stands in for the node's hardware)."""
        return ["mpirun", "-np", str(np_), "--hostfile", self.c.hostfile(slots), "--map-by", f"ppr:{slots}:node",
                "--bind-to", "none", BINARY] + args

    def mpirun(self, args, np_=4, slots=2, timeout=120):
        return self.c.run("a", self.mpirun_cmd(args, np_, slots), env=self.env, timeout=timeout, cwd=ROOT)

    def expected_threads(self, node, local_size):
        """ddp_train's rule: the rank's CPUs (its node's), at most the machine's cores / ranks on the node."""
        return min(len(self.c.cpus[node]), os.cpu_count() // local_size)

    def test_info_names_both_hosts_and_their_local_ranks(self):
        rc, out, err = self.mpirun(["--info"])
        self.assertEqual(rc, 0, out + err)
        self.assertIn("ddp_train 0.1.0: 4 ranks", out)
        self.assertIn("node ddpnode-a: 2 ranks (world ranks from 0)", out)
        self.assertIn("node ddpnode-b: 2 ranks (world ranks from 2)", out)
        got = placement(out)
        for rank, (node, local) in enumerate((("a", 0), ("a", 1), ("b", 0), ("b", 1))):
            self.assertEqual(got[rank], (f"ddpnode-{node}", local, 2, self.expected_threads(node, 2),
                                         cpu_text(self.c.cpus[node])), out)

    def test_threads_come_from_the_node_cpus(self):
        """One rank per node: the cores / ranks share is the whole machine, so the thread count
        reported can only come from the rank's affinity mask (its node's CPUs)."""
        rc, out, err = self.mpirun(["--info"], np_=2, slots=1)
        self.assertEqual(rc, 0, out + err)
        got = placement(out)
        for rank, node in enumerate("ab"):
            self.assertEqual(got[rank], (f"ddpnode-{node}", 0, 1, len(self.c.cpus[node]), cpu_text(self.c.cpus[node])),
                             out)
        self.assertLess(len(self.c.cpus["a"]), os.cpu_count())

    def test_training_over_the_test_network_equals_one_node(self):
        before = self.c.link_bytes("a")
        rc, out, err = self.mpirun([self.cfg])
        after = self.c.link_bytes("a")
        self.assertEqual(rc, 0, out + err)
        self.assertIn("global batch 8 on 4 ranks", out)
        got = placement(out)  # the start-up table of the training run
        for rank, (node, local) in enumerate((("a", 0), ("a", 1), ("b", 0), ("b", 1))):
            self.assertEqual(got[rank][:4], (f"ddpnode-{node}", local, 2, self.expected_threads(node, 2)), out)
            self.assertEqual(got[rank][4], cpu_text(self.c.cpus[node]), out)
        self.assertIn("done: 16 steps", out)
        losses = [r["loss"] for r in self.w.metrics() if "loss" in r]
        two_nodes = final_params(self.w.latest())

        # every step's gradients (4 bytes a parameter) crossed node A's veth in each direction
        n_params = sum(v.size for v in two_nodes.values())
        self.assertGreater(n_params, 150000)
        for got_bytes, what in zip((after[0] - before[0], after[1] - before[1]), ("received", "sent")):
            self.assertGreaterEqual(got_bytes, 16 * 4 * n_params, f"bytes {what} on node A's link")

        # the same run as 4 ranks of one node (plain mpirun, no namespaces)
        os.rename(self.w.file("ckpt"), self.w.file("ckpt-two-nodes"))
        os.rename(self.w.file("log"), self.w.file("log-two-nodes"))
        rc, out, err = run([self.cfg], np_=4)
        self.assertEqual(rc, 0, out + err)
        # as the parameters below: the losses fall to 1e-12 in 16 steps, and the summation order of the
        # gradient all-reduce over the network and within a node may differ (up to 5e-8 apart at a loss of
        # 3e-3 on a 2-core AMD EPYC)
        np.testing.assert_allclose(losses, [r["loss"] for r in self.w.metrics() if "loss" in r], rtol=1e-5,
                                   atol=1e-6)
        one_node = final_params(self.w.latest())
        for k in one_node:
            np.testing.assert_allclose(two_nodes[k], one_node[k], rtol=1e-5, atol=1e-6, err_msg=k)
        self.assertGreater(np.abs(one_node["0.weight"]).sum(), 0)

    def fail_node_b(self, how):
        """Trains until a checkpoint at step 16 or later exists, then node B dies (how: kill_node or
        cut_link); returns (exit code, output, seconds from the failure to the end of mpirun)."""
        self.addCleanup(self.c.revive, "b")
        args = [self.cfg, "--set", "train.epochs=100000", "--set", "log.every_steps=1000", "--set", "data.val.x=",
                "--set", "dist.timeout_s=30"]
        p = self.c.popen("a", self.mpirun_cmd(args), env=self.env, cwd=ROOT)
        try:
            deadline = time.monotonic() + 60
            while True:
                self.assertIsNone(p.poll(), "the job ended before node B failed")
                self.assertLess(time.monotonic(), deadline, "no checkpoint at step 16 within 60 s")
                try:
                    if int(re.findall(r"\d+", os.path.basename(self.w.latest()))[0]) >= 16:
                        break
                except (OSError, IndexError):
                    pass
                time.sleep(0.1)
            t0 = time.monotonic()
            getattr(self.c, how)("b")
            out, err = p.communicate(timeout=60)
            return p.returncode, out + err, time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()

    def check_last_checkpoint(self):
        """The newest checkpoint loads (its checksummed tensors included) and training continues from it."""
        path = self.w.latest()
        step = int(re.findall(r"\d+", os.path.basename(path))[0])
        rc, out, err = run([self.cfg, "--resume", path, "--set", f"train.max_steps={step + 2}"], np_=2)
        self.assertEqual(rc, 0, out + err)
        self.assertIn(f"resuming at step {step}", out)

    def test_node_killed_ends_the_job_naming_it(self):
        rc, out, took = self.fail_node_b("kill_node")
        self.assertIn(rc, (205, 255), out)  # Open MPI's codes: its runtime lost node B's daemon, or its ssh
        self.assertLess(took, 10, out)
        # ssh's "Connection to ddpnode-b closed by remote host.", or Open MPI's "Remote daemon: ... on node
        # ddpnode-b" or "Peer host: ddpnode-b", whichever saw it first
        self.assertIn("ddpnode-b", out)
        print(f"# node B killed: mpirun exited {rc} after {took:.1f} s", flush=True)
        self.check_last_checkpoint()

    def test_node_off_the_network_ends_the_job_naming_it(self):
        rc, out, took = self.fail_node_b("cut_link")
        self.assertEqual(rc, 205, out)
        self.assertLess(took, 15, out)  # the runtime's TCP keepalive: 2 s idle + 3 probes 1 s apart, then its reaction
        self.assertIn("ORTE has lost communication with a remote daemon", out)
        self.assertRegex(out, r"Remote daemon: \S+ on node ddpnode-b")
        print(f"# node B off the network: mpirun exited {rc} after {took:.1f} s", flush=True)
        self.check_last_checkpoint()


class TwoNodeSlurm(ClusterCase):
    """scripts/slurm/ddp_train_multinode.sbatch on a two-node Slurm (Debian's slurm-wlm, auth/none):
    slurmctld and a slurmd on node A, a slurmd on node B; mpirun in the batch script starts node B's
    daemon through Slurm (srun), not ssh."""

    @classmethod
    def setUpClass(cls):
        cls.skip = Cluster.why_not()
        cls.cluster = None
        if not cls.skip and not all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch")):
            cls.skip = "slurmctld, slurmd or sbatch not installed"
        if cls.skip:
            return
        c = cls.cluster = Cluster()
        try:
            c.start()
            cls.skip = cls.start_slurm(c)
        except ClusterError as e:
            cls.skip = f"the two-node cluster could not be built: {e}"
        except BaseException:
            c.close()
            raise
        if cls.skip:
            c.close()
            cls.cluster = None

    @classmethod
    def start_slurm(cls, c):
        """Starts the daemons; None when both nodes are idle, else why not."""
        d = c.file("slurm")
        for sub in ("state", "logs", "spool-ddpnode-a", "spool-ddpnode-b"):
            os.makedirs(os.path.join(d, sub))
        conf = os.path.join(d, "slurm.conf")
        nodes = "".join(f"NodeName={c.host[n]} NodeAddr={c.addr[n]} CPUs={os.cpu_count()} State=UNKNOWN\n"
                        for n in "ab")
        with open(conf, "w") as f:
            f.write(f"""ClusterName=ddpnetns
SlurmctldHost={c.host['a']}({c.addr['a']})
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/logs/slurmctld.log
SlurmdLogFile={d}/logs/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=5
{nodes}PartitionName=debug Nodes={c.host['a']},{c.host['b']} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        cls.logs = os.path.join(d, "logs")
        cls.env = dict(c.mpi_env(ENV), SLURM_CONF=conf, DDP_TRAIN=BINARY)
        daemons = (("a", ["slurmctld"]), ("a", ["slurmd", "-N", c.host["a"]]), ("b", ["slurmd", "-N", c.host["b"]]))
        for node, daemon in daemons:
            rc, out, err = c.run(node, daemon + ["-f", conf], env=cls.env)
            if rc:
                return f"{daemon[0]} did not start on node {node}: {(err or out).strip()[-300:]}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rc, out, err = c.run("a", ["sinfo", "-h", "-N", "-o", "%t"], env=cls.env)
            if out.split() == ["idle", "idle"]:
                return None
            time.sleep(0.3)
        return "the Slurm nodes did not become idle: " + cls.daemon_logs()

    @classmethod
    def daemon_logs(cls):
        text = ""
        for name in sorted(os.listdir(cls.logs)):
            with open(os.path.join(cls.logs, name)) as f:
                text += f"--- {name}\n" + "".join(f.readlines()[-15:])
        return text

    def test_batch_job_on_two_nodes(self):
        script = os.path.join(ROOT, "scripts", "slurm", "ddp_train_multinode.sbatch")
        rc, out, err = self.c.run("a", ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1",
                                        "--gpus-per-node=0", f"--output={self.w.file('job-%j.out')}", script, self.cfg,
                                        "--set", "train.epochs=2"], env=self.env, cwd=ROOT)
        self.assertEqual(rc, 0, err)
        job = out.strip().split(";")[0]
        deadline = time.monotonic() + 90
        while True:
            rc, out, err = self.c.run("a", ["scontrol", "show", "job", job], env=self.env)
            state = out.split("JobState=")[1].split()[0] if "JobState=" in out else "GONE"
            if state in ("COMPLETED", "FAILED", "CANCELLED", "GONE"):
                break
            self.assertLess(time.monotonic(), deadline, f"job {job} still {state}")
            time.sleep(0.3)
        with open(self.w.file(f"job-{job}.out")) as f:
            log = f.read()
        self.assertEqual(state, "COMPLETED", log[-3000:] + self.daemon_logs())
        self.assertIn(f"job {job} run 0: 4 ranks on 2 nodes", log)
        self.assertIn("node ddpnode-a: 2 ranks (world ranks from 0)", log)  # --info
        self.assertIn("node ddpnode-b: 2 ranks (world ranks from 2)", log)
        got = placement(log)  # the training run's start-up table
        self.assertEqual([got[r][:3] for r in range(4)],
                         [("ddpnode-a", 0, 2), ("ddpnode-a", 1, 2), ("ddpnode-b", 0, 2), ("ddpnode-b", 1, 2)], log)
        self.assertIn("done: 16 steps", log)
        self.assertIn("ddp_train exited 0", log)
        with open(os.path.join(self.logs, "slurmd-ddpnode-b.log")) as f:
            self.assertIn(f"launch task StepId={job}.", f.read())  # node B's daemon came through Slurm


if __name__ == "__main__":
    unittest.main()
