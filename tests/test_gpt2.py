"""GPT-2 against the real thing: a small randomly initialised transformers.GPT2LMHeadModel (2 layers,
4 heads, 64 wide, vocab 300, context 32, no dropout), its state_dict imported by
scripts/import_gpt2.py (.bin and .safetensors), then
- the PyTorch twin (scripts/ddp_model.py, built from the layers import_gpt2.py prints) gives
  Hugging Face's logits: this checks the name and transpose mapping without ddp_train;
- export_torch.py --gpt2 gives back the same GPT2LMHeadModel state_dict (and a from_pretrained
  directory);
- ddp_train's --predict logits on T = 16 token rows equal Hugging Face's to 1e-4;
- 5 AdamW steps (lr 1e-3, weight decay 0.1 on the Conv1D matrices only: optim.no_decay [bias,
  norm, embedding]) at a global batch of 4, on 1 and on 2 ranks, give PyTorch's losses and
  parameters to 1e-4;
- configs/gpt2_124m.yaml is GPT-2 small: --dry-run counts 124,439,808 parameters;
- scripts/make_text_data.py (make text-data) cuts fortune files into (N, T+1) byte rows.

transformers comes from PyPI into build/pydeps (`make pydeps`, pinned in tests/requirements-hf.txt);
without it the tests that need it are skipped, naming the command. As in test_torch_oracle,
PyTorch's reference training runs in float64, and parameters after AdamW are compared per tensor
(relative L2 norm), since Adam's division by sqrt(v) amplifies rounding where a gradient nearly
cancels.
"""
import os
import subprocess
import sys
import unittest

import h5py
import numpy as np
import torch
import torch.nn.functional as F
import yaml

from helpers import ROOT, Workdir, run

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import ddp_model  # noqa: E402
import import_gpt2  # noqa: E402

PYDEPS = os.path.join(ROOT, "build", "pydeps")
sys.path.append(PYDEPS)  # after Debian's packages: only what Debian lacks comes from here
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    NO_HF = None
except ImportError as e:
    NO_HF = f"transformers is not installed ({e}): make pydeps"

torch.set_num_threads(1)
PY = "/usr/bin/python3"
V, T, D, H, L, P = 300, 16, 64, 4, 2, 32


def hf_model(seed=0):
    """A random GPT2LMHeadModel whose every tensor is non-trivial: Hugging Face initialises biases
    to 0 and layernorms to (1, 0), which would hide a mix-up of those tensors."""
    cfg = GPT2Config(vocab_size=V, n_positions=P, n_embd=D, n_layer=L, n_head=H, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", layer_norm_epsilon=1e-5)
    torch.manual_seed(seed)
    m = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.05)
            elif ".ln_" in name or "ln_f" in name:
                p.normal_(1, 0.1)
    m.eval()
    return m


def tokens(w, n_train=20, n_val=6, seed=1):
    """(N, T+1) int32 rows of random tokens in [0, V): /train/tokens and /val/tokens."""
    rng = np.random.default_rng(seed)
    path = w.file("tokens.h5")
    with h5py.File(path, "w") as f:
        f["train/tokens"] = rng.integers(0, V, (n_train, T + 1)).astype(np.int32)
        f["val/tokens"] = rng.integers(0, V, (n_val, T + 1)).astype(np.int32)
    return path


