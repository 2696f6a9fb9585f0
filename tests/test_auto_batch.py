"""train.batch_size auto: on the GPU stand-in, whose memory GPUSIM_MEMORY_MIB sets, the largest
micro-batch whose estimate fits train.memory_fraction of the free memory, the rows of a step kept by
raising train.grad_accum, the training the same bit for bit as the same choice written by hand; the
CPU keeps the configured batch when it fits; the split recorded in the checkpoint, so that a resume
splitting otherwise is refused; a GPT-2 split under the kernels' 32-bit limit; exit 2 before any data
is read when nothing fits, naming the largest part and train.recompute where it would help; the key's
own errors."""
import re
import unittest

import h5py
import numpy as np

from helpers import GPU_BINARY, ROOT, Workdir, errors, gpu_setup, params, run

ENV1, VISIBLE1, SIM = gpu_setup(1)
ENV2, VISIBLE2, _ = gpu_setup(2)

# About 0.5 MiB of activations a row (conv output 8 x 64 x 64, its gradient, the batchnorm's), so
# that the micro-batch decides the memory.
CNN = """\
model:
  input: [1, 64, 64]
  layers:
    - conv2d: {{out: 8, kernel: 3, pad: 1, bias: false}}
    - batchnorm: {{}}
    - relu
    - maxpool: {{kernel: 4}}
    - flatten
    - linear: {{out: 3}}
data: {{path: {dir}/data.h5}}
train: {{epochs: 1, batch_size: auto, global_batch_size: 32, seed: 2}}
optim: {{name: sgd, lr: 0.05, momentum: 0.9}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt}}
"""

CHOICE = re.compile(r"^train\.batch_size auto: (\d+) rows? per rank, train\.grad_accum (\d+) \((\d+) rows a step on "
                    r"(\d+) ranks?\); a rank needs ([\d.]+) MiB of the ([\d.]+) MiB it may use \(train\.memory_fraction "
                    r"([\d.]+) of ([\d.]+) MiB (.*?)\)(?:; (\d+) rows would need ([\d.]+) MiB)?$", re.M)


