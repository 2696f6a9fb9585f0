"""The Slurm batch script under a real single-node Slurm (Debian's slurm-wlm), configured and
started by the test on localhost with auth/none: a job completes, and a job that gets
`scancel --batch --signal=USR1` checkpoints, exits 75, requeues itself and finishes from the
checkpoint. Skipped (with the reason) where the Slurm daemons cannot start."""
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import unittest

from helpers import BINARY, ENV, ROOT, TINY_CNN, Workdir

SCRIPT = os.path.join(ROOT, "scripts", "slurm", "ddp_train.sbatch")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Slurm(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.skip = None
        if not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("sbatch")):
            cls.skip = "slurmctld, slurmd or sbatch not installed"
            return
        cls.dir = tempfile.mkdtemp(prefix="ddp_slurm_")
        d = cls.dir
        for sub in ("state", "spool", "logs"):
            os.mkdir(os.path.join(d, sub))
        host = socket.gethostname().split(".")[0]
        conf = os.path.join(d, "slurm.conf")
        with open(conf, "w") as f:
            f.write(f"""ClusterName=ddptest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/logs/slurmctld.log
SlurmdLogFile={d}/logs/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobRequeue=1
ReturnToService=2
InactiveLimit=0
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        cls.env = dict(ENV, SLURM_CONF=conf)
        for daemon in ("slurmctld", "slurmd"):
            p = subprocess.run([daemon, "-f", conf], env=cls.env, capture_output=True, text=True)
            if p.returncode:
                cls.skip = f"{daemon} did not start: {p.stderr.strip()[-300:]}"
                return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=cls.env, capture_output=True, text=True).stdout
            if state.strip() in ("idle", "mix"):
                return
            time.sleep(0.5)
        with open(os.path.join(d, "logs", "slurmd.log")) as f:
            cls.skip = "the Slurm node did not become idle: " + f.read()[-300:]

    @classmethod
    def tearDownClass(cls):
        if not hasattr(cls, "env"):
            return
        subprocess.run(["scancel", "-u", "root"], env=cls.env, capture_output=True)
        for pidfile in ("slurmd.pid", "slurmctld.pid"):
            try:
                with open(os.path.join(cls.dir, pidfile)) as f:
                    os.kill(int(f.read()), 15)
            except (OSError, ValueError):
                pass
        time.sleep(1)
        shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        if self.skip:
            self.skipTest(self.skip)
        self.w = Workdir()
        self.w.dataset(n=64)
        self.cfg = self.w.config(TINY_CNN)

    def tearDown(self):
        self.w.cleanup()

    def sbatch(self, *args):
        p = subprocess.run(["sbatch", "--parsable", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
                            f"--output={self.w.file('job-%j.out')}", SCRIPT, self.cfg] + list(args),
                           env=self.env, capture_output=True, text=True, cwd=ROOT)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout.strip().split(";")[0]

    def state(self, job):
        out = subprocess.run(["scontrol", "show", "job", job], env=self.env, capture_output=True, text=True).stdout
        return out.split("JobState=")[1].split()[0] if "JobState=" in out else "GONE"

    def wait_for(self, job, states, timeout=90):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.state(job)
            if s in states:
                return s
            time.sleep(0.5)
        self.fail(f"job {job} still {self.state(job)} after {timeout} s")

    def log(self, job):
        """The job's output, and the daemons' last lines for diagnosis."""
        text = ""
        for name in (self.w.file(f"job-{job}.out"), os.path.join(self.dir, "logs", "slurmctld.log"),
                     os.path.join(self.dir, "logs", "slurmd.log")):
            if os.path.exists(name):
                with open(name) as f:
                    lines = [l for l in f if not l.startswith(("step ", "straggler", "ranks:", "saved"))]
                text += f"--- {name}\n" + "".join(lines[-25:])
        return text

    def test_batch_job_completes(self):
        job = self.sbatch("--set", "train.epochs=2")
        self.assertEqual(self.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED")), "COMPLETED", self.log(job))
        log = self.log(job)
        self.assertIn("done: 16 steps", log)
        self.assertIn("ddp_train exited 0", log)
        self.assertTrue(os.path.exists(self.w.latest()))

    def test_usr1_checkpoints_requeues_and_finishes(self):
        """USR1 to the batch script: checkpoint, exit 75, requeue, and the requeued run resumes."""
        # long enough that the signal always lands while it runs; shortened once it has stopped
        config = TINY_CNN.replace("epochs: 2", "epochs: 100000")
        self.cfg = self.w.config(config)
        job = self.sbatch("--set", "log.every_steps=1000", "--set", "data.val.x=", "--set", "checkpoint.every_epochs=0")
        metrics = self.w.file("log/metrics.jsonl")
        deadline = time.monotonic() + 60
        while not (os.path.exists(metrics) and os.path.getsize(metrics)):
            self.assertLess(time.monotonic(), deadline, self.log(job) if os.path.exists(self.w.file(f"job-{job}.out")) else "")
            time.sleep(0.2)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=self.env, check=True)
        # Slurm holds a requeued job back for the credential lifetime (AuthInfo=cred_expire, 10 s
        # here, 120 s by default), so that its next start cannot meet the previous run's revoked
        # credential; moving its start earlier by hand raced with that teardown ("Job credential
        # revoked"). The job comes back by itself.
        self.wait_for(job, ("PENDING",), timeout=60)
        stopped = int(os.path.basename(self.w.latest()).split("-")[1].split(".")[0])
        self.w.config(config.replace("seed: 3", f"seed: 3\n  max_steps: {stopped + 500}"))  # finish soon after
        self.assertEqual(self.wait_for(job, ("COMPLETED", "FAILED", "CANCELLED")), "COMPLETED", self.log(job))
        with open(self.w.file(f"job-{job}.out")) as f:  # both runs' output: self.log's 25 lines may miss the first's
            out = f.read()
        for want in (f"ddp_train: stopped by SIGUSR1 at step {stopped}", "requeueing job", f"resuming at step {stopped}",
                     f"done: {stopped + 500} steps", "ddp_train exited 0"):
            self.assertIn(want, out, self.log(job))


class BatchScriptSignals(unittest.TestCase):
    """The batch script run as a plain script (no Slurm needed): a SIGTERM to it, which mpirun
    cannot forward and would answer with exit 1, reaches ddp_train as SIGUSR1: a checkpoint, exit
    75, and no requeue (scancel and preemption leave that to Slurm)."""

    def test_sigterm_to_the_script_is_a_checkpoint_and_exit_75(self):
        w = Workdir()
        try:
            w.dataset(n=64)
            cfg = w.config(TINY_CNN.replace("epochs: 2", "epochs: 100000"))
            env = dict(ENV, SLURM_NTASKS="2", DDP_TRAIN=BINARY)
            p = subprocess.Popen(["bash", SCRIPT, cfg, "--set", "log.every_steps=1000", "--set", "data.val.x="],
                                 env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                metrics = w.file("log/metrics.jsonl")
                deadline = time.monotonic() + 60
                while not (os.path.exists(metrics) and os.path.getsize(metrics)) and time.monotonic() < deadline:
                    time.sleep(0.1)
                p.send_signal(signal.SIGTERM)
                out, _ = p.communicate(timeout=60)
            finally:
                p.kill()
            self.assertEqual(p.returncode, 75, out)
            stopped = int(os.path.basename(w.latest()).split("-")[1].split(".")[0])
            self.assertIn("SIGTERM: asking ddp_train to checkpoint and stop", out)
            self.assertIn(f"ddp_train: stopped by SIGUSR1 at step {stopped} after saving a checkpoint", out)
            self.assertIn("ddp_train exited 75", out)
            self.assertNotIn("requeueing", out)
        finally:
            w.cleanup()


if __name__ == "__main__":
    unittest.main()
