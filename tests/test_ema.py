"""train.ema: the moving average of the weights against one computed here from the same parameter
trajectory (every step's checkpoint), on the CPU and on CUDA (the stand-in in `make test`); its
validation metrics, early stopping and best.h5 by them, bit-exact resume, and the export."""
import os
import subprocess
import unittest

import h5py
import numpy as np

from helpers import BINARY, ENV, GPU_BINARY, ROOT, Workdir, errors, gpu_setup, run

GPU_ENV, GPU_VISIBLE, _ = gpu_setup(1)

# conv + batchnorm, so that the EMA covers running statistics too
EMA_CNN = """\
model:
  input: [1, 6, 6]
  layers:
    - conv2d: {{out: 4, kernel: 3, pad: 1}}
    - batchnorm: {{}}
    - relu
    - maxpool: {{kernel: 2}}
    - flatten
    - linear: {{out: 3}}
data:
  path: {dir}/data.h5
  scale: 0.00392156862745098
train: {{epochs: 3, global_batch_size: 8, seed: 3, ema: {{decay: {decay}}}}}
optim: {{name: sgd, lr: 0.1, momentum: 0.9}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt, every_steps: 1, keep: 100}}
"""


def group(path, name):
    with h5py.File(path, "r") as f:
        return {k: f[name][k][...] for k in f[name]}


def step_file(w, step):
    return w.file(f"ckpt/step-{step:08d}.h5")


class Ema(unittest.TestCase):
    def setUp(self):
        self.w = Workdir()
        self.w.dataset(n=32, n_val=12)

    def tearDown(self):
        self.w.cleanup()

    def trajectory(self, binary, env, device):
        """K steps from known weights (model.init_from); the EMA in every step's checkpoint must be
        decay * ema + (1 - decay) * weights of that step, from the starting weights on."""
        d, steps = 0.75, 6
        cfg = self.w.config(EMA_CNN, decay=d)
        # known starting weights: the model after one step of a first run
        rc, out, err = run([cfg, "--device", device, "--set", "train.max_steps=1", "--set",
                            f"checkpoint.dir={self.w.file('first')}"], binary=binary, env=env)
        self.assertEqual(rc, 0, out + err)
        init = self.w.file("first/step-00000001.h5")
        rc, out, err = run([cfg, "--device", device, "--set", f"train.max_steps={steps}", "--set",
                            f"model.init_from={init}"], np_=2, binary=binary, env=env)
        self.assertEqual(rc, 0, out + err)
        decay, rest = np.float32(d), np.float32(1) - np.float32(d)
        ema = group(init, "model")  # the EMA starts as a copy of the weights
        for t in range(1, steps + 1):
            weights, saved = group(step_file(self.w, t), "model"), group(step_file(self.w, t), "ema")
            self.assertEqual(sorted(saved), sorted(weights))  # /ema is laid out as /model
            for k in ema:
                ema[k] = decay * ema[k] + rest * weights[k]
                np.testing.assert_allclose(saved[k], ema[k], rtol=2e-6, atol=1e-7, err_msg=f"step {t}: {k}")
            self.assertTrue(any(not np.array_equal(saved[k], weights[k]) for k in saved))
        self.assertIn("running_var", " ".join(ema))

    def test_matches_the_average_of_the_trajectory_on_the_cpu(self):
        self.trajectory(BINARY, None, "cpu")

    def test_matches_the_average_of_the_trajectory_on_cuda(self):
        if GPU_VISIBLE < 1:
            self.skipTest("no GPU")
        self.trajectory(GPU_BINARY, GPU_ENV, "cuda")

    def test_validation_metrics_early_stopping_and_best(self):
        cfg = self.w.config(EMA_CNN, decay=0.5)
        rc, out, err = run([cfg, "--set", "train.early_stopping.metric=ema_val_loss", "--set",
                            "train.early_stopping.patience=100", "--set", "checkpoint.best=true"], np_=2)
        self.assertEqual(rc, 0, out + err)
        evals = [r for r in self.w.metrics() if "val_loss" in r]
        self.assertEqual(len(evals), 3)
        for r in evals:
            self.assertTrue(0 <= r["ema_val_acc"] <= 1 and r["ema_val_loss"] > 0, r)
        self.assertRegex(out, r"eval step \d+ epoch 1: val_loss [0-9.]+ val_acc [0-9.]+ \| ema_val_loss [0-9.]+ "
                              r"ema_val_acc [0-9.]+")
        best = min(evals, key=lambda r: r["ema_val_loss"])
        with h5py.File(self.w.file("ckpt/best.h5"), "r") as f:
            self.assertEqual(f["meta"].attrs["step"], best["step"])
            self.assertAlmostEqual(f["meta"].attrs["best_metric"], best["ema_val_loss"], places=5)
        # an EMA metric without the EMA is a config error naming the keys
        rc, out, err = run([cfg, "--set", "train.ema.decay=0", "--set", "train.early_stopping.metric=ema_val_acc"],
                           np_=2)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("train.early_stopping.metric ema_val_acc needs train.ema.decay > 0", errors(err)[0])

    def test_resume_restores_the_ema_bit_exactly(self):
        cfg = self.w.config(EMA_CNN, decay=0.9)
        rc, out, err = run([cfg, "--set", "train.max_steps=8"], np_=2)
        self.assertEqual(rc, 0, out + err)
        full = group(step_file(self.w, 8), "ema")
        for name in os.listdir(self.w.file("ckpt")):
            os.remove(self.w.file(f"ckpt/{name}"))
        rc, out, err = run([cfg, "--set", "train.max_steps=4"], np_=2)
        self.assertEqual(rc, 0, out + err)
        rc, out, err = run([cfg, "--set", "train.max_steps=8", "--resume", "auto"], np_=2)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("resuming at step 4", out)
        resumed = group(step_file(self.w, 8), "ema")
        for k in full:
            self.assertTrue(np.array_equal(full[k], resumed[k]), k)

    def test_export_the_ema_for_pytorch(self):
        cfg = self.w.config(EMA_CNN, decay=0.9)
        rc, out, err = run([cfg, "--set", "train.max_steps=3"])
        self.assertEqual(rc, 0, out + err)
        ckpt, pt = step_file(self.w, 3), self.w.file("ema.pt")
        p = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts/export_torch.py"), ckpt, pt, "--ema"],
                           capture_output=True, text=True, env=ENV)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        import torch
        state, ema = torch.load(pt), group(ckpt, "ema")
        for k in ema:
            self.assertTrue(np.array_equal(state[k].numpy(), ema[k]), k)
        # a checkpoint without an EMA says so
        rc, out, err = run([cfg, "--set", "train.max_steps=1", "--set", "train.ema.decay=0", "--set",
                            f"checkpoint.dir={self.w.file('plain')}"])
        self.assertEqual(rc, 0, out + err)
        p = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts/export_torch.py"),
                            self.w.file("plain/step-00000001.h5"), pt, "--ema"], capture_output=True, text=True,
                           env=ENV)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("has no /ema", p.stderr)


if __name__ == "__main__":
    unittest.main()
