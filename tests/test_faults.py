"""Checkpoints that never lose work and failures that end fast: exact resume, resume at another
world size, corrupt-checkpoint fallback, a signal on one rank, the time limit, a crash, a kill -9,
a hang, NaN, a full disk, and a changed model. Uses DDP_TRAIN_FAULT=kind@rank:step."""
import os
import shutil
import signal
import subprocess
import time
import unittest

import h5py
import numpy as np

from helpers import BINARY, ENV, TINY_CNN, Workdir, errors, params, run


# the 784-192-10 MLP of issue 25's full disk (1.2 MB checkpoints)
MLP_784 = TINY_CNN.replace("""\
  input: [1, 6, 6]
  layers:
    - conv2d: {{out: 4, kernel: 3, pad: 1}}
    - relu: {{}}
    - maxpool: {{kernel: 2}}
    - flatten: {{}}
    - linear: {{out: 3}}
""", """\
  input: [784]
  layers: [{{linear: {{out: 192}}}}, relu, {{linear: {{out: 10}}}}]
""").replace("data.h5", "mlp.h5")


def latest(w):
    return latest_in(w.file("ckpt"))


def latest_in(directory):
    with open(os.path.join(directory, "latest")) as f:
        return os.path.join(directory, f.read().strip())


def run_fault(args, fault, np_=2, timeout=60):
    env = dict(ENV, DDP_TRAIN_FAULT=fault)
    t0 = time.monotonic()
    p = subprocess.run(["mpirun", "--oversubscribe", "-np", str(np_), BINARY] + args, capture_output=True, text=True,
                       env=env, timeout=timeout)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


