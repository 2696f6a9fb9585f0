"""Training end to end on the CPU: the loss falls and the model learns, N-rank equivalence
(np 1 against 2 and 3), synchronised batchnorm equivalence, and the metrics and model files."""
import os
import re
import unittest

import h5py
import numpy as np

from helpers import ROOT, TINY_CNN, Workdir, errors, run


def final_params(path):
    with h5py.File(path, "r") as f:
        return {k: f["model"][k][...] for k in f["model"]}


class Smoke(unittest.TestCase):
    def test_loss_falls_and_accuracy_rises(self):
        w = Workdir()
        try:
            w.dataset(n=96, n_val=48)
            cfg = w.config(TINY_CNN)
            rc, out, err = run([cfg, "--set", "train.epochs=15", "--set", "log.every_steps=12"], np_=2)
            self.assertEqual(rc, 0, out + err)
            m = w.metrics()
            steps = [r for r in m if "loss" in r]
            evals = [r for r in m if "val_acc" in r]
            self.assertEqual(len(evals), 15)  # one per epoch
            self.assertLess(steps[-1]["loss"], 0.5 * steps[0]["loss"])
            self.assertGreater(evals[-1]["val_acc"], 0.9)
            for key in ("step", "epoch", "loss", "lr", "samples_per_s", "step_ms", "data_ms", "comm_ms"):
                self.assertIn(key, steps[0])
            # losses are written to round-trip a float32 (%.9g), not to 6 digits that hide small differences
            with open(w.file("log/metrics.jsonl")) as f:
                digits = [len(re.sub(r"e.*|[-.]", "", v).lstrip("0"))
                          for v in re.findall(r'"(?:loss|val_loss)": ([-0-9.e+]+)', f.read())]
            self.assertEqual(max(digits), 9, digits)
            self.assertIn("best val_acc", out)
            self.assertEqual(out.count("done:"), 1)  # rank 0 only
            # where start-up's time went: its stages add up to the total (each rounded to 1 ms)
            m = re.search(r"^start-up: ([\d.]+) s \(MPI ([\d.]+), config and model ([\d.]+), data ([\d.]+), device "
                          r"([\d.]+), weights ([\d.]+), the rest ([\d.]+)\)$", out, re.M)
            self.assertIsNotNone(m, out)
            total, *parts = map(float, m.groups())
            self.assertAlmostEqual(sum(parts), total, delta=0.004)
            self.assertGreater(parts[0], 0)  # MPI's start always takes some time
            p = final_params(w.latest())
            self.assertEqual(p["0.weight"].shape, (4, 1, 3, 3))
            self.assertEqual(p["4.weight"].shape, (3, 36))
        finally:
            w.cleanup()

    def test_fashion_mnist_subset_reaches_80_percent(self):
        """4,000 Fashion-MNIST images, a small MLP, 5 epochs on 2 ranks: at least 80% on 1,000 test images."""
        w = Workdir()
        try:
            src = os.path.join(ROOT, "data", "fashion_mnist.h5")
            with h5py.File(src, "r") as f, h5py.File(w.file("fm.h5"), "w") as g:
                g["train/images"] = f["train/images_flat"][:4000]
                g["train/labels"] = f["train/labels"][:4000]
                g["test/images"] = f["test/images_flat"][:1000]
                g["test/labels"] = f["test/labels"][:1000]
            cfg = w.config("""\
                model:
                  input: [784]
                  layers: [{{linear: {{out: 128}}}}, relu, {{linear: {{out: 10}}}}]
                data: {{path: {dir}/fm.h5, scale: 0.00392156862745098}}
                train: {{epochs: 5, global_batch_size: 64, seed: 2}}
                optim: {{name: adamw, lr: 0.002, weight_decay: 0.01, schedule: {{name: cosine, warmup_steps: 10}}}}
                log: {{dir: {dir}/log, every_steps: 50}}
                checkpoint: {{dir: ""}}
                """)
            rc, out, err = run([cfg], np_=2)
            self.assertEqual(rc, 0, out + err)
            acc = [r["val_acc"] for r in w.metrics() if "val_acc" in r]
            self.assertEqual(len(acc), 5)
            self.assertGreater(acc[-1], 0.80)
        finally:
            w.cleanup()

    def test_max_steps_grad_accum_and_early_stopping(self):
        w = Workdir()
        try:
            w.dataset(n=64)
            cfg = w.config(TINY_CNN)
            rc, out, err = run([cfg, "--set", "train.max_steps=3", "--set", "train.grad_accum=2"])
            self.assertEqual(rc, 0, out + err)
            self.assertEqual(max(r["step"] for r in w.metrics() if "loss" in r), 3)
            self.assertIn("global batch 16", out)
            rc, out, err = run([cfg, "--set", "train.epochs=30", "--set", "optim.lr=0",
                                "--set", "train.early_stopping={metric: val_loss, patience: 2}"])
            self.assertEqual(rc, 0, out + err)
            self.assertIn("early stopping: val_loss has not improved for 2 evaluations", out)
            self.assertEqual(len([r for r in w.metrics() if "val_loss" in r]), 3)
        finally:
            w.cleanup()

    def test_nan_in_the_inputs_is_named_as_the_data(self):
        # a NaN in row 17 of float32 images: step 3 (rows 16-23 in file order) fails on rank 0, whose
        # share holds it; the message says it was the data, not the learning rate, and names the row
        w = Workdir()
        try:
            data = w.dataset(n=64, dtype=np.float32)
            with h5py.File(data, "a") as f:
                f["train/images"][17, 0, 2, 3] = np.nan
            cfg = w.config(TINY_CNN)
            for cache in ("memory", "none", "device"):
                rc, out, err = run([cfg, "--set", "data.shuffle=false", "--set", f"data.cache={cache}"], np_=2)
                self.assertEqual(rc, 4, out + err)
                line = errors(err)[0]
                self.assertIn("on rank 0 (1 of 2 ranks failed)", line)
                self.assertIn(f"at step 3 (epoch 1), and this rank's inputs of the step are not finite: {data}: "
                              "'/train/images'[17] holds a NaN; it is the data, not the learning rate", line)
                self.assertNotIn("optim.lr", line)
        finally:
            w.cleanup()

    def test_nan_loss_exits_4(self):
        w = Workdir()
        try:
            w.dataset(n=64)
            cfg = w.config(TINY_CNN)
            rc, out, err = run([cfg, "--set", "optim.lr=1e30"], np_=2)
            self.assertEqual(rc, 4, out + err)
            self.assertRegex(errors(err)[0], "loss became (NaN|infinite)|non-finite gradient")
        finally:
            w.cleanup()



