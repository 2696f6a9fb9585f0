"""dist.zero 1 against 0: each rank keeps the optimizer state of its slice of the parameters, gradients
are reduced to the slice's owner and parameters gathered after the step. Every tensor of the checkpoint
(parameters, optimizer state, batchnorm statistics, EMA) within 1e-6 relative of the plain run's, with
SGD (momentum) and AdamW (no_decay groups, clipping), on 2 and 3 ranks (an uneven split); the checkpoint
keeps the plain layout, so it resumes into a plain run and a plain one into ZeRO, at another world size;
on the GPU stand-in the same over NCCL with CUDA graphs, and fp16's overflow skipping the update on
every rank."""
import re
import unittest

import h5py
import numpy as np

from helpers import GPU_BINARY, ROOT, Workdir, gpu_setup, run

ENV2, VISIBLE2, _ = gpu_setup(2)
ENV1, VISIBLE1, _ = gpu_setup(1)

# 3,111 parameters: an odd count, so that 3 ranks' slices differ, and slices that cut tensors
CNN = """\
model:
  input: [1, 8, 8]
  layers:
    - conv2d: {{out: 4, kernel: 3, pad: 1}}
    - batchnorm: {{sync: true}}
    - relu
    - maxpool: {{kernel: 2}}
    - flatten
    - linear: {{out: 45}}
    - relu
    - linear: {{out: 3}}
data: {{path: {dir}/data.h5}}
train: {{epochs: 2, global_batch_size: 12, seed: 5, clip_grad_norm: 0.5, ema: {{decay: 0.9}}}}
optim: {{name: {optim}, lr: 0.05, momentum: 0.9, weight_decay: 0.01, no_decay: [bias, norm]}}
dist: {{bucket_mb: 0.004}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt, every_steps: 5}}
"""


def tensors(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, d: out.__setitem__(n, d[...]) if isinstance(d, h5py.Dataset) else None)
    return out