class AutoBatch(unittest.TestCase):
    def setUp(self):
        self.w = Workdir()
        self.w.dataset(n=64, shape=(1, 64, 64))

    def tearDown(self):
        self.w.cleanup()

    @unittest.skipUnless(SIM, "GPUSIM_MEMORY_MIB sets the stand-in's memory; a real GPU has what it has")
    def test_the_largest_micro_batch_that_fits_the_stand_ins_memory(self):
        """32 rows a step on a GPU of 520 MiB, 20 of them free once the CUDA context (the stand-in's 500 MiB)
        exists: the estimate of 32 rows does not fit 0.9 of them, that of the chosen micro-batch does, and
        the run fits too; the two steps (32 rows each) train as the same split written by hand."""
        cfg = self.w.config(CNN)
        env = dict(ENV1, GPUSIM_MEMORY_MIB="520")
        rc, out, err = run([cfg, "--device", "cuda"], binary=GPU_BINARY, env=env, timeout=300)
        self.assertEqual(rc, 0, out + err)
        m = CHOICE.search(out)
        self.assertTrue(m, out)
        rows, accum, step_rows = int(m[1]), int(m[2]), int(m[3])
        self.assertEqual((step_rows, rows * accum), (32, 32))
        self.assertGreater(accum, 1, out)  # 32 rows do not fit
        need, may_use, fraction, free = float(m[5]), float(m[6]), float(m[7]), float(m[8])
        self.assertEqual(m[9], "free on this rank's GPU")
        self.assertAlmostEqual(may_use, fraction * free, delta=0.1)
        self.assertLessEqual(need, may_use)
        self.assertGreater(float(m[11]), may_use)  # the next larger micro-batch would not fit
        self.assertGreater(int(m[10]), rows)
        self.assertIn("training: 2 optimizer steps", out)
        # the same split by hand, at the stand-in's default memory
        rc, out2, err = run([cfg, "--device", "cuda", "--set", "train.batch_size=0", "--set",
                             f"train.global_batch_size={rows}", "--set", f"train.grad_accum={accum}", "--set",
                             f"checkpoint.dir={self.w.file('hand')}"], binary=GPU_BINARY, env=ENV1, timeout=300)
        self.assertEqual(rc, 0, out2 + err)
        auto, hand = params(self.w.latest("ckpt")), params(self.w.latest("hand"))
        for k in hand:
            self.assertTrue(np.array_equal(auto[k], hand[k]), k)
        # --dry-run makes the same choice and says so
        rc, out3, err = run([cfg, "--device", "cuda", "--dry-run"], binary=GPU_BINARY, env=env, timeout=300)
        self.assertEqual(rc, 0, out3 + err)
        self.assertEqual(CHOICE.search(out3).group(1, 2, 3), m.group(1, 2, 3))

    @unittest.skipUnless(VISIBLE1, "no GPU visible (ddp_train --info)")
    def test_a_step_that_fits_the_gpu_is_kept_whole(self):
        """On whatever GPU there is (the stand-in's 80 GiB, or real hardware's free memory as the CUDA driver
        reports it): 32 rows of the small CNN fit in one micro-batch, the free memory read is a real
        amount, the estimate is under its fraction, and the run trains."""
        cfg = self.w.config(CNN)
        rc, out, err = run([cfg, "--device", "cuda", "--set", "train.max_steps=2"], binary=GPU_BINARY, env=ENV1,
                           timeout=300)
        self.assertEqual(rc, 0, out + err)
        m = CHOICE.search(out)
        self.assertTrue(m, out)
        self.assertEqual((m[1], m[2], m[3], m[4]), ("32", "1", "32", "1"))
        need, may_use, fraction, free = float(m[5]), float(m[6]), float(m[7]), float(m[8])
        self.assertEqual(m[9], "free on this rank's GPU")
        self.assertGreater(free, 1024)  # every GPU this runs on has over 1 GiB free
        self.assertAlmostEqual(may_use, fraction * free, delta=0.1)
        self.assertLess(need, may_use)
        self.assertIn("training: 2 optimizer steps", out)

    def test_the_configured_batch_when_it_fits(self):
        """A small model on the CPU, 2 ranks: the whole step in one micro-batch, as configured."""
        cfg = self.w.config(CNN)
        rc, out, err = run([cfg, "--set", "train.global_batch_size=8", "--set", "train.max_steps=2"], np_=2)
        self.assertEqual(rc, 0, out + err)
        m = CHOICE.search(out)
        self.assertTrue(m, out)
        self.assertEqual((m[1], m[2], m[3], m[4]), ("4", "1", "8", "2"))
        self.assertEqual(m[9], "of available host memory per rank on this node")
        self.assertIsNone(m[10])  # nothing larger was tried

    def test_the_checkpoint_records_the_split_and_a_resume_keeps_it(self):
        """The effective config a checkpoint holds is the split auto chose, so a resume with the same
        choice continues and one splitting the step's rows otherwise is refused, naming train.grad_accum
        (the data position counts micro-batches)."""
        cfg = self.w.config(CNN)
        base = [cfg, "--set", "train.global_batch_size=8", "--set", "checkpoint.every_steps=2"]
        rc, out, err = run(base + ["--set", "train.max_steps=2"], np_=2)
        self.assertEqual(rc, 0, out + err)
        with h5py.File(self.w.latest("ckpt"), "r") as f:
            text = f["meta"].attrs["config"].decode()
        for line in ("train.batch_size: 0", "train.global_batch_size: 8", "train.grad_accum: 1"):
            self.assertIn(line, text.splitlines())
        rc, out, err = run(base + ["--set", "train.max_steps=4", "--resume", "auto"], np_=2)
        self.assertEqual(rc, 0, out + err)
        self.assertTrue(self.w.latest("ckpt").endswith("step-00000004.h5"), self.w.latest("ckpt"))
        rc, out, err = run(base + ["--set", "train.batch_size=0", "--set", "train.global_batch_size=4", "--set",
                                   "train.grad_accum=2", "--set", "train.max_steps=6", "--resume", "auto"], np_=2)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("train.grad_accum differs", errors(err)[0])

    @unittest.skipUnless(SIM, "the stand-in's default memory (80 GiB) gives a known answer")
    def test_gpt2_on_one_gpu_is_split_under_the_kernels_32_bit_limit(self):
        """GPT-2 124M, 64 sequences of 1024 tokens a step on one GPU: 65 rows of 50257 logits a token are
        over the 2^31 values the kernels index, which auto must split under rather than refuse; with
        train.cuda_graph on it may not split (grad_accum 1), and says why."""
        base = ["configs/gpt2_124m.yaml", "--device", "cuda", "--dry-run", "--set", "data.path=", "--set",
                "model.input=[1024]", "--set", "train.batch_size=auto", "--set", "train.global_batch_size=64", "--set",
                "train.grad_accum=1"]
        rc, out, err = run(base, binary=GPU_BINARY, env=ENV1, timeout=300, cwd=ROOT)
        self.assertEqual(rc, 0, out + err)
        m = CHOICE.search(out)
        self.assertTrue(m, out)
        rows, accum = int(m[1]), int(m[2])
        self.assertEqual(rows * accum, 64)
        self.assertLess((rows + 1) * 1024 * 50257, 2 ** 31)
        rc, out, err = run(base + ["--set", "train.cuda_graph=on"], binary=GPU_BINARY, env=ENV1, timeout=300, cwd=ROOT)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("no split of the step's 64 rows keeps a rank's largest tensor under 2^31 values", errors(err)[0])

    def test_nothing_fits_is_exit_2_before_the_data_is_read(self):
        """GPT-2 124M in 1% of a rank's host memory on 2 ranks: not even one row, and exit 2 before
        training. Activations are the largest part at 512 tokens, and recomputation would not be enough
        here, so it is not offered. The rows a rank keeps in memory count (the file's shapes are read,
        not its rows): a token model keeps its tokens, which --dry-run without data leaves out."""
        path = self.w.file("tokens.h5")
        with h5py.File(path, "w") as f:
            f["train/tokens"] = np.zeros((4000, 513), np.int32)
            f["val/tokens"] = np.zeros((8, 513), np.int32)
        base = ["configs/gpt2_124m.yaml", "--set", f"data.path={path}", "--set", "train.batch_size=auto", "--set",
                "train.global_batch_size=16", "--set", "train.grad_accum=1", "--set", "train.memory_fraction=0.01",
                "--set", f"checkpoint.dir={self.w.file('ckpt')}", "--set", f"log.dir={self.w.file('log')}"]
        needs = {}
        for name, extra in (("data", []), ("none", ["--dry-run", "--set", "data.path="])):
            rc, out, err = run(base + extra, np_=2, cwd=ROOT)
            self.assertEqual(rc, 2, out + err)
            e = errors(err)
            self.assertEqual(len(e), 1, err)
            m = re.search(r"train\.batch_size auto: not even 1 row per rank fits \(train\.grad_accum 8\): a rank needs "
                          r"([\d.]+) MiB but may use [\d.]+ MiB \(train\.memory_fraction 0\.01 of [\d.]+ MiB of "
                          r"available host memory per rank on this node\); the largest part is the activations", e[0])
            self.assertTrue(m, e[0])
            self.assertNotIn("recompute", e[0])
            self.assertNotIn("step 1", out)
            needs[name] = float(m[1])
        # under data.sharding global each rank keeps all 4000 training rows of 513 int32 tokens (7.8 MiB)
        self.assertAlmostEqual(needs["data"] - needs["none"], 4000 * 513 * 4 / 2 ** 20, delta=0.1)

    def test_recompute_is_offered_where_it_would_fit(self):
        """On the stand-in, a GPT whose attention matrices dominate (materialized): with the memory set between the
        estimates of one row with and without recomputation, the error says train.recompute: blocks
        would fit, and with it set the run starts."""
        cfg = self.w.config("""\
            model:
              input: [256]
              layers:
                - embedding: {{vocab: 16, dim: 32}}
                - repeat:
                    times: 4
                    layers:
                      - residual: {{body: [layernorm: {{}}, attention: {{heads: 8, causal: true}}]}}
                - layernorm: {{}}
                - linear: {{out: 16}}
            data: {{path: /nonexistent.h5, train: {{x: /train/tokens}}, val: {{x: ""}}}}
            train: {{batch_size: auto, global_batch_size: 4, seed: 1}}
            """)
        if not SIM:
            self.skipTest("GPUSIM_MEMORY_MIB sets the stand-in's memory")
        base = [cfg, "--device", "cuda", "--dry-run", "--set", "data.path=", "--set", "model.attention=materialized"]
        rc, out, err = run(base + ["--set", "train.batch_size=1", "--set", "train.global_batch_size=0"],
                           binary=GPU_BINARY, env=ENV1, timeout=300)
        self.assertEqual(rc, 0, out + err)
        total = float(re.search(r"memory per rank at 1 rows of 256 tokens: ([\d.]+) MiB", out)[1])
        none, blocks = map(float, re.search(r"([\d.]+) MiB with train.recompute none, ([\d.]+) MiB with blocks",
                                            out).groups())
        self.assertGreater(none, 3 * blocks, out)  # the attention matrices of 4 blocks against those of 1
        mib = 500 + int((total - (none - blocks) / 2) / 0.9) + 1  # between the two totals, and the context
        env = dict(ENV1, GPUSIM_MEMORY_MIB=str(mib))
        rc, out, err = run(base, binary=GPU_BINARY, env=env, timeout=300)
        self.assertEqual(rc, 2, out + err)
        self.assertRegex(errors(err)[0], r"the largest part is the activations, [\d.]+ MiB \(the most: layer 1 "
                                         r"residual, [\d.]+ MiB\); train\.recompute: blocks would fit it$")
        rc, out, err = run(base + ["--set", "train.recompute=blocks"], binary=GPU_BINARY, env=env, timeout=300)
        self.assertEqual(rc, 0, out + err)
        self.assertRegex(out, r"(?m)^train\.batch_size auto: \d+ rows? per rank")

    def test_zero_is_offered_where_it_would_fit(self):
        """On the stand-in's 2 GPUs, an MLP whose AdamW state is most of its memory: with the memory set between
        a rank's estimates of one row with and without dist.zero 1 (which halves the state on 2 ranks), the
        error says dist.zero: 1 would fit (recomputation would not: the model has no blocks), and with it set
        the run starts."""
        cfg = self.w.config("""\
            model:
              input: [1, 64, 64]
              layers: [flatten, linear: {{out: 1024}}, relu, linear: {{out: 3}}]
            data: {{path: {dir}/data.h5}}
            train: {{batch_size: auto, global_batch_size: 2, seed: 1}}
            optim: {{name: adamw, lr: 0.001}}
            """)
        if not SIM or VISIBLE2 < 2:
            self.skipTest("GPUSIM_MEMORY_MIB sets the stand-in's memory, and this needs 2 of its GPUs")
        base = [cfg, "--device", "cuda", "--dry-run"]
        total = {}
        for zero in (0, 1):
            rc, out, err = run(base + ["--set", "train.batch_size=1", "--set", "train.global_batch_size=0", "--set",
                                       f"dist.zero={zero}"], np_=2, binary=GPU_BINARY, env=ENV2, timeout=300)
            self.assertEqual(rc, 0, out + err)
            total[zero] = float(re.search(r"memory per rank at 1 rows?: ([\d.]+) MiB", out)[1])
        self.assertGreater(total[0] - total[1], 15, total)  # half of AdamW's 2 x 4.2M values
        mib = 500 + int((total[0] + total[1]) / 2 / 0.9) + 1  # between the two, and the context
        env = dict(ENV2, GPUSIM_MEMORY_MIB=str(mib))
        rc, out, err = run(base, np_=2, binary=GPU_BINARY, env=env, timeout=300)
        self.assertEqual(rc, 2, out + err)
        self.assertRegex(errors(err)[0], r"; the largest part is .*; dist\.zero: 1 would fit it$")
        rc, out, err = run(base + ["--set", "dist.zero=1"], np_=2, binary=GPU_BINARY, env=env, timeout=300)
        self.assertEqual(rc, 0, out + err)
        self.assertRegex(out, r"(?m)^train\.batch_size auto: 1 row per rank, train\.grad_accum 1")

    def test_bad_values_are_exit_2(self):
        cfg = self.w.config(CNN)
        for sets, want in (
                (["train.global_batch_size=0", "train.batch_size=auto"], "train.batch_size auto needs "
                                                                         "train.global_batch_size"),
                (["train.batch_size=automatic"], "train.batch_size: expected an integer >= 0 or auto, got "
                                                 "'automatic'"),
                (["train.memory_fraction=1.5"], "train.memory_fraction: expected a number")):
            with self.subTest(sets=sets):
                args = [cfg, "--dry-run"]
                for s in sets:
                    args += ["--set", s]
                rc, out, err = run(args)
                self.assertEqual(rc, 2, out + err)
                self.assertIn(want, errors(err)[0])


if __name__ == "__main__":
    unittest.main()