class Validation(unittest.TestCase):
    """A validation split that cannot give a metric is refused at start-up, and the metric's name
    follows the loss: no val_mse 0 from an empty split picking best checkpoints."""

    def setUp(self):
        self.w = Workdir()

    def tearDown(self):
        self.w.cleanup()

    def test_an_empty_validation_split_is_exit_2_before_training(self):
        with h5py.File(self.w.dataset(n=16), "r+") as f:
            for name, shape, dtype in (("test/images", (0, 1, 6, 6), np.uint8), ("test/labels", (0,), np.int64)):
                del f[name]
                f.create_dataset(name, shape=shape, dtype=dtype)
        cfg = self.w.config(TINY_CNN)
        for extra in ([], ["--dry-run"]):
            rc, out, err = run([cfg] + extra, np_=2)
            self.assertEqual(rc, 2, out + err)
            self.assertIn("dataset '/test/images' (data.val.x) has no rows; leave data.val.x empty to train without "
                          "validation", errors(err)[0])
            self.assertNotIn("step 1", out)
        rc, out, err = run([cfg, "--set", "data.val.x="], np_=2)
        self.assertEqual(rc, 0, out + err)
        self.assertFalse([r for r in self.w.metrics() if "val_loss" in r])

    def test_metrics_of_an_mse_model_are_losses(self):
        self.w.dataset(n=16, n_val=8, targets=3)
        cfg = self.w.config(TINY_CNN.replace("data:", "  loss: mse\ndata:"))
        rc, out, err = run([cfg, "--set", "checkpoint.best=true"], np_=2)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("val_mse", out)
        evals = [r for r in self.w.metrics() if "val_loss" in r]
        self.assertEqual(len(evals), 2)
        for r in evals:
            self.assertNotIn("val_acc", r)
            self.assertGreater(r["val_loss"], 0)
        rc, out, err = run([cfg, "--set", "train.early_stopping.metric=val_acc", "--dry-run"])
        self.assertEqual(rc, 2, out + err)
        self.assertIn("train.early_stopping.metric val_acc: an accuracy needs a cross_entropy loss", errors(err)[0])

    def test_best_and_early_stopping_need_a_validation_split(self):
        self.w.dataset(n=16)
        cfg = self.w.config(TINY_CNN)
        for key, name in (("checkpoint.best=true", "checkpoint.best"),
                          ("train.early_stopping.metric=val_loss", "train.early_stopping.metric")):
            rc, out, err = run([cfg, "--set", "data.val.x=", "--set", key])
            self.assertEqual(rc, 2, out + err)
            self.assertIn(f"{name} needs a validation split: data.val.x is empty", errors(err)[0])


