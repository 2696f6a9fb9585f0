"""train.recompute blocks against none: every tensor of the checkpoint (parameters, batchnorm running
statistics, optimizer state, EMA) equal to the bit after 20 steps with dropout on, on the CPU (1 and 2
ranks, gradient accumulation) and on the GPU stand-in (1 rank in fp32 and bf16, 2 ranks over NCCL; CUDA
graphs on);
--dry-run's activation memory for both settings."""
import re
import unittest

import h5py
import numpy as np

from helpers import GPU_BINARY, ROOT, Workdir, gpu_setup, run

ENV2, VISIBLE2, _ = gpu_setup(2)
ENV1, VISIBLE1, _ = gpu_setup(1)

# A CNN with each kind of block: two copies of a repeat whose fused relu ends the copy (its output is
# the batchnorm's buffers), a residual with a shortcut, synchronised batchnorm and dropout inside, a
# residual holding pooling. The layers between blocks are kept as they are.
CNN = """\
model:
  input: [1, 8, 8]
  layers:
    - conv2d: {{out: 4, kernel: 3, pad: 1, bias: false}}
    - batchnorm: {{sync: true}}
    - relu
    - repeat:
        times: 2
        layers:
          - conv2d: {{out: 4, kernel: 3, pad: 1}}
          - batchnorm: {{}}
          - relu
    - residual:
        body:
          - conv2d: {{out: 8, kernel: 3, stride: 2, pad: 1, bias: false}}
          - batchnorm: {{sync: true}}
          - relu
          - dropout: {{p: 0.3}}
          - conv2d: {{out: 8, kernel: 3, pad: 1}}
        shortcut:
          - conv2d: {{out: 8, kernel: 1, stride: 2}}
    - relu
    - residual:
        body: [maxpool: {{kernel: 2}}]
        shortcut: [avgpool: {{kernel: 2}}]
    - flatten
    - linear: {{out: 3}}
data: {{path: {dir}/data.h5}}
train: {{epochs: 1, global_batch_size: 8, seed: 5, eval_every_steps: 10, ema: {{decay: 0.9}}}}
optim: {{name: sgd, lr: 0.01, momentum: 0.9}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt}}
"""

# Blocks inside blocks: a repeat's copies (the block) holding a repeat and a residual that holds a
# residual; an MLP block whose relu the first linear applies (model.fuse); a residual ending the model, so
# that its output is the logits.
NESTED = """\
model:
  input: [1, 8, 8]
  layers:
    - repeat:
        times: 2
        layers:
          - repeat:
              times: 2
              layers: [conv2d: {{out: 4, kernel: 3, pad: 1}}, batchnorm: {{}}, relu]
          - residual:
              body:
                - residual: {{body: [conv2d: {{out: 4, kernel: 3, pad: 1}}, relu]}}
                - dropout: {{p: 0.2}}
    - flatten
    - residual: {{body: [linear: {{out: 16}}, relu, linear: {{out: 256}}]}}
    - linear: {{out: 3}}
    - residual: {{body: [linear: {{out: 3}}, tanh]}}
data: {{path: {dir}/data.h5}}
train: {{epochs: 1, global_batch_size: 8, seed: 5, ema: {{decay: 0.9}}}}
optim: {{name: sgd, lr: 0.01, momentum: 0.9}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt}}
"""

# A GPT whose blocks are a repeat's copies (two residuals each) and one residual outside it, with
# dropout on the embeddings, the attention probabilities and inside the MLP.
GPT = """\
model:
  input: [8]
  layers:
    - embedding: {{vocab: 20, dim: 16}}
    - dropout: {{p: 0.1}}
    - repeat:
        times: 2
        layers:
          - residual: {{body: [layernorm: {{}}, attention: {{heads: 2, causal: true, dropout: 0.2}}]}}
          - residual: {{body: [layernorm: {{}}, linear: {{out: 32}}, gelu: {{approximate: tanh}}, dropout: {{p: 0.1}},
                               linear: {{out: 16}}]}}
    - residual: {{body: [layernorm: {{}}, linear: {{out: 16}}]}}
    - layernorm: {{}}
    - linear: {{out: 20, bias: false, tie: "0"}}
  loss: cross_entropy
data: {{path: {dir}/tokens.h5, train: {{x: /train/tokens}}, val: {{x: /val/tokens}}}}
train: {{epochs: 1, global_batch_size: 8, seed: 4, eval_every_steps: 10, clip_grad_norm: 1.0, ema: {{decay: 0.9}}}}
optim: {{name: adamw, lr: 0.01}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt}}
"""


