"""`make bench` (benchmarks/bench.sh): the GPU table, run on the GPU of the GPU suites (in `make test` the
CPU stand-in, build/sim/ddp_train) with tiny batches and windows and PyTorch on the CPU
(BENCH_TORCH_DEVICE=cpu), must print every row with numbers and a ratio, its GPT-2 rows on a tiny GPT
(BENCH_GPT_CONFIG, a 124M model is far too slow for the stand-in); without a GPU the driver says so and
starts the CPU table, whose every row (ResNet-18, the tiny GPT's in tokens/s and the 2-rank DDP row too) is
checked at one pair of runs with one timed window of 2 steps;
`make bench-gpt`'s script runs 2 steps from the same weights and rows on both sides. Only the shape of
the output is checked, never a timing."""
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
SETTING = r"^(eager|channels-last|sdpa|cuda-graph|reduce-overhead|max-autotune)\b"


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(out):
    """The Markdown tables of the output: a list of (header cells, [row cells])."""
    got, lines = [], out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| case ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            rows = []
            for l in lines[i + 2:]:
                if not l.startswith("| "):
                    break
                rows.append(cells(l))
            got.append((cells(line), rows))
    return got


class Bench(unittest.TestCase):
    @unittest.skipUnless(VISIBLE1, "no GPU visible (ddp_train --info of DDP_TRAIN_GPU_BINARY)")
    def test_the_gpu_table_has_every_row(self):
        """Every row, and each row of ddp_train again with BENCH_DDP_AB's override."""
        env = dict(ENV, **ENV1, PYTHON=sys.executable, BENCH_DDP_BINARY=GPU_BINARY, BENCH_STEPS="1",
                   BENCH_WINDOWS="1", BENCH_BATCH="4", BENCH_LAUNCHES="1", BENCH_TORCH_DEVICE="cpu",
                   BENCH_GPT_CONFIG="configs/gpt_tiny.yaml", BENCH_GPT_SEQ="16", BENCH_GPT_BATCH="2",
                   BENCH_GPT_ATTENTION="auto materialized", BENCH_DDP_AB="train.queue_ahead=false")
        p = subprocess.run(["bash", "benchmarks/bench.sh"], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        out = p.stdout
        self.assertTrue(out.startswith("GPU table"), out)
        (_, rows), (gpt_header, gpt_rows) = tables(out)
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
            self.assertRegex(r[4], SETTING, r)
            self.assertRegex(r[5], f"^{NUMBER}x$", r)
        self.assertEqual([r[6] for r in rows], [">= 3x"] * 3 + ["-", ">= 1.5x", "<= 0.5 s"])
        first = rows[-1]
        self.assertRegex(first[1], f"^{NUMBER} s$", first)
        self.assertRegex(first[2], f"^{NUMBER} s$", first)
        self.assertRegex(first[5], f"^{NUMBER}x$", first)
        self.assertIn("Targets", out)
        self.assertRegex(out, rf"ddp_train {NUMBER} s, of which {NUMBER} s\s+to its")
        self.assertEqual(gpt_header[1:3], ["ddp_train tokens/s", "ddp_train MFU"], out)
        gpt = "GPT (configs/gpt_tiny.yaml), seq 16"
        self.assertEqual([r[0] for r in gpt_rows], [f"{gpt}, {p}, batch 2, attention {a}" for p in ("fp32", "bf16")
                                                    for a in ("auto", "materialized")], out)
        for r in gpt_rows:  # tokens/s and MFU of ddp_train, PyTorch eager, PyTorch best; setting; ratio
            self.assertEqual(len(r), 9, r)
            for c in (r[1], r[3], r[5]):
                self.assertRegex(c, f"^{NUMBER}$", r)
            for c in (r[2], r[4], r[6]):
                self.assertRegex(c, f"^{NUMBER}%$", r)
            self.assertRegex(r[7], SETTING, r)
            self.assertRegex(r[8], f"^{NUMBER}x$", r)
        self.assertRegex(out, r"MFU: target tokens/s x \d+ FLOPs per token")
        self.assertEqual(len(re.findall(rf"^- .*: eager {NUMBER}", out, re.M)), 7, out)  # settings tried
        ab = re.findall(rf"^- (.*), train.queue_ahead=false: {NUMBER} (samples|tokens)/s; the default {NUMBER}x of it$",
                        out, re.M)  # BENCH_DDP_AB: each ddp_train row again
        self.assertEqual([a[0] for a in ab], want[:-1] + [r[0] for r in gpt_rows],
                         out)
        if SIM:
            self.assertIn("a smoke run", out)

    @unittest.skipUnless(VISIBLE1 and SIM, "needs the stand-in's fault injection (GPUSIM_KERNEL_FAULT)")
    def test_a_row_that_fails_does_not_stop_the_gpu_table(self):
        """A lent GPU window must not lose the table to one broken kernel. pool16_fwd_kernel (only the
        default CNN's bf16 row runs it, and only under model.fuse) faults: that row's run fails, is run again
        with BENCH_DDP_FALLBACK (model.fuse=false) and gives that figure, marked; the MLP row after it runs;
        the failure is listed under the tables and the script exits 1. Without a fallback the cell says
        failed; a run past BENCH_RUN_TIMEOUT_S (a rank hung on the host at step 2) is ended and said so."""
        base = dict(ENV, **ENV1, PYTHON=sys.executable, BENCH_DDP_BINARY=GPU_BINARY, BENCH_STEPS="1",
                    BENCH_WINDOWS="1", BENCH_BATCH="4", BENCH_TORCH_DEVICE="cpu", BENCH_TORCH_SETTINGS="eager",
                    BENCH_GPT_CONFIG="configs/gpt_tiny.yaml", BENCH_GPT_SEQ="16", BENCH_GPT_BATCH="2")
        cnn = "default CNN (configs/model.yaml), bf16, batch 4"
        mlp = "MLP 784-1024-1024-10 (configs/mlp.yaml), tf32, batch 4"

        def bench(**env):
            p = subprocess.run(["bash", "benchmarks/gpu_bench.sh"], capture_output=True, text=True, cwd=ROOT,
                               env=dict(base, **env), timeout=600)
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            (_, rows), _ = tables(p.stdout)
            return {r[0]: r for r in rows}, p.stdout, p.stderr

        rows, out, err = bench(BENCH_ONLY="CNN.*bf16|MLP", GPUSIM_KERNEL_FAULT="pool16_fwd_kernel")
        self.assertEqual(list(rows), [cnn, mlp], out)
        self.assertRegex(rows[cnn][1], rf"^{NUMBER} \(model\.fuse=false; the default failed\)$", out)
        for r in rows.values():
            self.assertRegex(r[5], f"^{NUMBER}x$", r)
        self.assertRegex(rows[mlp][1], f"^{NUMBER}$", out)
        self.assertRegex(out, rf"(?m)^Runs that failed .*\n- {re.escape(cnn)}: ddp_train exit 70: ddp_train: error: "
                         r"rank 0: the GPU faulted: ")
        self.assertIn("gpu_bench: ddp_train configs/model.yaml (bf16, batch 4): exit 70; its last lines:", err)

        rows, out, _ = bench(BENCH_ONLY="CNN.*bf16", GPUSIM_KERNEL_FAULT="pool16_fwd_kernel", BENCH_DDP_FALLBACK="")
        self.assertEqual((rows[cnn][1], rows[cnn][5]), ("failed", "-"), out)
        self.assertRegex(rows[cnn][2], f"^{NUMBER}$", out)  # PyTorch's side still ran

        rows, out, _ = bench(BENCH_ONLY="MLP", DDP_TRAIN_FAULT="hang@0:2", BENCH_RUN_TIMEOUT_S="5")
        self.assertEqual(rows[mlp][1], "failed", out)
        self.assertIn(f"- {mlp}: ddp_train past BENCH_RUN_TIMEOUT_S = 5 s: ", out)
        self.assertIn(f"- {mlp}: ddp_train with model.fuse=false past BENCH_RUN_TIMEOUT_S = 5 s: ", out)

    def test_the_cpu_table_has_every_row(self):
        """The CPU table at its smallest (BENCH_STEPS=2 BENCH_PAIRS=1 BENCH_WINDOWS=2: one pair a row, a
        warm-up window and one timed window of 2 steps a side): one table, every model family and the 2-rank
        DDP row, each cell a median with its range, GFLOP/s consistent with the FLOPs under the table."""
        tmp = tempfile.TemporaryDirectory(prefix="ddp_train_bench_")
        self.addCleanup(tmp.cleanup)
        env = dict(ENV, PYTHON=sys.executable, BENCH_STEPS="2", BENCH_PAIRS="1", BENCH_WINDOWS="2", TMPDIR=tmp.name)
        p = subprocess.run(["bash", "benchmarks/cpu_bench.sh"], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        out = p.stdout
        (header, rows), = tables(out)
        self.assertEqual(header, ["case", "unit", "ddp_train", "ddp_train GFLOP/s", "PyTorch", "PyTorch GFLOP/s",
                                  "ddp_train / PyTorch"])
        want = [("default CNN (configs/model.yaml), batch 256", "samples/s", "configs/model.yaml"),
                ("MLP 784-1024-1024-10 (configs/mlp.yaml), batch 1024", "samples/s", "configs/mlp.yaml"),
                ("ResNet-18 CIFAR (configs/resnet18_cifar.yaml), batch 64", "samples/s",
                 "configs/resnet18_cifar.yaml"),
                ("tiny GPT (configs/gpt_tiny.yaml), 32 x 128 tokens", "tokens/s", "configs/gpt_tiny.yaml"),
                ("tiny GPT, train.recompute blocks (PyTorch: every activation kept)", "tokens/s",
                 "configs/gpt_tiny.yaml"),
                ("make run: default CNN, 2 ranks x 1 thread (PyTorch: DDP, gloo), global batch 256", "samples/s",
                 "configs/model.yaml")]
        self.assertEqual([(r[0], r[1]) for r in rows], [w[:2] for w in want], out)
        mflops = dict(re.findall(r"(configs/\S+\.yaml) ([\d.]+) MFLOP a (?:sample|token)", out))
        self.assertEqual(set(mflops), {w[2] for w in want}, out)
        span = rf"^({NUMBER}) \({NUMBER}–{NUMBER}\)$"
        for r, (_, _, cfg) in zip(rows, want):
            self.assertEqual(len(r), 7, r)
            for rate, gflops in ((r[2], r[3]), (r[4], r[5])):  # one pair: median = min = max
                m = re.match(span, rate)
                self.assertIsNotNone(m, r)
                self.assertEqual(rate, f"{m[1]} ({m[1]}–{m[1]})", r)
                self.assertRegex(gflops, f"^{NUMBER}$", r)
                self.assertAlmostEqual(float(gflops), float(m[1]) * float(mflops[cfg]) / 1e3,
                                       delta=0.1 + 0.01 * float(gflops), msg=r)
            self.assertRegex(r[6], rf"^{NUMBER}x \({NUMBER}x–{NUMBER}x\)$", r)
        self.assertIn("median (min–max) of 1 paired runs of 2 windows of 2 steps", out)
        self.assertRegex(out.rstrip().splitlines()[-1], r"threads; OpenBLAS.*; PyTorch \S+$")

    def test_the_gpt_tiny_comparison_runs_and_agrees_from_the_same_start(self):
        """make bench-gpt's script for 2 steps, both sides from the same weights and rows (--same-init
        --ddp-order): the table, PASS, and the two training losses equal to float rounding."""
        tmp = tempfile.TemporaryDirectory(prefix="ddp_train_bench_")
        self.addCleanup(tmp.cleanup)
        p = subprocess.run([sys.executable, "benchmarks/gpt_tiny_compare.py", "--max-steps", "2", "--every", "1",
                            "--same-init", "--ddp-order", "--binary", BINARY, "--keep", tmp.name],
                           capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        (header, rows), = tables(p.stdout.replace("| run |", "| case |"))
        self.assertEqual(header, ["case", "final val loss", "wall s", "train s", "tokens/s"])
        self.assertEqual([r[0].split(",")[0] for r in rows], ["ddp_train", "PyTorch " + __import__("torch").__version__])
        a, b = float(rows[0][1]), float(rows[1][1])
        self.assertLess(abs(a - b) / b, 1e-4, p.stdout)
        self.assertIn("within 2% of PyTorch: PASS", p.stdout)
        curve = re.search(r"1: ([\d.]+)/([\d.]+), 2: ([\d.]+)/([\d.]+)", p.stdout)
        self.assertIsNotNone(curve, p.stdout)
        self.assertAlmostEqual(float(curve[1]), float(curve[2]), places=3)
        self.assertAlmostEqual(float(curve[3]), float(curve[4]), places=3)

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
        self.assertEqual(header, "| case | unit | ddp_train | ddp_train GFLOP/s | PyTorch | PyTorch GFLOP/s | "
                                 "ddp_train / PyTorch |\n")


class StartupTable(unittest.TestCase):
    def test_startup_rows(self):
        """benchmarks/startup.py with one run each: --version, --help, --dry-run, launch to step 1 beside
        PyTorch DDP, and the CUDA libraries' load cost, each a number of seconds."""
        p = subprocess.run([sys.executable, "benchmarks/startup.py", "--runs", "1", "--binary", BINARY],
                           capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        rows = [l for l in p.stdout.splitlines() if l.startswith("| `ddp_train") or l.startswith("| launch")]
        self.assertEqual(len(rows), 4, p.stdout)
        for row in rows:
            ours = row.split("|")[2].split()[0]
            self.assertGreater(float(ours), 0.0, row)
        theirs = rows[-1].split("|")[3].split()[0]
        self.assertGreater(float(theirs), 0.0, rows[-1])


if __name__ == "__main__":
    unittest.main()