def import_model(w, src, name="init.h5", heads=H):
    """Runs import_gpt2.py; returns (the HDF5 path, the model section it printed). heads: None to
    take the count from the config.json beside SRC."""
    out = w.file(name)
    p = subprocess.run([PY, os.path.join(ROOT, "scripts", "import_gpt2.py"), src, out, "--seq-len", str(T)]
                       + (["--heads", str(heads)] if heads else []), capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise AssertionError(f"import_gpt2.py failed: {p.stdout}{p.stderr}")
    text = p.stdout[p.stdout.index("model:"):]
    return out, yaml.safe_load(text)["model"]


def h5_tensors(path, group="model"):
    with h5py.File(path, "r") as f:
        return {k: f[group][k][...] for k in f[group]}


def write_config(w, model, data, train, optim=None, sub=""):
    """sub/cfg.yaml, logging to sub/log and checkpointing to sub/ckpt."""
    os.makedirs(w.file(sub), exist_ok=True)
    cfg = {"model": model, "data": data, "train": train,
           "optim": optim or {"name": "sgd", "lr": 0.0},
           "log": {"dir": w.file(os.path.join(sub, "log")), "every_steps": 1},
           "checkpoint": {"dir": w.file(os.path.join(sub, "ckpt"))}}
    path = w.file(os.path.join(sub, "cfg.yaml"))
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def decays(hf_name):
    """GPT-2 fine-tuning's weight-decay groups: the Conv1D matrices only."""
    return hf_name.endswith(".weight") and any(s in hf_name for s in import_gpt2.CONV1D)


@unittest.skipIf(NO_HF, NO_HF)
class TwinAndImport(unittest.TestCase):
    """The mapping, in PyTorch alone: needs no ddp_train build."""

    def test_twin_gives_hugging_face_logits(self):
        w = Workdir()
        try:
            hf = hf_model()
            torch.save(hf.state_dict(), w.file("hf.bin"))
            init, model_cfg = import_model(w, w.file("hf.bin"))
            self.assertEqual(model_cfg["input"], [T])
            self.assertEqual(model_cfg["layers"][1]["repeat"]["times"], L)
            twin, loss_fn = ddp_model.build(model_cfg)
            self.assertTrue(ddp_model.is_token_model(model_cfg))
            ddp_model.load_h5(twin, init)
            # one stored tensor for the tied head, and PyTorch's parameter count
            self.assertEqual(sorted(twin.state_dict()), sorted(h5_tensors(init)))
            self.assertNotIn(f"{1 + 2 * L + 1}.weight", twin.state_dict())
            self.assertEqual(ddp_model.count_parameters(twin), sum(p.numel() for p in hf.parameters()))
            twin.eval()
            rows = np.random.default_rng(2).integers(0, V, (5, T + 1))
            x, y = ddp_model.token_rows(rows)
            for dtype in (torch.float32, torch.float64):
                with torch.no_grad():
                    ours = twin.to(dtype)(x)
                    theirs = hf.to(dtype)(x).logits
                tol = 1e-5 if dtype == torch.float32 else 1e-12
                np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=tol, atol=tol, err_msg=str(dtype))
                want = F.cross_entropy(theirs.reshape(-1, V), y.reshape(-1))
                self.assertAlmostEqual(loss_fn(ours, y).item(), want.item(), delta=tol * 10)
        finally:
            w.cleanup()

    def test_twin_fine_tuning_follows_hugging_face(self):
        """5 AdamW steps of the twin, with ddp_model.param_groups for optim.no_decay [bias, norm,
        embedding], follow GPT2LMHeadModel's with decay on the Conv1D matrices only (float64): the
        tied head's gradient is the sum of both uses, and the decay groups are GPT-2's."""
        w = Workdir()
        try:
            hf = hf_model(seed=4).double().train()
            torch.save(hf.state_dict(), w.file("hf.bin"))
            init, model_cfg = import_model(w, w.file("hf.bin"))
            twin, loss_fn = ddp_model.build(model_cfg)
            ddp_model.load_h5(twin, init)
            twin.double().train()
            groups = ddp_model.param_groups(twin, 0.1, ["bias", "norm", "embedding"])
            self.assertEqual(len(groups[0]["params"]), 4 * L)
            named = list(hf.named_parameters())
            opts = [torch.optim.AdamW(groups, lr=1e-3),
                    torch.optim.AdamW([{"params": [p for n, p in named if decays(n)], "weight_decay": 0.1},
                                       {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}],
                                      lr=1e-3)]
            x, y = ddp_model.token_rows(np.random.default_rng(5).integers(0, V, (20, T + 1)))
            for s in range(5):
                xb, yb = x[4 * s:4 * s + 4], y[4 * s:4 * s + 4]
                losses = []
                for opt, logits in ((opts[0], lambda: twin(xb)), (opts[1], lambda: hf(xb).logits)):
                    opt.zero_grad()
                    loss = loss_fn(logits(), yb)
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
                self.assertAlmostEqual(losses[0], losses[1], delta=1e-10)
            _, want = import_gpt2.convert({k.replace("transformer.", "", 1): v.detach().numpy()
                                           for k, v in hf.state_dict().items()})
            for k, v in twin.state_dict().items():  # want: rounded to float32 by convert()
                np.testing.assert_allclose(v.numpy(), want[k], rtol=1e-7, atol=1e-9, err_msg=k)
        finally:
            w.cleanup()

    def test_safetensors_and_bin_import_alike(self):
        w = Workdir()
        try:
            hf = hf_model(seed=3)
            torch.save(hf.state_dict(), w.file("hf.bin"))
            hf.save_pretrained(w.file("hfdir"), safe_serialization=True)
            self.assertTrue(os.path.exists(w.file("hfdir/model.safetensors")))
            a, cfg_a = import_model(w, w.file("hf.bin"), "a.h5")
            b, cfg_b = import_model(w, w.file("hfdir"), "b.h5", heads=None)  # config.json gives the heads
            self.assertEqual(cfg_a, cfg_b)
            ta, tb = h5_tensors(a), h5_tensors(b)
            self.assertEqual(sorted(ta), sorted(tb))
            for k in ta:
                np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
            # Conv1D (in, out) is stored transposed
            c_attn = hf.transformer.h[1].attn.c_attn.weight.detach().numpy()
            np.testing.assert_array_equal(ta["3.body.1.qkv.weight"], c_attn.T)
            self.assertEqual(ta["3.body.1.qkv.weight"].shape, (3 * D, D))
            # a GPT2Model file (the hub's gpt2 files: no "transformer." prefix, no lm_head)
            plain = {k[len("transformer."):]: v for k, v in hf.state_dict().items() if k.startswith("transformer.")}
            torch.save(plain, w.file("plain.bin"))
            c, _ = import_model(w, w.file("plain.bin"), "c.h5")
            tc = h5_tensors(c)
            for k in ta:
                np.testing.assert_array_equal(ta[k], tc[k], err_msg=k)
        finally:
            w.cleanup()

    def test_import_refuses_what_is_not_gpt2(self):
        w = Workdir()
        try:
            state = hf_model().state_dict()
            state["lm_head.weight"] = state["lm_head.weight"].clone() + 1  # untied
            torch.save(state, w.file("untied.bin"))
            p = subprocess.run([PY, os.path.join(ROOT, "scripts", "import_gpt2.py"), w.file("untied.bin"),
                                w.file("x.h5")], capture_output=True, text=True)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("untied", p.stderr)
            state = hf_model().state_dict()
            del state["transformer.h.1.mlp.c_fc.bias"]
            torch.save(state, w.file("partial.bin"))
            p = subprocess.run([PY, os.path.join(ROOT, "scripts", "import_gpt2.py"), w.file("partial.bin"),
                                w.file("x.h5")], capture_output=True, text=True)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("h.1.mlp.c_fc.bias", p.stderr)
            self.assertFalse(os.path.exists(w.file("x.h5")))
        finally:
            w.cleanup()

    def test_export_gives_back_the_hugging_face_state_dict(self):
        w = Workdir()
        try:
            hf = hf_model(seed=5)
            torch.save(hf.state_dict(), w.file("hf.bin"))
            init, _ = import_model(w, w.file("hf.bin"))
            script = os.path.join(ROOT, "scripts", "export_torch.py")
            p = subprocess.run([PY, script, init, w.file("back.bin"), "--gpt2"], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            back = torch.load(w.file("back.bin"))
            fresh = hf_model(seed=6)
            fresh.load_state_dict(back)  # strict: every key, every shape
            for k, v in hf.state_dict().items():
                self.assertTrue(torch.equal(fresh.state_dict()[k], v), k)
            # a directory with config.json: from_pretrained
            p = subprocess.run([PY, script, init, w.file("hfout") + "/", "--gpt2"], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            again = GPT2LMHeadModel.from_pretrained(w.file("hfout"))
            again.eval()
            x = torch.randint(0, V, (2, T))
            with torch.no_grad():
                np.testing.assert_allclose(again(x).logits.numpy(), hf(x).logits.numpy(), rtol=1e-6, atol=1e-6)
        finally:
            w.cleanup()


@unittest.skipIf(NO_HF, NO_HF)
class AgainstHuggingFace(unittest.TestCase):
    """ddp_train itself against GPT2LMHeadModel."""

    def test_predict_logits_equal_hugging_face(self):
        w = Workdir()
        try:
            hf = hf_model()
            torch.save(hf.state_dict(), w.file("hf.bin"))
            init, model_cfg = import_model(w, w.file("hf.bin"))
            data = tokens(w)
            cfg = write_config(w, dict(model_cfg, init_from=init),
                               {"path": data, "train": {"x": "/train/tokens"}, "val": {"x": "/val/tokens"}},
                               {"epochs": 1, "global_batch_size": 4})
            with h5py.File(data, "r") as f:
                x = torch.tensor(f["val/tokens"][...][:, :T].astype(np.int64))
            with torch.no_grad():
                theirs = hf(x).logits.numpy()
            for np_ in (1, 2):
                rc, out, err = run([cfg, "--predict", w.file(f"pred{np_}.h5")], np_=np_)
                self.assertEqual(rc, 0, out + err)
                with h5py.File(w.file(f"pred{np_}.h5"), "r") as f:
                    ours = f["logits"][...]
                self.assertEqual(ours.shape, (len(x), T * V))  # one row of T x V logits per sample
                np.testing.assert_allclose(ours.reshape(len(x), T, V), theirs, rtol=1e-4, atol=1e-4,
                                           err_msg=f"np {np_}")
        finally:
            w.cleanup()

    def test_adamw_fine_tuning_equals_pytorch_on_1_and_2_ranks(self):
        steps, batch, lr, wd = 5, 4, 1e-3, 0.1
        w = Workdir()
        try:
            hf = hf_model(seed=7)
            torch.save(hf.state_dict(), w.file("hf.bin"))
            init, model_cfg = import_model(w, w.file("hf.bin"))
            data = tokens(w, n_train=steps * batch)

            # PyTorch on GPT2LMHeadModel in float64, the same rows in file order
            with h5py.File(data, "r") as f:
                x, y = ddp_model.token_rows(f["train/tokens"][...])
            ref = hf.double().train()
            named = list(ref.named_parameters())  # the tied head once, as wte
            groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": wd},
                      {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
            self.assertEqual(len(groups[0]["params"]), 4 * L)
            opt = torch.optim.AdamW(groups, lr=lr)
            theirs = []
            for s in range(steps):
                opt.zero_grad()
                logits = ref(x[s * batch:(s + 1) * batch]).logits
                loss = F.cross_entropy(logits.reshape(-1, V), y[s * batch:(s + 1) * batch].reshape(-1))
                loss.backward()
                opt.step()
                theirs.append(loss.item())
            _, want = import_gpt2.convert({k.replace("transformer.", "", 1): v.detach().numpy()
                                           for k, v in ref.state_dict().items()})

            for np_ in (1, 2):
                sub = f"np{np_}"
                cfg = write_config(
                    w, dict(model_cfg, init_from=init),
                    {"path": data, "train": {"x": "/train/tokens"}, "val": {"x": ""}, "shuffle": False},
                    {"epochs": 1, "global_batch_size": batch, "max_steps": steps, "seed": 1},
                    {"name": "adamw", "lr": lr, "weight_decay": wd, "no_decay": ["bias", "norm", "embedding"],
                     "schedule": {"name": "constant"}}, sub=sub)
                rc, out, err = run([cfg], np_=np_, timeout=300)
                self.assertEqual(rc, 0, out + err)
                ours = [r["loss"] for r in w.metrics(f"{sub}/log") if "loss" in r]
                self.assertEqual(len(ours), steps, sub)
                np.testing.assert_allclose(ours, theirs, rtol=1e-4, err_msg=f"{sub}: losses")
                final = h5_tensors(w.latest(f"{sub}/ckpt"))
                self.assertEqual(sorted(final), sorted(want), sub)
                for name, t in want.items():
                    err = np.linalg.norm(final[name] - t) / max(np.linalg.norm(t), 1e-12)
                    self.assertLess(err, 1e-4, f"{sub}: {name}")
        finally:
            w.cleanup()


class Configs(unittest.TestCase):
    def test_gpt2_124m_is_gpt2_small(self):
        with open(os.path.join(ROOT, "configs", "gpt2_124m.yaml")) as f:
            model_cfg = yaml.safe_load(f)["model"]
        twin, _ = ddp_model.build(model_cfg)
        self.assertEqual(ddp_model.count_parameters(twin), 124_439_808)  # PyTorch's figure, tied head
        names = list(twin.state_dict())
        self.assertEqual(names[:2], ["0.tok.weight", "0.pos.weight"])
        self.assertEqual(names[-2:], ["25.weight", "25.bias"])
        self.assertEqual([n for _, n, _ in import_gpt2.name_map(12)], names)

    def test_gpt2_124m_dry_run_counts_its_parameters(self):
        # without its data (not in the repository): the model and its memory at 8 x 512 tokens
        rc, out, err = run([os.path.join(ROOT, "configs", "gpt2_124m.yaml"), "--dry-run"])
        self.assertEqual(rc, 2, out + err)  # its data is named, but not there
        self.assertIn("`--dry-run --set data.path=` shows the model without data", err)
        rc, out, err = run([os.path.join(ROOT, "configs", "gpt2_124m.yaml"), "--dry-run", "--set", "data.path="])
        self.assertEqual(rc, 0, out + err)
        self.assertIn("data: none (data.path is empty)", out)
        self.assertIn("total parameters: 124,439,808", out)
        self.assertRegex(out, r"memory per rank at 8 rows of 512 tokens: \d+\.\d MiB = parameters 474\.7 ")
        w = Workdir()
        try:
            with h5py.File(w.file("t.h5"), "w") as f:  # the config's data file is not in the repository
                f["train/tokens"] = np.zeros((4, 513), np.uint16)
                f["val/tokens"] = np.zeros((2, 513), np.uint16)
            rc, out, err = run([os.path.join(ROOT, "configs", "gpt2_124m.yaml"), "--dry-run",
                                "--set", f"data.path={w.file('t.h5')}"])
            self.assertEqual(rc, 0, out + err)
            self.assertIn("total parameters: 124,439,808", out)
        finally:
            w.cleanup()

    def test_gpt_tiny_dry_run_on_fortunes(self):
        data = os.path.join(ROOT, "data", "fortunes.h5")
        if not os.path.exists(data):
            self.skipTest("no data/fortunes.h5: make text-data")
        rc, out, err = run([os.path.join(ROOT, "configs", "gpt_tiny.yaml"), "--dry-run"])
        self.assertEqual(rc, 0, out + err)
        self.assertIn("total parameters: 842,496", out)

    def test_gpt_tiny_twin_builds(self):
        with open(os.path.join(ROOT, "configs", "gpt_tiny.yaml")) as f:
            model_cfg = yaml.safe_load(f)["model"]
        twin, loss_fn = ddp_model.build(model_cfg)
        x = torch.randint(0, 256, (2, 128))
        self.assertEqual(tuple(twin(x).shape), (2, 128, 256))
        self.assertLess(abs(loss_fn(twin(x), x).item() - np.log(256)), 0.5)  # GPT-2's small init


class TextData(unittest.TestCase):
    def test_fortune_files_become_byte_rows(self):
        w = Workdir()
        try:
            src = w.file("fortunes")
            os.makedirs(os.path.join(src, "off"))
            texts = {"a": [f"fortune a{i}: " + "x" * (60 + i * 7 % 50) for i in range(45)],
                     "b": [f"line one of b{i}\n\tline two" for i in range(30)]}
            for name, items in texts.items():
                with open(os.path.join(src, name), "w") as f:
                    f.write("".join(t + "\n%\n" for t in items))
                with open(os.path.join(src, name + ".dat"), "wb") as f:
                    f.write(b"\0" * 24)  # strfile's index: skipped
                os.symlink(name, os.path.join(src, name + ".u8"))  # Debian's links: skipped
            with open(os.path.join(src, "off", "c"), "w") as f:
                f.write("offensive\n%\n")  # subdirectories: skipped
            script = os.path.join(ROOT, "scripts", "make_text_data.py")
            for out in ("t1.h5", "t2.h5"):
                p = subprocess.run([PY, script, src, w.file(out)], capture_output=True, text=True)
                self.assertEqual(p.returncode, 0, p.stderr)
            with open(w.file("t1.h5"), "rb") as f1, open(w.file("t2.h5"), "rb") as f2:
                self.assertEqual(f1.read(), f2.read())  # deterministic to the byte
            # every 20th fortune of each file is validation: a19, a39 and b19
            val_items = [texts["a"][19], texts["a"][39], texts["b"][19]]
            train_items = [t for n in "ab" for i, t in enumerate(texts[n]) if i % 20 != 19]
            with h5py.File(w.file("t1.h5"), "r") as f:
                self.assertEqual(int(f.attrs["vocab"]), 256)
                self.assertEqual(int(f.attrs["seq_len"]), 128)
                for split, items in (("train", train_items), ("val", val_items)):
                    rows = f[f"{split}/tokens"][...]
                    self.assertEqual(rows.dtype, np.uint8)
                    stream = "".join(t + "\n%\n" for t in items).encode()
                    n = (len(stream) - 1) // 128
                    self.assertEqual(rows.shape, (n, 129), split)
                    for i in range(n):  # stride 128: each byte after the first is a target once
                        self.assertEqual(rows[i].tobytes(), stream[128 * i:128 * i + 129])
                self.assertNotIn(b"offensive", f["train/tokens"][...].tobytes())
        finally:
            w.cleanup()


if __name__ == "__main__":
    unittest.main()