class Resume(unittest.TestCase):
    def setUp(self):
        self.w = Workdir()
        self.w.dataset(n=64)
        self.cfg = self.w.config(TINY_CNN)
        self.args = [self.cfg, "--set", "train.epochs=3"]

    def tearDown(self):
        self.w.cleanup()

    def test_signal_on_one_rank_then_resume_is_bit_exact(self):
        rc, out, err = run(self.args, np_=2)
        self.assertEqual(rc, 0, err)
        full = params(latest(self.w))
        os.rename(self.w.file("ckpt"), self.w.file("ckpt_full"))
        rc, out, err, _ = run_fault(self.args, "signal@1:5")
        self.assertEqual(rc, 75, out + err)
        self.assertIn("stopped by SIGUSR1 at step 5 after saving a checkpoint", err)
        self.assertTrue(latest(self.w).endswith("step-00000005.h5"))
        with h5py.File(latest(self.w), "r") as f:  # loadable, with the documented layout
            self.assertEqual(f["meta"].attrs["step"], 5)
            self.assertEqual(f["meta"].attrs["world_size"], 2)
            self.assertIn("momentum_buffer", f["optim"])
            self.assertEqual(f["optim/momentum_buffer/0.weight"].shape, (4, 1, 3, 3))
            self.assertIn("model.layers:", f["meta"].attrs["config"].decode())
        rc, out, err = run(self.args + ["--resume", "auto"], np_=2)
        self.assertEqual(rc, 0, err)
        self.assertIn("resuming at step 5", out)
        steps = [r["step"] for r in self.w.metrics() if "loss" in r]
        self.assertEqual(steps, list(range(1, 25)))  # metrics.jsonl continues where it stopped
        resumed = params(latest(self.w))
        for k in full:
            self.assertTrue(np.array_equal(full[k], resumed[k]), k)

    def test_a_signal_at_the_last_step_still_validates_it(self):
        """The last step's validation is the run's final one: a stop there still runs it (a resumed run
        has no step left to reach it), and resuming finds nothing to do."""
        rc, out, err, _ = run_fault(self.args, "signal@1:24")
        self.assertEqual(rc, 75, out + err)
        self.assertIn("stopped by SIGUSR1 at step 24 after saving a checkpoint", err)
        self.assertRegex(out, r"(?m)^eval step 24 epoch 3: val_loss")
        rc, out, err = run(self.args + ["--resume", "auto"], np_=2)
        self.assertEqual(rc, 0, out + err)
        self.assertEqual([r["step"] for r in self.w.metrics() if "val_loss" in r], [8, 16, 24])

    def test_resume_at_another_world_size_continues_the_data(self):
        rc, out, err = run(self.args, np_=2)
        self.assertEqual(rc, 0, err)
        full = params(latest(self.w))
        os.rename(self.w.file("ckpt"), self.w.file("ckpt_full"))
        rc, out, err, _ = run_fault(self.args, "signal@0:11")
        self.assertEqual(rc, 75, out + err)
        rc, out, err = run(self.args + ["--resume", "auto"], np_=3)
        self.assertEqual(rc, 0, err)
        self.assertIn("resuming at step 11 (epoch 2, batch 3 of 8)", out)
        resumed = params(latest(self.w))
        for k in full:
            np.testing.assert_allclose(resumed[k], full[k], rtol=1e-5, atol=1e-6, err_msg=k)

    def test_corrupt_newest_checkpoint_falls_back(self):
        rc, out, err = run(self.args + ["--set", "checkpoint.every_steps=4", "--set", "train.max_steps=12"], np_=2)
        self.assertEqual(rc, 0, err)
        newest = latest(self.w)
        self.assertTrue(newest.endswith("step-00000012.h5"))
        self.assertEqual(sorted(os.listdir(self.w.file("ckpt"))),
                         ["latest", "step-00000004.h5", "step-00000008.h5", "step-00000012.h5"])
        with open(newest, "r+b") as f:
            f.truncate(os.path.getsize(newest) // 2)
        rc, out, err = run(self.args + ["--resume", "auto"], np_=2)
        self.assertEqual(rc, 0, out + err)
        self.assertIn(f"{newest}: checkpoint: not a readable HDF5 file (truncated or corrupt)", err)
        self.assertIn("falling back to an older checkpoint", err)
        self.assertIn("step-00000008.h5 (the newest good checkpoint)", out)
        self.assertIn("resuming at step 8", out)
        # an explicit path to the broken file is an error naming it
        rc, out, err = run(self.args + ["--resume", newest], np_=2)
        self.assertEqual(rc, 2, out + err)
        self.assertIn(newest, errors(err)[0])

    def test_keep_and_best(self):
        rc, out, err = run(self.args + ["--set", "checkpoint.every_steps=2", "--set", "checkpoint.keep=2",
                                        "--set", "checkpoint.best=true"], np_=1)
        self.assertEqual(rc, 0, err)
        names = sorted(os.listdir(self.w.file("ckpt")))
        self.assertEqual(names, ["best.h5", "latest", "step-00000022.h5", "step-00000024.h5"])
        with h5py.File(self.w.file("ckpt/best.h5"), "r") as f:
            self.assertIn(f["meta"].attrs["step"], (8, 16, 24))
            self.assertGreaterEqual(f["meta"].attrs["best_val_acc"], 0)

    def test_a_checkpoint_written_over_one_of_its_name_holds_the_new_run(self):
        """A fresh run into a directory of checkpoints writes the same step files again: each holds the
        new run, bit for bit as in an empty directory (and, under test-asan, HDF5's read of the old file
        while creating the new one leaks nothing)."""
        rc, out, err = run(self.args + ["--set", "checkpoint.every_steps=8"], np_=1)
        self.assertEqual(rc, 0, err)
        first = params(latest(self.w))
        again = self.args + ["--set", "checkpoint.every_steps=8", "--set", "train.seed=7"]
        rc, out, err = run(again, np_=1)
        self.assertEqual(rc, 0, err)
        rc, out, err = run(again + ["--set", f"checkpoint.dir={self.w.file('empty')}"], np_=1)
        self.assertEqual(rc, 0, err)
        self.assertEqual(os.path.basename(latest(self.w)), "step-00000024.h5")
        over, fresh = params(latest(self.w)), params(latest_in(self.w.file("empty")))
        for k in fresh:
            self.assertTrue(np.array_equal(over[k], fresh[k]), k)
        self.assertFalse(all(np.array_equal(first[k], fresh[k]) for k in fresh))

    def test_a_file_at_a_checkpoints_name_is_replaced_unread(self):
        """Whatever is at a checkpoint's name is replaced without being read: HDF5 reads any file at the
        name it creates into memory first, which for a stale 1 TB file (sparse here) was exit 70, out
        of memory, and costs a whole read of best.h5 at every new best."""
        os.makedirs(self.w.file("ckpt"))
        with open(self.w.file("ckpt/step-00000008.h5"), "wb") as f:
            f.truncate(1 << 40)
        rc, out, err = run(self.args + ["--set", "checkpoint.every_steps=8"], np_=1)
        self.assertEqual(rc, 0, err)
        with h5py.File(self.w.file("ckpt/step-00000008.h5"), "r") as f:
            self.assertEqual(f["meta"].attrs["step"], 8)

    def test_changed_model_is_refused(self):
        rc, out, err = run(self.args + ["--set", "train.max_steps=4"], np_=1)
        self.assertEqual(rc, 0, err)
        rc, out, err = run(self.args + ["--resume", "auto", "--set", "model.layers=[flatten, {linear: {out: 3}}]"])
        self.assertEqual(rc, 2, out + err)
        self.assertIn("model.layers differs", errors(err)[0])
        rc, out, err = run(self.args + ["--resume", "auto", "--set", "train.global_batch_size=16"])
        self.assertEqual(rc, 2, out + err)
        self.assertIn("its global batch was 8, this run's is 16", errors(err)[0])
        # an allowed change: the learning rate
        rc, out, err = run(self.args + ["--resume", "auto", "--set", "optim.lr=0.05"])
        self.assertEqual(rc, 0, out + err)

    def test_stale_temporary_files_are_removed_and_counted(self):
        # A kill -9 during a write leaves NAME.tmp.PID behind. At start-up and before each write those
        # whose writer is gone are removed: a dead PID, or a live process that is not ddp_train. A live
        # ddp_train's counts as one of the `keep` checkpoints.
        ckpt = self.w.file("ckpt")
        os.mkdir(ckpt)
        dead = subprocess.Popen(["true"])
        dead.wait()
        sleeper = subprocess.Popen(["sleep", "120"])
        fake = self.w.file("ddp_train")  # a live process with ddp_train's name
        shutil.copy("/bin/sleep", fake)
        writer = subprocess.Popen([fake, "120"])
        try:
            stale = [f"step-00000007.h5.tmp.{dead.pid}", f"latest.tmp.{dead.pid}", f"best.h5.tmp.{sleeper.pid}",
                     f"step-00000002.h5.tmp.{sleeper.pid}"]
            kept = [f"step-00000009.h5.tmp.{writer.pid}", "notes.tmp.123"]  # a live writer's, and not ours
            for name in stale + kept:
                with open(os.path.join(ckpt, name), "wb") as f:
                    f.write(b"\0" * 100000)
            rc, out, err = run(self.args + ["--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep=3",
                                            "--set", "train.max_steps=5"], np_=2)
            self.assertEqual(rc, 0, out + err)
            self.assertIn(f"removed 4 temporary files that crashed runs left in {ckpt}", out)
            self.assertEqual(sorted(os.listdir(ckpt)), sorted(["latest", "step-00000004.h5", "step-00000005.h5"] + kept))
            # and before each write: a writer that dies during the run (its file then stale), and a file
            # left while the run is under way
            args = self.args + ["--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep=3",
                                "--set", "train.epochs=100", "--resume", "auto", "--set", "log.every_steps=1000"]
            p = subprocess.Popen(["mpirun", "--oversubscribe", "-np", "2", BINARY] + args, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=ENV)
            deadline = time.monotonic() + 30
            while latest(self.w).endswith("step-00000005.h5") and time.monotonic() < deadline:
                time.sleep(0.01)
            writer.kill()
            writer.wait()
            with open(os.path.join(ckpt, f"step-00000011.h5.tmp.{dead.pid}"), "wb") as f:
                f.write(b"\0" * 100000)
            self.assertIsNone(p.poll(), "the run ended before the files were left")
            out, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 0, out + err)
            self.assertNotIn("removed", out)  # not at start-up
            self.assertEqual(sorted(os.listdir(ckpt)),
                             ["latest", "notes.tmp.123", "step-00000798.h5", "step-00000799.h5", "step-00000800.h5"])
        finally:
            for p in (sleeper, writer):
                p.kill()
                p.wait()

    def test_resume_auto_without_checkpoint_starts_fresh(self):
        rc, out, err = run(self.args + ["--resume", "auto", "--set", "train.max_steps=2"])
        self.assertEqual(rc, 0, err)
        self.assertIn("no checkpoint in", out)


