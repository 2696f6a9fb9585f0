"""`make bench` (benchmarks/bench.sh): the GPU table, run on the GPU of the GPU suites (in `make test` the
CPU stand-in, build/sim/ddp_train) with tiny batches and windows and PyTorch on the CPU
(BENCH_TORCH_DEVICE=cpu), must print every row with numbers and a ratio; without a GPU the driver
says so and starts the CPU table. Only the shape of the output is checked, never a timing."""
import os
import re
import signal
import subprocess
import sys
import tempfile
import unittest

from helpers import BINARY, ENV, GPU_BINARY, ROOT, gpu_setup

ENV1, VISIBLE1, SIM = gpu_setup(1)
NUMBER = r"\d+(\.\d+)?"


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


class Bench(unittest.TestCase):
    @unittest.skipUnless(VISIBLE1, "no GPU visible (ddp_train --info of DDP_TRAIN_GPU_BINARY)")
    def test_the_gpu_table_has_every_row(self):
        env = dict(ENV, **ENV1, PYTHON=sys.executable, BENCH_DDP_BINARY=GPU_BINARY, BENCH_STEPS="1",
                   BENCH_WINDOWS="1", BENCH_BATCH="4", BENCH_LAUNCHES="1", BENCH_TORCH_DEVICE="cpu")
        p = subprocess.run(["bash", "benchmarks/bench.sh"], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        out = p.stdout
        self.assertTrue(out.startswith("GPU table"), out)
        rows = [cells(l) for l in out.splitlines() if l.startswith("| ") and not l.startswith("| case ")]
        names = [r[0] for r in rows]
        cnn = "default CNN (configs/model.yaml)"
        want = [f"{cnn}, fp32, batch 4", f"{cnn}, tf32, batch 4", f"{cnn}, bf16, batch 4",
                "MLP 784-1024-1024-10 (configs/mlp.yaml), tf32, batch 4",
                "ResNet-18 CIFAR (configs/resnet18_cifar.yaml), bf16, batch 4",
                "launch to end of first step (s, lower is better), default CNN, fp32, batch 4"]
        self.assertEqual(names, want, out)
        for r in rows[:-1]:  # ddp_train, PyTorch eager, PyTorch best, setting, ratio, target
            self.assertEqual(len(r), 7, r)
            for c in r[1:4]:
                self.assertRegex(c, f"^{NUMBER}$", r)
            self.assertRegex(r[4], r"^(eager|channels-last|cuda-graph|reduce-overhead|max-autotune)\b", r)
            self.assertRegex(r[5], f"^{NUMBER}x$", r)
        self.assertEqual([r[6] for r in rows], [">= 3x"] * 3 + ["-", ">= 1.5x", "<= 0.5 s"])
        first = rows[-1]
        self.assertRegex(first[1], f"^{NUMBER} s$", first)
        self.assertRegex(first[2], f"^{NUMBER} s$", first)
        self.assertRegex(first[5], f"^{NUMBER}x$", first)
        self.assertIn("Targets", out)
        self.assertRegex(out, rf"ddp_train {NUMBER} s, of which {NUMBER} s\s+to its")
        self.assertEqual(len(re.findall(rf"^- .*: eager {NUMBER}", out, re.M)), 5, out)  # settings tried
        if SIM:
            self.assertIn("a smoke run", out)

    def test_without_a_gpu_it_says_so_and_starts_the_cpu_table(self):
        """The CPU table itself takes minutes: stopped once its header is out (its temporary files in a
        TMPDIR of the test's own, since it cannot clean up after SIGKILL)."""
        tmp = tempfile.TemporaryDirectory(prefix="ddp_train_bench_")
        self.addCleanup(tmp.cleanup)
        env = dict(ENV, PYTHON=sys.executable, BENCH_DDP_BINARY=BINARY, CUDA_VISIBLE_DEVICES="", GPUSIM_DEVICES="0",
                   TMPDIR=tmp.name)
        p = subprocess.Popen(["bash", "benchmarks/bench.sh"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL, text=True, env=env, cwd=ROOT, start_new_session=True)
        try:
            first = p.stdout.readline()
            header = ""
            for line in p.stdout:
                if line.startswith("|"):
                    header = line
                    break
        finally:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            p.stdout.close()
        self.assertTrue(first.startswith("no GPU: CPU table ("), first)
        self.assertEqual(header, "| case | ddp_train samples/s | PyTorch samples/s | ratio |\n")


if __name__ == "__main__":
    unittest.main()