def tokens(path, split, n, seed):
    """(n, 9) token rows in which every odd position follows from the one before (3 t + 1 mod 20)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 20, (n, 9)).astype(np.int32)
    rows[:, 1::2] = (3 * rows[:, 0:8:2] + 1) % 20
    with h5py.File(path, "a") as f:
        f[f"{split}/tokens"] = rows


class Recompute(unittest.TestCase):
    def setUp(self):
        self.w = Workdir()
        self.w.dataset(n=160, shape=(1, 8, 8))  # 20 steps of 8
        tokens(self.w.file("tokens.h5"), "train", 160, 0)
        tokens(self.w.file("tokens.h5"), "val", 16, 1)

    def tearDown(self):
        self.w.cleanup()

    def runs(self, text, np_, extra, binary=None, env=None):
        """The run's checkpoint and logged losses with train.recompute none and blocks."""
        cfg = self.w.config(text)
        got = {}
        for mode in ("none", "blocks"):
            args = [cfg, "--set", f"train.recompute={mode}", "--set", f"checkpoint.dir={self.w.file(mode)}",
                    "--set", f"log.dir={self.w.file(mode + '_log')}"] + extra
            kw = {"binary": binary, "env": env, "timeout": 300} if binary else {}
            rc, out, err = run(args, np_=np_, **kw)
            self.assertEqual(rc, 0, out + err)
            self.assertTrue(self.w.latest(mode).endswith("step-00000020.h5"), self.w.latest(mode))
            got[mode] = (self.w.latest(mode), self.w.metrics(mode + "_log"), out)
        return got

    def check(self, got, metrics=("loss", "val_loss", "ema_val_loss")):
        with h5py.File(got["none"][0], "r") as a, h5py.File(got["blocks"][0], "r") as b:
            names = []
            a.visit(lambda n: names.append(n) if isinstance(a[n], h5py.Dataset) else None)
            for part in ("model/", "ema/", "optim"):
                self.assertTrue(any(n.startswith(part) for n in names), names)
            for n in names:
                self.assertTrue(np.array_equal(a[n][...], b[n][...]), n)
        self.assertRegex(got["blocks"][2], r"(?m)^train\.recompute blocks: \d+ blocks run forward again before their "
                                           r"backward; activations [\d.]+ MiB instead of [\d.]+$")
        self.assertNotIn("train.recompute blocks:", got["none"][2])
        # the losses and the validation metrics logged at every step, to the bit
        for key in metrics:
            none = [r[key] for r in got["none"][1] if key in r]
            self.assertTrue(none, key)
            self.assertEqual(none, [r[key] for r in got["blocks"][1] if key in r], key)

    def blocks(self, text):
        rc, out, err = run([self.w.config(text, name="dry.yaml"), "--dry-run", "--set", "train.recompute=blocks"])
        self.assertEqual(rc, 0, out + err)
        return int(re.search(r"with blocks \((\d+) blocks\)", out)[1])

    # 2 ranks: 2 micro-batches of 4 rows a step, so that a block is recomputed in each
    CPU_CASES = ((1, []), (2, ["--set", "train.global_batch_size=4", "--set", "train.grad_accum=2"]))

    def test_cnn_on_the_cpu(self):
        self.assertEqual(self.blocks(CNN), 4)  # the repeat's 2 copies, 2 residuals
        for np_, extra in self.CPU_CASES:
            with self.subTest(ranks=np_):
                self.check(self.runs(CNN, np_, extra))

    def test_nested_blocks_on_the_cpu(self):
        """With model.fuse on and off: the relu a batchnorm or a linear applies, or its own buffers."""
        self.assertEqual(self.blocks(NESTED), 4)  # the outer repeat's 2 copies, the MLP, the last residual
        for fuse in ("true", "false"):
            with self.subTest(fuse=fuse):
                self.check(self.runs(NESTED, 1, ["--set", f"model.fuse={fuse}"]), metrics=("loss",))

    def test_gpt_on_the_cpu(self):
        self.assertEqual(self.blocks(GPT), 3)  # the repeat's 2 copies of 2 residuals, 1 residual
        for np_, extra in self.CPU_CASES:
            with self.subTest(ranks=np_):
                self.check(self.runs(GPT, np_, extra))

    @unittest.skipUnless(VISIBLE1, "no GPU visible (ddp_train --info)")
    def test_on_the_gpu_with_cuda_graphs(self):
        cases = [(1, ENV1, []), (1, ENV1, ["--set", "train.precision=bf16"])]
        if VISIBLE2 >= 2:
            cases.append((2, ENV2, ["--set", "dist.comm=nccl"]))
        for text in (CNN, GPT):
            for np_, env, extra in cases:
                with self.subTest(model=text.split("\n")[3].strip(), ranks=np_, extra=extra):
                    got = self.runs(text, np_, ["--device", "cuda", "--set", "train.cuda_graph=on"] + extra,
                                    binary=GPU_BINARY, env=env)
                    self.check(got)
                    for mode in ("none", "blocks"):
                        self.assertRegex(got[mode][2], r"(?m)^cuda graph: \d+ steps? captured, \d+ replayed$")


class DryRun(unittest.TestCase):
    def activations(self, *extra):
        rc, out, err = run(["configs/gpt2_124m.yaml", "--dry-run", "--set", "data.path=", "--set",
                            "model.input=[1024]", "--set", "train.batch_size=8", "--set", "train.grad_accum=1"]
                           + list(extra), cwd=ROOT)
        m = re.search(r"activations of the layers at 8 rows: ([\d.]+) MiB with train.recompute none, ([\d.]+) MiB "
                      r"with blocks \(12 blocks\)", out)
        self.assertTrue(m, out + err)
        line = re.search(r"memory per rank at 8 rows of 1024 tokens: .* activations ([\d.]+) ", out)
        self.assertTrue(line, out + err)
        return float(m[1]), float(m[2]), float(line[1])

    def test_blocks_cut_gpt2_activations_by_4x_or_more(self):
        """GPT-2 124M at 8 x 1024 tokens: the (12, 1024, 1024) attention matrices of one block instead of
        twelve. The memory line counts the setting the run uses (plus the token ids)."""
        none, blocks, used = self.activations()
        self.assertGreaterEqual(none / blocks, 4.0, (none, blocks))
        self.assertAlmostEqual(used, none, delta=0.2)
        none2, blocks2, used = self.activations("--set", "train.recompute=blocks")
        self.assertEqual((none, blocks), (none2, blocks2))
        self.assertAlmostEqual(used, blocks, delta=0.2)

    def test_a_model_without_blocks_says_so(self):
        rc, out, err = run(["configs/mlp.yaml", "--dry-run", "--set", "data.path=", "--set", "train.recompute=blocks"],
                           cwd=ROOT)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("this model has no residual layer or repeat, so train.recompute blocks recomputes nothing", out)


if __name__ == "__main__":
    unittest.main()
