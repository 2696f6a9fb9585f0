"""The CUDA backend in training (issue 5's GPU tests): 50 steps of configs/model.yaml on CUDA against
the CPU, mpirun -np 2 with dist.comm=mpi sharing one GPU against -np 1, and a short run clean
under compute-sanitizer. Skipped when `ddp_train --info` lists no GPU."""
import os
import shutil
import subprocess
import unittest

import numpy as np

from helpers import BINARY, ENV, ROOT, Workdir, run


def gpu_visible():
    p = subprocess.run(["mpirun", "-np", "1", BINARY, "--info"], capture_output=True, text=True, env=ENV)
    return "GPU 0:" in p.stdout


GPU = gpu_visible()
COMMON = ["--set", "data.shuffle=false", "--set", "log.every_steps=1", "--set", "data.val.x=",
          "--set", "train.max_steps=50", "--set", "checkpoint.every_epochs=0"]


@unittest.skipUnless(GPU, "no GPU visible (ddp_train --info)")
class GpuTraining(unittest.TestCase):
    def losses(self, w, extra, np_=1, sub="log"):
        rc, out, err = run(["configs/model.yaml", "--set", f"log.dir={w.file(sub)}",
                            "--set", f"checkpoint.dir={w.file(sub + '_ckpt')}"] + COMMON + extra, np_=np_, timeout=600)
        self.assertEqual(rc, 0, out + err)
        return [r["loss"] for r in w.metrics(sub) if "loss" in r]

    def test_50_steps_cuda_match_cpu(self):
        w = Workdir()
        try:
            cpu = self.losses(w, ["--device", "cpu"], sub="cpu")
            gpu = self.losses(w, ["--device", "cuda"], sub="gpu")
            self.assertEqual(len(gpu), 50)
            reading = [r for r in w.metrics("gpu") if "loss" in r][-1]["gpu"][0]  # NVML, per rank
            self.assertEqual(reading["rank"], 0)
            self.assertGreater(reading["mem_peak_mib"], 0)
            for key in ("mem_used_mib", "util_pct", "power_w", "temp_c"):
                self.assertIn(key, reading)
            # float rounding differs (cuDNN's algorithms, reduction orders) and grows over 50 steps
            np.testing.assert_allclose(gpu, cpu, rtol=2e-3)
        finally:
            w.cleanup()

    def test_two_ranks_sharing_one_gpu_equal_one_rank(self):
        w = Workdir()
        try:
            one = self.losses(w, ["--device", "cuda", "--set", "dist.comm=mpi"], np_=1, sub="np1")
            two = self.losses(w, ["--device", "cuda", "--set", "dist.comm=mpi"], np_=2, sub="np2")
            np.testing.assert_allclose(two, one, rtol=1e-4)
        finally:
            w.cleanup()

    @unittest.skipUnless(shutil.which("compute-sanitizer") or os.path.exists("/usr/local/cuda/bin/compute-sanitizer"),
                         "compute-sanitizer not found")
    def test_compute_sanitizer_memcheck_is_clean(self):
        w = Workdir()
        try:
            tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
            p = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "9", BINARY, "configs/model.yaml",
                                "--device", "cuda", "--set", "train.max_steps=3", "--set", f"log.dir={w.file('log')}",
                                "--set", "checkpoint.dir=", "--set", "data.val.x="], capture_output=True, text=True,
                               env=ENV, cwd=ROOT, timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
            self.assertIn("ERROR SUMMARY: 0 errors", p.stdout + p.stderr)
        finally:
            w.cleanup()


if __name__ == "__main__":
    unittest.main()
