"""Token models end to end on the CPU: ignore_index averaged over the global batch's real targets
(against PyTorch), --sample writing what the model learned, bit-exact resume of a transformer."""
import json
import os
import re
import sys
import unittest

import h5py
import numpy as np
import torch

from helpers import ROOT, Workdir, errors, params, run

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import ddp_model  # noqa: E402


GPT = """\
model:
  input: [8]
  layers:
    - embedding: {{vocab: 20, dim: 16}}
    - residual: {{body: [layernorm: {{}}, attention: {{heads: 2}}]}}
    - residual: {{body: [layernorm: {{}}, linear: {{out: 32}}, gelu: {{approximate: tanh}}, linear: {{out: 16}}]}}
    - layernorm: {{}}
    - linear: {{out: 20, bias: false, tie: "0"}}
  loss: {loss}
data: {{path: {dir}/tokens.h5, train: {{x: /train/tokens}}, val: {{x: /val/tokens}}, shuffle: false}}
train: {{epochs: {epochs}, global_batch_size: 8, seed: 4}}
optim: {{name: {optim}, lr: {lr}}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt, every_steps: 3}}
"""


def rule_rows(n, t=8, vocab=20, noise=0.0, seed=0):
    """(n, t+1) rows following next = 3 * token + 1 (mod vocab), a fraction `noise` at random."""
    rng = np.random.default_rng(seed)
    rows = np.zeros((n, t + 1), np.int32)
    for i in range(n):
        rows[i, 0] = rng.integers(vocab)
        for j in range(t):
            rows[i, j + 1] = (3 * rows[i, j] + 1) % vocab if rng.random() >= noise else rng.integers(vocab)
    return rows


class IgnoreIndex(unittest.TestCase):
    def test_padding_is_left_out_of_the_global_mean(self):
        """Rows padded with token 0 after a random length, ignore_index 0, 2 ranks, plain SGD: the
        losses, the validation loss and the parameters equal PyTorch's F.cross_entropy(ignore_index=0)
        over each global batch, from the same initial weights."""
        w = Workdir()
        try:
            rng = np.random.default_rng(1)
            rows = rule_rows(28, noise=0.3) % 19 + 1  # real tokens 1..19
            for r in rows:
                r[rng.integers(2, 10):] = 0  # padding, so each rank's share of targets differs
            with h5py.File(w.file("tokens.h5"), "w") as f:
                f["train/tokens"] = rows[:24].astype(np.uint8)
                f["val/tokens"] = rows[24:].astype(np.uint8)
            cfg = w.config(GPT, loss="{cross_entropy: {ignore_index: 0}}", optim="sgd", lr=0.5, epochs=1)
            torch.manual_seed(0)
            twin, loss_fn = ddp_model.build_from_yaml(cfg)
            ddp_model.save_h5(twin, w.file("init.h5"))
            rc, out, err = run([cfg, "--set", f"model.init_from={w.file('init.h5')}"], np_=2)
            self.assertEqual(rc, 0, out + err)
            opt = torch.optim.SGD(twin.parameters(), lr=0.5)
            expect = []
            for s in range(3):
                x, y = ddp_model.token_rows(rows[8 * s:8 * s + 8])
                opt.zero_grad()
                loss = loss_fn(twin(x), y)
                loss.backward()
                opt.step()
                expect.append(loss.item())
            got = [r["loss"] for r in w.metrics() if "loss" in r]
            np.testing.assert_allclose(got, expect, rtol=1e-5)
            with torch.no_grad():
                x, y = ddp_model.token_rows(rows[24:])
                val = loss_fn(twin(x), y).item()
            np.testing.assert_allclose([r["val_loss"] for r in w.metrics() if "val_loss" in r], [val], rtol=1e-5)
            mine = params(w.latest())
            for k, v in twin.state_dict().items():
                np.testing.assert_allclose(mine[k], v.numpy(), rtol=1e-4, atol=1e-6, err_msg=k)
        finally:
            w.cleanup()

    def test_validation_with_every_target_ignored_is_exit_2(self):
        w = Workdir()
        try:
            rows = rule_rows(12) % 19 + 1
            with h5py.File(w.file("tokens.h5"), "w") as f:
                f["train/tokens"] = rows[:8].astype(np.uint8)
                f["val/tokens"] = np.zeros((4, 9), np.uint8)  # all padding
            cfg = w.config(GPT, loss="{cross_entropy: {ignore_index: 0}}", optim="sgd", lr=0.5, epochs=1)
            rc, out, err = run([cfg], np_=2)
            self.assertEqual(rc, 2, out + err)
            self.assertIn("every target in dataset '/val/tokens' (data.val.x) is model.loss.ignore_index 0",
                          errors(err)[0])
            self.assertFalse(os.path.exists(w.file("ckpt")) and os.listdir(w.file("ckpt")))
        finally:
            w.cleanup()

    def test_ignore_index_needs_a_token_model(self):
        w = Workdir()
        try:
            w.dataset()
            cfg = w.config("""\
                model: {{input: [1, 6, 6], layers: [flatten, {{linear: {{out: 3}}}}],
                         loss: {{cross_entropy: {{ignore_index: 1}}}}}}
                data: {{path: {dir}/data.h5}}
                train: {{epochs: 1, global_batch_size: 4}}
                """)
            rc, out, err = run([cfg, "--dry-run"])
            self.assertEqual(rc, 2, out + err)
            self.assertIn("ignore_index is for token models", errors(err)[0])
        finally:
            w.cleanup()