class BackgroundCache(unittest.TestCase):
    """The training images are read into memory by the loader's thread after the first batch, which it
    reads row by row, so the first step never waits for the whole dataset. A corrupt chunk in the middle
    of the images (neither the first nor the last row, which data_open's probe reads) therefore ends the
    run after step 1 trained, with exit 2 naming the file and the dataset, on both ranks at the same step."""

    def test_a_corrupt_chunk_is_found_behind_the_first_step(self):
        w = Workdir()
        try:
            data = w.dataset(n=400)
            w.corrupt_chunk(data, 150)
            cfg = w.config(TINY_CNN)
            rc, out, err = run([cfg, "--set", "data.shuffle=false"], np_=2)
            self.assertEqual(rc, 2, out + err)
            lines = errors(err)
            self.assertTrue(lines, err)
            for line in lines:
                self.assertIn(f"{data}: cannot read '/train/images'[0:400] (corrupt or unreadable file?)", line)
            steps = [r["step"] for r in w.metrics() if "loss" in r]
            self.assertEqual(steps, [1], out + err)
        finally:
            w.cleanup()

EQUIV = """\
model:
  input: [{channels}, 5, 5]
  layers:
    - conv2d: {{out: {width}, kernel: 3, pad: 1}}
    - {act}: {{}}
    - avgpool: {{kernel: 2}}
    - flatten: {{}}
    - linear: {{out: 8}}
    - {norm}
    - tanh: {{}}
    - linear: {{out: 4}}
  loss: {{cross_entropy: {{label_smoothing: 0.05}}}}
data:
  path: {dir}/data.h5
  scale: 0.00392156862745098
train:
  epochs: 3
  global_batch_size: 12
  seed: 5
  clip_grad_norm: 5.0
optim: {{name: {optim}, lr: 0.05, momentum: 0.9, nesterov: true, weight_decay: 0.001,
        schedule: {{name: onecycle, pct_start: 0.3}}}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt}}
dist: {{bucket_mb: 0.0005}}
"""