class StopsAndFailures(unittest.TestCase):
    def setUp(self):
        self.w = Workdir()
        self.w.dataset(n=64)
        self.cfg = self.w.config(TINY_CNN)

    def tearDown(self):
        self.w.cleanup()

    def test_time_limit_checkpoints_and_exits_75(self):
        rc, out, err = run([self.cfg, "--set", "train.epochs=100000", "--set", "train.time_limit=1s",
                            "--set", "log.every_steps=100000", "--set", "data.val.x="], np_=2, timeout=60)
        self.assertEqual(rc, 75, out + err)
        self.assertIn("stopped by train.time_limit", err)
        with h5py.File(latest(self.w), "r") as f:
            self.assertGreater(f["meta"].attrs["step"], 0)

    def test_signal_while_mpi_starts_stops_after_step_1(self):
        # MPI_Init is the slow part of start-up (~0.3 s): a shim raises SIGUSR1 on rank 1 as it
        # enters, which killed that rank (exit 138) while the handler was installed after it
        shim = self.w.file("raise_in_mpi_init.so")
        src = self.w.file("raise_in_mpi_init.c")
        with open(src, "w") as f:
            f.write("#include <mpi.h>\n#include <signal.h>\n"
                    "int MPI_Init_thread(int *c, char ***v, int req, int *got) {\n"
                    "  raise(SIGUSR1);\n  return PMPI_Init_thread(c, v, req, got);\n}\n")
        subprocess.run(["mpicc", "-shared", "-fPIC", "-o", shim, src], check=True)
        rank_env = {"LD_PRELOAD": shim}
        if "ASAN_OPTIONS" in os.environ:  # the shim comes before the ASan runtime
            rank_env["ASAN_OPTIONS"] = os.environ["ASAN_OPTIONS"] + ":verify_asan_link_order=0"
        args = [self.cfg, "--set", "train.epochs=100"]
        rc, out, err = run(None, mpmd=[args, (rank_env, args)], timeout=60)
        self.assertEqual(rc, 75, out + err)
        self.assertIn("stopped by SIGUSR1 at step 1 after saving a checkpoint", err)
        self.assertTrue(latest(self.w).endswith("step-00000001.h5"))
        # the modes that do not train keep the default action: the shim's signal ends them
        rc, out, err = run(None, mpmd=[(rank_env, args + ["--dry-run"])], timeout=60)
        self.assertNotIn(rc, (0, 75), out + err)

    def test_crash_ends_the_job_within_10_s(self):
        rc, out, err, took = run_fault([self.cfg, "--set", "train.epochs=1000"], "crash@1:3")
        self.assertNotEqual(rc, 0)
        self.assertLess(took, 10)

    def test_exit_without_finalize_ends_the_job(self):
        rc, out, err, took = run_fault([self.cfg, "--set", "train.epochs=1000"], "exit@0:3")
        self.assertNotEqual(rc, 0)
        self.assertLess(took, 10)

    def test_kill_9_of_one_rank_ends_the_job_within_10_s(self):
        args = ["mpirun", "--oversubscribe", "-np", "2", BINARY, self.cfg, "--set", "train.epochs=100000",
                "--set", "log.every_steps=1000", "--set", "data.val.x="]
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(self.w.file("log/metrics.jsonl")) or os.path.getsize(self.w.file("log/metrics.jsonl")) == 0:
                self.assertLess(time.monotonic(), deadline, "training did not start")
                time.sleep(0.1)
            pids = subprocess.run(["pgrep", "-f", f"^{BINARY} {self.cfg}"], capture_output=True, text=True).stdout.split()
            self.assertEqual(len(pids), 2)
            t0 = time.monotonic()
            os.kill(int(pids[1]), signal.SIGKILL)
            rc = p.wait(timeout=30)
            self.assertLess(time.monotonic() - t0, 10)
            self.assertNotEqual(rc, 0)
        finally:
            if p.poll() is None:
                p.kill()
            p.communicate()

    def test_hang_exits_3_naming_the_rank(self):
        rc, out, err, took = run_fault([self.cfg, "--set", "train.epochs=1000", "--set", "dist.timeout_s=4"], "hang@1:3")
        self.assertEqual(rc, 3, out + err)
        self.assertLess(took, 4 + 6)
        self.assertIn("at step 3: waiting 2 s for rank(s) 1", err)  # the warning at half the deadline
        self.assertIn("did not complete within dist.timeout_s = 4 s: rank(s) 1 never arrived (1 of 2)", err)

    def test_nan_exits_4_naming_the_rank_and_keeps_the_last_checkpoint(self):
        rc, out, err, _ = run_fault([self.cfg, "--set", "checkpoint.every_steps=2"], "nan@1:6")
        self.assertEqual(rc, 4, out + err)
        line = errors(err)[0]
        self.assertIn("on rank 1 (1 of 2 ranks failed)", line)
        self.assertIn("step 6", line)
        self.assertTrue(latest(self.w).endswith("step-00000004.h5"))
        p = params(latest(self.w))
        self.assertTrue(all(np.isfinite(v).all() for v in p.values()))

    def test_data_truncated_during_training_is_exit_5(self):
        # data.cache none reads every batch from the file; HDF5 reads past the end of a file truncated
        # under it as zeros, and the run went on training on them. Every read now checks the file's size.
        data = self.w.dataset(n=400)
        args = [self.cfg, "--set", "data.cache=none", "--set", "data.val.x=", "--set", "train.epochs=200",
                "--set", "checkpoint.dir="]
        p = subprocess.Popen(["mpirun", "--oversubscribe", "-np", "2", BINARY] + args, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=ENV)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (os.path.exists(self.w.file("log/metrics.jsonl")) and
                                                       len(open(self.w.file("log/metrics.jsonl")).readlines()) >= 3):
                time.sleep(0.02)
            with open(data, "r+b") as f:  # in place: the same file, half of it
                f.truncate(os.path.getsize(data) // 2)
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        self.assertEqual(p.returncode, 5, out + err)
        lines = errors(err)
        self.assertEqual(len(lines), 1, err)
        self.assertRegex(lines[0], rf"{data}: reading '/train/images'\[[0-9]+\]: the file changed under the run "
                                   r"\([0-9]+ bytes when opened, now [0-9]+\)")
        self.assertNotIn("done:", out)

    def test_a_batch_failing_on_one_rank_only_ends_every_rank_with_exit_5(self):
        # A corrupt chunk among rank 1's rows only (contiguous sharding, read batch by batch, in file
        # order): rank 1's batch of step 13 fails while rank 0's is fine. Rank 1 still runs that step's
        # collectives (on a stand-in row), so every rank reaches the step agreement and exits 5; before,
        # rank 1 went to the agreement while rank 0 was in the gradient sum (an MPI error, exit 70).
        data = self.w.dataset(n=400)
        self.w.corrupt_chunk(data, 250)
        rc, out, err = run([self.cfg, "--set", "data.cache=none", "--set", "data.sharding=contiguous",
                            "--set", "data.shuffle=false", "--set", "data.val.x="], np_=2)
        self.assertEqual(rc, 5, out + err)
        lines = errors(err)
        self.assertEqual(len(lines), 1, err)
        self.assertIn(f"on rank 1 (1 of 2 ranks failed): {data}: cannot read '/train/images'[250] (corrupt or "
                      "unreadable file?)", lines[0])
        self.assertEqual([r["step"] for r in self.w.metrics() if "loss" in r], list(range(1, 13)))

    def test_bad_fault_spec_is_exit_2(self):
        rc, out, err, _ = run_fault([self.cfg], "boom")
        self.assertEqual(rc, 2)
        self.assertIn("DDP_TRAIN_FAULT=boom: expected kind@rank:step", err)

    def fill_the_disk(self, cfg, np_):
        """A disk that fills up inside the third checkpoint file itself (not in `latest`, which a disk
        sized by hand fills first): room for two checkpoints, `latest` and its temporary, and half a
        checkpoint. Exit 5 naming the file; the second checkpoint stays `latest`, intact."""
        page = 4096
        mnt = self.w.file(f"small-{np_}-{os.path.basename(cfg)}")
        os.mkdir(mnt)
        args = [cfg, "--set", f"checkpoint.dir={mnt}", "--set", "checkpoint.every_steps=1",
                "--set", "checkpoint.keep=1000", "--set", "train.max_steps=6"]
        rc, out, err = run(args[:3] + ["--set", "train.max_steps=1"], np_=1)
        self.assertEqual(rc, 0, out + err)
        size = -(-os.path.getsize(os.path.join(mnt, "step-00000001.h5")) // page) * page  # tmpfs holds pages
        shutil.rmtree(mnt)
        os.mkdir(mnt)
        spare = size // 2 // page * page  # tmpfs rounds its size up to whole pages
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={2 * size + 2 * page + spare}", "tmpfs", mnt],
                          capture_output=True).returncode:
            self.skipTest("cannot mount a small tmpfs here (needs root)")
        try:
            rc, out, err = run(args, np_=np_)
            self.assertEqual(rc, 5, f"{np_} ranks: {out}{err}")
            self.assertIn(f"{mnt}/step-00000003.h5: writing the checkpoint failed: No space left on device",
                          errors(err)[0])
            self.assertTrue(latest_in(mnt).endswith("step-00000002.h5"))
            p = params(latest_in(mnt))  # the last committed checkpoint is intact
            self.assertTrue(all(np.isfinite(v).all() for v in p.values()))
            self.assertFalse([n for n in os.listdir(mnt) if ".tmp." in n])
        finally:
            subprocess.run(["umount", mnt])

    def test_full_disk_exits_5_and_keeps_earlier_checkpoints(self):
        self.fill_the_disk(self.cfg, 2)

    def test_full_disk_with_large_tensors_exits_5_not_139(self):
        # 1.2 MB checkpoints: after HDF5's own write failed there, its H5Fclose failed half-way and
        # its exit-time cleanup crashed (H5F__close_cb): exit 139 (issue 25)
        self.w.dataset(name="mlp.h5", n=64, shape=(784,), classes=10)
        mlp = self.w.config(MLP_784, name="mlp.yaml")
        for np_ in (1, 2):
            self.fill_the_disk(mlp, np_)

    def test_a_lost_metrics_line_is_exit_5(self):
        # metrics.jsonl on a disk that takes nothing (/dev/full: every write is ENOSPC): the line of
        # step 1 is lost, so every rank exits 5 at the agreement of step 2; and a run whose only
        # lines are its last (one step) exits 5 at its end, not 0 with an empty log
        os.mkdir(self.w.file("log"))
        os.symlink("/dev/full", self.w.file("log/metrics.jsonl"))
        for steps in (5, 1):
            rc, out, err = run([self.cfg, "--set", f"train.max_steps={steps}"], np_=2)
            self.assertEqual(rc, 5, out + err)
            line = errors(err)[0]
            self.assertIn(f"{self.w.file('log/metrics.jsonl')}: writing metrics failed: No space left on device",
                          line)
            self.assertIn("step 1/", out)
            self.assertNotIn("step 3/", out)
            self.assertNotIn("done:", out)

    def test_keep_fits_a_disk_of_keep_checkpoints(self):
        # the oldest goes before the next is written: keep=3 needs room for 3 checkpoints, not 4
        rc, out, err = run([self.cfg, "--set", "train.max_steps=1"], np_=1)
        self.assertEqual(rc, 0, err)
        page = 4096
        size = -(-os.path.getsize(latest(self.w)) // page) * page  # tmpfs holds whole pages
        mnt = self.w.file("three")
        os.mkdir(mnt)
        # three checkpoints, `latest` and its temporary, and half a checkpoint to spare
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={3 * size + 2 * page + size // 2}", "tmpfs", mnt],
                          capture_output=True).returncode:
            self.skipTest("cannot mount a small tmpfs here (needs root)")
        try:
            rc, out, err = run([self.cfg, "--set", f"checkpoint.dir={mnt}", "--set", "checkpoint.every_steps=1",
                                "--set", "checkpoint.keep=3", "--set", "train.max_steps=8"], np_=2)
            self.assertEqual(rc, 0, out + err)
            self.assertEqual(sorted(os.listdir(mnt)),
                             ["latest", "step-00000006.h5", "step-00000007.h5", "step-00000008.h5"])
        finally:
            subprocess.run(["umount", mnt])


if __name__ == "__main__":
    unittest.main()