class Sampling(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        """A model trained on the noiseless rule, once for the class."""
        cls.w = Workdir()
        with h5py.File(cls.w.file("tokens.h5"), "w") as f:
            f["train/tokens"] = rule_rows(64, seed=2)
            f["val/tokens"] = rule_rows(8, seed=3)
        cls.cfg = cls.w.config(GPT, loss="cross_entropy", optim="adamw", lr=0.01, epochs=40)
        rc, out, err = run([cls.cfg, "--set", "log.every_steps=100"], np_=2)
        assert rc == 0, out + err
        cls.ckpt = cls.w.latest()

    @classmethod
    def tearDownClass(cls):
        cls.w.cleanup()

    def sample(self, *extra, np_=1):
        rc, out, err = run([self.cfg, "--resume", self.ckpt, "--sample", "24"] + list(extra), np_=np_)
        self.assertEqual(rc, 0, out + err)
        return out.strip().splitlines()[-1]

    def test_greedy_sampling_follows_the_rule(self):
        ids = [int(t) for t in self.sample("--prompt", "5 16", "--temperature", "0").split()]
        self.assertEqual(len(ids), 24)
        seq = [5, 16] + ids
        follows = sum(b == (3 * a + 1) % 20 for a, b in zip(seq, seq[1:]))
        self.assertGreaterEqual(follows, 22, seq)  # past the context of 8 too

    def test_sampling_is_seeded_and_top_k_1_is_greedy(self):
        a = self.sample("--prompt", "3", "--temperature", "1.5", "--top-k", "0")
        self.assertEqual(a, self.sample("--prompt", "3", "--temperature", "1.5", "--top-k", "0", np_=2))
        # the stream comes from train.seed, which a resume keeps: model.init_from can change it
        rc, out, err = run([self.cfg, "--set", f"model.init_from={self.ckpt}", "--sample", "24", "--prompt", "3",
                            "--temperature", "1.5", "--top-k", "0"])
        self.assertEqual(rc, 0, out + err)
        self.assertEqual(a, out.strip().splitlines()[-1])
        rc, out, err = run([self.cfg, "--set", f"model.init_from={self.ckpt}", "--set", "train.seed=9", "--sample",
                            "24", "--prompt", "3", "--temperature", "1.5", "--top-k", "0"])
        self.assertEqual(rc, 0, out + err)
        self.assertNotEqual(a, out.strip().splitlines()[-1])
        self.assertEqual(self.sample("--prompt", "3", "--top-k", "1"), self.sample("--prompt", "3", "--temperature", "0"))

    def test_bad_prompts_exit_2(self):
        for prompt, needle in (("3 x", "token ids separated by spaces"), ("25", "token 25 is outside [0, 20)")):
            rc, out, err = run([self.cfg, "--resume", self.ckpt, "--sample", "4", "--prompt", prompt])
            self.assertEqual(rc, 2, out + err)
            self.assertIn(needle, errors(err)[0])
        rc, out, err = run([self.cfg, "--sample", "4", "--top-k", "-1"])
        self.assertEqual(rc, 2, out + err)
        self.assertIn("--top-k needs a number", errors(err)[0])


class Layers(unittest.TestCase):
    def test_layernorm_opening_a_residual_at_the_start(self):
        """The first layer's input has no gradient: a layernorm opening the model's first residual
        body computes only its own parameters' gradients (it once asserted for want of a dx)."""
        w = Workdir()
        try:
            w.dataset(shape=(6,), classes=3)
            cfg = w.config("""\
                model:
                  input: [6]
                  layers: [{{residual: {{body: [layernorm: {{}}, {{linear: {{out: 6}}}}]}}}}, {{linear: {{out: 3}}}}]
                data: {{path: {dir}/data.h5, scale: 0.004}}
                train: {{epochs: 1, global_batch_size: 8}}
                checkpoint: {{dir: {dir}/ckpt}}
                log: {{dir: {dir}/log}}
                """)
            for device in (["--device", "cpu"],):
                rc, out, err = run([cfg] + device, np_=2)
                self.assertEqual(rc, 0, out + err)
            p = params(w.latest())
            self.assertFalse(np.array_equal(p["0.body.0.weight"], np.ones(6, np.float32)))  # it trained
        finally:
            w.cleanup()

    def test_bad_token_layers_exit_2(self):
        w = Workdir()
        try:
            with h5py.File(w.file("tokens.h5"), "w") as f:
                f["train/tokens"] = rule_rows(8)
                f["val/tokens"] = rule_rows(8)
            cfg = w.config(GPT, loss="cross_entropy", optim="sgd", lr=0.1, epochs=1)
            cases = [
                (["--set", "model.layers=[{embedding: {vocab: 16777217, dim: 4}}]"], "vocab"),
                (["--set", "model.layers=[{linear: {out: 4}}, {embedding: {vocab: 20, dim: 4}}]"],
                 "only the first layer of model.layers may be an embedding"),
                (["--set", "model.layers=[{embedding: {vocab: 20, dim: 6}}, {attention: {heads: 4}}]"],
                 "width 6 does not divide into 4 heads"),
                (["--set", "model.layers=[{embedding: {vocab: 20, dim: 6}}, {linear: {out: 20, tie: '3'}}]"],
                 "tie '3' names no earlier embedding layer"),
                (["--set", "model.layers=[{embedding: {vocab: 20, dim: 6}}, {linear: {out: 19, tie: '0'}}]"],
                 "tied to 0's (20, 6) tok.weight"),
                (["--set", "model.layers=[{embedding: {vocab: 20, dim: 6}}, {batchnorm: {}}]"], "use layernorm"),
                (["--set", "data.train.x=/val/tokens", "--set", "model.layers=[{embedding: {vocab: 10, dim: 4}}, "
                  "{linear: {out: 10}}]"], "token outside [0, 10)"),
                (["--sample", "0"], "--sample needs a number in [1,"),
            ]
            for extra, needle in cases:
                rc, out, err = run([cfg] + extra)
                self.assertEqual(rc, 2, f"{extra}: {out + err}")
                self.assertIn(needle, errors(err)[0], extra)
        finally:
            w.cleanup()


class InitFrom(unittest.TestCase):
    def test_tensors_the_model_does_not_have_are_exit_2_unless_allowed(self):
        """model.init_from is strict, as PyTorch's load_state_dict: an untied model's checkpoint loaded
        into the tied config has a head weight (4.weight) that the tied head would silently drop, even
        though it differs from the embedding it stands in for."""
        w = Workdir()
        try:
            with h5py.File(w.file("tokens.h5"), "w") as f:
                f["train/tokens"] = rule_rows(16, seed=2)
                f["val/tokens"] = rule_rows(8, seed=3)
            tied = w.config(GPT, loss="cross_entropy", optim="sgd", lr=0.1, epochs=1)
            untied = w.config(GPT.replace('tie: "0"', "").replace("{dir}/ckpt", "{dir}/untied"), name="untied.yaml",
                              loss="cross_entropy", optim="sgd", lr=0.1, epochs=1)
            rc, out, err = run([untied], np_=1)
            self.assertEqual(rc, 0, out + err)
            src = w.latest("untied")
            with h5py.File(src, "r") as f:
                self.assertFalse(np.array_equal(f["model/4.weight"][...], f["model/0.tok.weight"][...]))
            rc, out, err = run([tied, "--set", f"model.init_from={src}"], np_=2)
            self.assertEqual(rc, 2, out + err)
            self.assertIn(f"{src}: model.init_from: 1 tensor in /model that this model does not have: '4.weight'",
                          errors(err)[0])
            rc, out, err = run([tied, "--set", f"model.init_from={src}", "--set", "model.init_from_ignore_extra=true"],
                               np_=2)
            self.assertEqual(rc, 0, out + err)
            # the model's own checkpoint loads as it is, without the key
            rc, out, err = run([tied, "--set", f"model.init_from={w.latest()}"], np_=1)
            self.assertEqual(rc, 0, out + err)
        finally:
            w.cleanup()


class Resume(unittest.TestCase):
    def test_transformer_resume_is_bit_exact(self):
        """6 AdamW steps straight, against 3, a stop, and 3 more from the checkpoint."""
        w = Workdir()
        try:
            with h5py.File(w.file("tokens.h5"), "w") as f:
                f["train/tokens"] = rule_rows(48, noise=0.2)
                f["val/tokens"] = rule_rows(8, noise=0.2, seed=5)
            cfg = w.config(GPT, loss="cross_entropy", optim="adamw", lr=0.01, epochs=1)
            rc, out, err = run([cfg, "--set", "data.shuffle=true", "--set", f"checkpoint.dir={w.file('a')}"], np_=2)
            self.assertEqual(rc, 0, out + err)
            rc, out, err = run([cfg, "--set", "data.shuffle=true", "--set", f"checkpoint.dir={w.file('b')}",
                                "--set", "train.max_steps=3"], np_=2)
            self.assertEqual(rc, 0, out + err)
            rc, out, err = run([cfg, "--set", "data.shuffle=true", "--set", f"checkpoint.dir={w.file('b')}",
                                "--resume", "auto"], np_=2)
            self.assertEqual(rc, 0, out + err)
            a, b = params(w.latest("a")), params(w.latest("b"))
            self.assertTrue(w.latest("a").endswith("step-00000006.h5"), w.latest("a"))
            for k in a:
                self.assertTrue(np.array_equal(a[k], b[k]), k)
        finally:
            w.cleanup()


class TokenStorage(unittest.TestCase):
    """Token files as uint16 (held as uint16), int32 (held as int32), as (N, T+1) rows or a flat stream,
    held in memory or read from the file per batch (data.cache none): the same training bit for bit,
    with ignore_index's counts and contiguous sharding's offsets into the stream; and a file left in
    the file costs a rank far less memory than its size."""

    def test_every_storage_trains_the_same(self):
        w = Workdir()
        try:
            rows = rule_rows(40, noise=0.3) % 19 + 1
            rng = np.random.default_rng(2)
            for r in rows:
                r[rng.integers(3, 10):] = 0  # padding: ignore_index 0 counts differ by row
            stream = rows.reshape(-1)  # a flat stream of the same tokens: windows of 8 cut across the padding
            for name, dtype in (("u16", np.uint16), ("i32", np.int32)):
                with h5py.File(w.file(f"rows-{name}.h5"), "w") as f:
                    f["train/tokens"] = rows[:32].astype(dtype)
                    f["val/tokens"] = rows[32:].astype(dtype)
                with h5py.File(w.file(f"stream-{name}.h5"), "w") as f:
                    f["train/tokens"] = stream[:290].astype(dtype)
                    f["val/tokens"] = stream[290:].astype(dtype)
            cfg = w.config(GPT, loss="{cross_entropy: {ignore_index: 0}}", optim="adamw", lr=0.01, epochs=2)
            for layout in ("rows", "stream"):
                for sharding in ("global", "contiguous"):
                    got = {}
                    for name in ("u16", "i32"):
                        for cache in ("memory", "none"):
                            out_dir = w.file(f"{layout}-{sharding}-{name}-{cache}")
                            rc, out, err = run([cfg, "--set", f"data.path={w.file(f'{layout}-{name}.h5')}", "--set",
                                                f"data.cache={cache}", "--set", f"data.sharding={sharding}", "--set",
                                                "data.shuffle=true", "--set", f"checkpoint.dir={out_dir}", "--set",
                                                f"log.dir={out_dir}"], np_=2)
                            self.assertEqual(rc, 0, out + err)
                            with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                                losses = [l for l in f if '"loss"' in l or '"val_loss"' in l]
                            got[name, cache] = (params(os.path.join(out_dir, open(os.path.join(out_dir, "latest")).read().strip())),
                                                [json.loads(l).get("loss", json.loads(l).get("val_loss")) for l in losses])
                    base = got["i32", "memory"]
                    for key, (p, losses) in got.items():
                        self.assertEqual(losses, base[1], f"{layout} {sharding} {key}")
                        for k in base[0]:
                            self.assertTrue(np.array_equal(p[k], base[0][k]), f"{layout} {sharding} {key} {k}")
        finally:
            w.cleanup()

    def test_a_token_file_left_in_the_file_is_not_held(self):
        """64 MiB of uint16 tokens (a flat stream of 128-token windows): with data.cache none a rank's
        measured memory stays under 24 MiB (the sampler's order of 262,143 windows takes 2 MiB of it);
        held in memory they take their size as uint16, not twice it as int32."""
        w = Workdir()
        try:
            n = 32 * 1024 * 1024
            with h5py.File(w.file("big.h5"), "w") as f:
                f.create_dataset("train/tokens", data=(np.arange(n) % 20).astype(np.uint16), chunks=(1 << 20,))
                f["val/tokens"] = rule_rows(8, t=128).astype(np.uint16)
            cfg = w.config(GPT.replace("input: [8]", "input: [128]"), loss="cross_entropy", optim="sgd", lr=0.1,
                           epochs=1)
            common = ["--set", f"data.path={w.file('big.h5')}", "--set", "train.max_steps=20", "--set",
                      "checkpoint.dir=", "--set", f"log.dir={w.file('log')}"]
            rc, out, err = run([cfg, "--set", "data.cache=none"] + common, np_=2, timeout=300)
            self.assertEqual(rc, 0, out + err)
            peak = float(re.search(r"memory: at most ([\d.]+) MiB per rank \(host RSS", out).group(1))
            self.assertLess(peak, 24, out)
            rc, out, err = run([cfg, "--dry-run", "--set", "data.cache=memory"] + common, np_=1)
            self.assertEqual(rc, 0, out + err)
            held = float(re.search(r"\+ data ([\d.]+)", out).group(1))
            self.assertAlmostEqual(held, (n + 8 * 129) * 2 / 1048576, delta=0.1, msg=out)
        finally:
            w.cleanup()


if __name__ == "__main__":
    unittest.main()