class Equivalence(unittest.TestCase):
    """With train.global_batch_size, world sizes differ only in the order of float sums."""

    def compare(self, norm, optim="sgd", act="relu", sharding="global", channels=2, width=3):
        w = Workdir()
        try:
            w.dataset(n=50, shape=(channels, 5, 5), classes=4)  # 50 rows: the last global batch is partial
            cfg = w.config(EQUIV, norm=norm, optim=optim, act=act, channels=channels, width=width)
            runs = {}
            for np_ in (1, 2, 3):
                rc, out, err = run([cfg, "--set", f"data.sharding={sharding}"], np_=np_)
                self.assertEqual(rc, 0, out + err)
                losses = [r["loss"] for r in w.metrics() if "loss" in r]
                self.assertEqual(len(losses), 15)
                runs[np_] = (losses, final_params(w.latest()))
            ref_losses, ref = runs[1]
            for np_ in (2, 3):
                losses, params = runs[np_]
                np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"losses, np {np_}")
                for k in ref:
                    np.testing.assert_allclose(params[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=f"{k}, np {np_}")
            # and training did move the parameters
            self.assertGreater(np.abs(ref["0.weight"]).sum(), 0)
        finally:
            w.cleanup()

    def test_np1_np2_np3_equal(self):
        self.compare("relu: {}")

    def test_adamw_gelu_equal(self):
        self.compare("sigmoid: {}", optim="adamw", act="gelu")

    def test_sync_batchnorm_equal(self):
        self.compare("batchnorm: {sync: true}")

    def test_winograd_convolution_equal(self):
        # 16 channels in and out: oneDNN's Winograd on AVX-512 CPUs (train.conv_algo auto)
        self.compare("batchnorm: {sync: true}", channels=16, width=16)


# A two-block pre-LN GPT over 8 tokens (vocabulary 20), its head tied to the embedding.
EQUIV_GPT = """\
model:
  input: [8]
  layers:
    - embedding: {{vocab: 20, dim: 16}}
    - repeat:
        times: 2
        layers:
          - residual: {{body: [layernorm: {{}}, attention: {{heads: 2}}]}}
          - residual: {{body: [layernorm: {{}}, linear: {{out: 32}}, gelu: {{approximate: tanh}}, linear: {{out: 16}}]}}
    - layernorm: {{}}
    - linear: {{out: 20, bias: false, tie: "0"}}
data: {{path: {dir}/tokens.h5, train: {{x: {x}}}, val: {{x: /val/tokens}}}}
train: {{epochs: 2, global_batch_size: 12, seed: 3, clip_grad_norm: 1.0}}
optim: {{name: {optim}, lr: 0.01, momentum: 0.9, weight_decay: 0.01, no_decay: [bias, norm, embedding],
        schedule: {{name: cosine, warmup_steps: 2}}}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt}}
dist: {{bucket_mb: 0.002}}
"""


def token_dataset(w, n=50, t=8, vocab=20, seed=0):
    """(n, t+1) windows and the same tokens as a flat stream, plus 10 validation windows: a noisy
    rule (next = 3 * token + 1 mod vocab) a model can learn."""
    rng = np.random.default_rng(seed)
    stream = [int(rng.integers(vocab))]
    for _ in range(n * t + 10 * t + 1):
        stream.append((3 * stream[-1] + 1) % vocab if rng.random() < 0.8 else int(rng.integers(vocab)))
    stream = np.array(stream, dtype=np.int32)
    rows = np.stack([stream[i * t:i * t + t + 1] for i in range(n)])
    with h5py.File(w.file("tokens.h5"), "w") as f:
        f["train/tokens"] = rows.astype(np.uint16)
        f["train/stream"] = stream[:n * t + 1]
        f["val/tokens"] = np.stack([stream[(n + i) * t:(n + i) * t + t + 1] for i in range(10)])
    return rows


class TransformerEquivalence(unittest.TestCase):
    """A transformer trains to the same parameters on 1, 2 and 3 ranks, from (N, T+1) windows or
    the flat token stream they were cut from."""

    def compare(self, optim, x):
        w = Workdir()
        try:
            token_dataset(w)  # 50 windows: the last global batch of each epoch is partial
            cfg = w.config(EQUIV_GPT, optim=optim, x=x)
            runs = {}
            for np_ in (1, 2, 3):
                rc, out, err = run([cfg], np_=np_)
                self.assertEqual(rc, 0, out + err)
                losses = [r["loss"] for r in w.metrics() if "loss" in r]
                self.assertEqual(len(losses), 10)
                runs[np_] = (losses, final_params(w.latest()), [r["val_loss"] for r in w.metrics() if "val_loss" in r])
            ref_losses, ref, ref_val = runs[1]
            self.assertNotIn("6.weight", ref)  # the tied head stores no weight of its own
            for np_ in (2, 3):
                losses, params, val = runs[np_]
                np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"losses, np {np_}")
                np.testing.assert_allclose(val, ref_val, rtol=1e-5, err_msg=f"val_loss, np {np_}")
                for k in ref:
                    a, b = params[k], ref[k]
                    if k.endswith("qkv.bias") and optim == "adamw":
                        # the key bias adds q.b to a whole row of scores, which softmax ignores: its
                        # gradient is 0 up to rounding, which AdamW scales up to lr-sized steps
                        a, b = np.delete(a, np.s_[16:32]), np.delete(b, np.s_[16:32])
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"{k}, np {np_}")
            self.assertLess(ref_losses[-1], ref_losses[0])
            return ref_losses
        finally:
            w.cleanup()

    def test_sgd_windows(self):
        self.compare("sgd", "/train/tokens")

    def test_adamw_stream_equals_windows(self):
        """The stream's windows are the rows of /train/tokens: the same run, to the last bit."""
        self.assertEqual(self.compare("adamw", "/train/stream"), self.compare("adamw", "/train/tokens"))


if __name__ == "__main__":
    unittest.main()