class Zero(unittest.TestCase):
    def setUp(self):
        self.w = Workdir()
        self.w.dataset(n=120, shape=(1, 8, 8))  # 10 steps of 12 an epoch
        with h5py.File(self.w.file("data.h5"), "a") as f:  # labels it cannot learn: the gradients stay large
            f["train/labels"][...] = np.random.default_rng(1).integers(0, 3, 120)

    def tearDown(self):
        self.w.cleanup()

    def train(self, optim, np_, zero, name, extra=(), binary=None, env=None):
        cfg = self.w.config(CNN, name=f"{optim}.yaml", optim=optim)
        args = [cfg, "--set", f"dist.zero={zero}", "--set", f"checkpoint.dir={self.w.file(name)}", "--set",
                f"log.dir={self.w.file(name + '_log')}"] + list(extra)
        kw = {"binary": binary, "env": env} if binary else {}
        rc, out, err = run(args, np_=np_, timeout=300, **kw)
        self.assertEqual(rc, 0, out + err)
        return out

    def assert_close(self, a, b, rtol=1e-6):
        ta, tb = tensors(a), tensors(b)
        self.assertEqual(sorted(ta), sorted(tb))
        self.assertTrue(any(n.startswith("optim") for n in ta), sorted(ta))
        for n in ta:
            if ta[n].dtype.kind == "f":
                scale = max(float(np.abs(tb[n]).max()), 1e-12)
                np.testing.assert_allclose(ta[n], tb[n], rtol=rtol, atol=rtol * scale, err_msg=n)
            else:
                self.assertTrue(np.array_equal(ta[n], tb[n]), n)

    def test_zero_equals_plain_on_2_and_3_ranks(self):
        """And with 2 micro-batches a step: the buckets are sent in the last one's backward."""
        for optim in ("sgd", "adamw"):
            for np_, extra in ((1, []), (2, []), (3, []), (2, ["--set", "train.grad_accum=2"])):
                with self.subTest(optim=optim, ranks=np_, extra=extra):
                    tag = f"{optim}{np_}{len(extra)}"
                    self.train(optim, np_, 0, "plain" + tag, extra)
                    out = self.train(optim, np_, 1, "zero" + tag, extra)
                    self.assertRegex(out, r"(?m)^dist\.zero 1: rank 0 keeps the optimizer state of parameters \[0, "
                                          rf"{3111 // np_}\), {3111 // np_} of 3111 ")
                    self.assert_close(self.w.latest("zero" + tag), self.w.latest("plain" + tag))

    def test_dry_run_counts_a_quarter_of_adamw_on_4_ranks(self):
        """GPT-2 124M: AdamW's two moments of 124,439,808 values, 949.4 MiB, a quarter of them per rank."""
        optim = {}
        for zero in (0, 1):
            rc, out, err = run(["configs/gpt2_124m.yaml", "--dry-run", "--set", "data.path=", "--set",
                                f"dist.zero={zero}", "--set", "checkpoint.dir=", "--set", "train.batch_size=1", "--set",
                                "train.grad_accum=1"], np_=4, cwd=ROOT)
            self.assertEqual(rc, 0, out + err)
            m = re.search(r"optimizer ([\d.]+)( \(dist\.zero 1: rank 0's slice\))? \+", out)
            self.assertTrue(m, out)
            self.assertEqual(bool(m[2]), bool(zero), out)
            optim[zero] = float(m[1])
        self.assertAlmostEqual(optim[0], 2 * 124439808 * 4 / 2 ** 20, delta=0.1)
        self.assertAlmostEqual(optim[1], optim[0] / 4, delta=0.1)

    def test_checkpoints_move_between_zero_and_plain_and_world_sizes(self):
        """The checkpoint keeps the plain layout: a ZeRO run on 3 ranks stopped at step 10 resumes as a
        plain run on 2, and a plain run on 2 as a ZeRO run on 3, each ending where the same two runs
        without ZeRO end (within 1e-6); a ZeRO resume at the same world size is bit-exact."""
        for name, (first, second) in (("a", ((3, 1), (2, 0))), ("b", ((2, 0), (3, 1)))):
            for zero in (True, False):
                tag = name + ("zero" if zero else "plain")
                (np1, z1), (np2, z2) = first, second
                self.train("adamw", np1, z1 if zero else 0, tag, ["--set", "train.max_steps=10"])
                self.train("adamw", np2, z2 if zero else 0, tag, ["--resume", "auto"])
                self.assertTrue(self.w.latest(tag).endswith("step-00000020.h5"), self.w.latest(tag))
            self.assert_close(self.w.latest(name + "zero"), self.w.latest(name + "plain"))
        self.train("adamw", 2, 1, "c", ["--set", "train.max_steps=10"])
        self.train("adamw", 2, 1, "c", ["--resume", "auto"])
        self.train("adamw", 2, 1, "d")
        ta, tb = tensors(self.w.latest("c")), tensors(self.w.latest("d"))
        for n in tb:
            if n.startswith(("model/", "optim", "ema/")):
                self.assertTrue(np.array_equal(ta[n], tb[n]), n)

    @unittest.skipUnless(VISIBLE1, "no GPU visible (ddp_train --info)")
    def test_zero_over_mpi_through_host_memory_equals_plain(self):
        """Two ranks sharing one GPU: the gradients reduced and the parameters gathered through host memory."""
        extra = ["--device", "cuda", "--set", "dist.comm=mpi"]
        self.train("adamw", 2, 0, "hplain", extra, GPU_BINARY, ENV1)
        self.train("adamw", 2, 1, "hzero", extra, GPU_BINARY, ENV1)
        self.assert_close(self.w.latest("hzero"), self.w.latest("hplain"))

    @unittest.skipUnless(VISIBLE2 >= 2, "fewer than 2 GPUs visible")
    def test_zero_over_nccl_with_cuda_graphs_equals_plain(self):
        extra = ["--device", "cuda", "--set", "dist.comm=nccl", "--set", "train.cuda_graph=on"]
        for optim in ("sgd", "adamw"):
            with self.subTest(optim=optim):
                self.train(optim, 2, 0, f"gplain{optim}", extra, GPU_BINARY, ENV2)
                self.train(optim, 2, 1, f"gzero{optim}", extra, GPU_BINARY, ENV2)
                self.assert_close(self.w.latest(f"gzero{optim}"), self.w.latest(f"gplain{optim}"))
        # dist.grad_dtype bf16: the buckets reduced in bfloat16, widened on the slice's rank only
        bf16 = extra + ["--set", "dist.grad_dtype=bf16"]
        self.train("adamw", 2, 0, "bf16_0", bf16, GPU_BINARY, ENV2)
        self.train("adamw", 2, 1, "bf16_1", bf16, GPU_BINARY, ENV2)
        self.assert_close(self.w.latest("bf16_1"), self.w.latest("bf16_0"))
        # fp16: rank 1's injected overflow lands in rank 0's slice (the buffer's first value), and the
        # count summed over the slices makes both ranks skip that update
        fp16 = extra + ["--set", "train.precision=fp16"]
        env = dict(ENV2, DDP_TRAIN_FAULT="overflow@1:3")
        for zero in (0, 1):
            out = self.train("adamw", 2, zero, f"fp16_{zero}", fp16, GPU_BINARY, env)
            self.assertRegex(out, r"(?m)^step 3: \d+ gradient values overflowed in fp16: update skipped")
        self.assert_close(self.w.latest("fp16_1"), self.w.latest("fp16_0"))


if __name__ == "__main__":
    unittest.main()
