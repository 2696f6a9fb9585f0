"""Knowledge distillation (the distill section) against a PyTorch twin written here: a frozen
teacher in evaluation mode (its own input normalisation, running batchnorm statistics, no dropout)
whose logits are mixed into the loss as

    alpha * T^2 * F.kl_div(F.log_softmax(s / T), F.softmax(t / T), reduction="batchmean")
        + (1 - alpha) * F.cross_entropy(s, y)

(or alpha * F.mse_loss(s, t) for distill.loss mse), per token for a token model with ignore_index's
positions left out of both terms. PyTorch runs in float64; ddp_train's float32 losses and
parameters must be within 1e-5 relative after 5 steps, with SGD and AdamW, on 1 and 2 ranks. Also:
the teacher's file is never written, the CUDA path (the stand-in, CUDA graphs on) equals the CPU,
a resumed run is bit-exact, shapes that do not fit are exit 2 naming both configs, and --dry-run
and /status show the teacher."""
import hashlib
import json
import os
import re
import sys
import time
import unittest

import h5py
import numpy as np
import torch
import torch.nn.functional as F
import yaml

import helpers
from helpers import ROOT, Workdir, errors, params, run

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import ddp_model  # noqa: E402

torch.set_num_threads(1)

# The teacher: batchnorm (running statistics set far from 0 and 1, so evaluation mode shows) and
# dropout (which evaluation mode leaves out); the student: an MLP of a third of its width.
IMAGE_TEACHER = {"input": [1, 6, 6],
                 "layers": [{"conv2d": {"out": 4, "kernel": 3, "pad": 1}}, {"batchnorm": {}}, {"relu": {}},
                            {"dropout": {"p": 0.3}}, {"flatten": {}}, {"linear": {"out": 3}}]}
IMAGE_STUDENT = {"input": [1, 6, 6],
                 "layers": [{"flatten": {}}, {"linear": {"out": 12}}, {"relu": {}}, {"linear": {"out": 3}}]}
TOKEN_TEACHER = {"input": [8],
                 "layers": [{"embedding": {"vocab": 20, "dim": 16}},
                            {"residual": {"body": [{"layernorm": {}}, {"attention": {"heads": 2}}]}},
                            {"residual": {"body": [{"layernorm": {}}, {"linear": {"out": 32}},
                                                   {"gelu": {"approximate": "tanh"}}, {"dropout": {"p": 0.5}},
                                                   {"linear": {"out": 16}}]}},
                            {"residual": {"body": [{"layernorm": {}}, {"attention": {"heads": 2}}]}},
                            {"layernorm": {}}, {"linear": {"out": 20, "bias": False, "tie": "0"}}]}
TOKEN_STUDENT = {"input": [8],
                 "layers": [{"embedding": {"vocab": 20, "dim": 8}},
                            {"residual": {"body": [{"layernorm": {}}, {"attention": {"heads": 2}}]}},
                            {"layernorm": {}}, {"linear": {"out": 20}}],
                 "loss": {"cross_entropy": {"ignore_index": 0}}}
STEPS, BATCH = 5, 8


def token_data(path):
    """Rows of 9 tokens following next = 3 token + 1 (mod 19) + 1, padded with 0 after a random
    length, so that each rank's share of real targets differs."""
    rng = np.random.default_rng(3)
    rows = np.zeros((STEPS * BATCH + 8, 9), np.int64)
    for r in rows:
        r[0] = rng.integers(1, 20)
        for j in range(8):
            r[j + 1] = (3 * r[j] + 1) % 19 + 1 if rng.random() > 0.3 else rng.integers(1, 20)
        r[rng.integers(3, 10):] = 0
    with h5py.File(path, "w") as f:
        f["train/tokens"] = rows[:STEPS * BATCH].astype(np.uint8)
        f["val/tokens"] = rows[STEPS * BATCH:].astype(np.uint8)
    return rows


def file_digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Case:
    """A teacher (weights written from a PyTorch twin), a student (initial weights likewise) and
    the data, in a work directory."""

    def __init__(self, w, token, loss="kl", temperature=3.0, alpha=0.7, attention="auto"):
        self.w, self.token = w, token
        self.kind, self.temperature, self.alpha = loss, temperature, alpha
        torch.manual_seed(1)
        self.teacher, _ = ddp_model.build(TOKEN_TEACHER if token else IMAGE_TEACHER)
        with torch.no_grad():  # a trained-looking teacher: larger weights, batchnorm statistics of its own
            for name, p in self.teacher.state_dict().items():
                if name.endswith("running_mean"):
                    p.copy_(torch.tensor([0.3, -0.2, 0.1, 0.5]))
                elif name.endswith("running_var"):
                    p.copy_(torch.tensor([0.5, 2.0, 1.5, 0.8]))
                elif p.dtype.is_floating_point and not name.endswith("num_batches_tracked"):
                    p.mul_(3.0)
        ddp_model.save_h5(self.teacher, w.file("teacher.h5"))
        self.student, self.own_loss = ddp_model.build(TOKEN_STUDENT if token else IMAGE_STUDENT)
        ddp_model.save_h5(self.student, w.file("init.h5"))
        if token:
            self.rows = token_data(w.file("data.h5"))
            data = {"path": w.file("data.h5"), "train": {"x": "/train/tokens"}, "val": {"x": "/val/tokens"}}
            teacher_data = {}
        else:
            path = w.dataset(n=STEPS * BATCH, shape=(1, 6, 6), classes=3, n_val=8)
            data = {"path": path, "scale": 1 / 255}
            teacher_data = {"scale": 1 / 255, "mean": [0.4], "std": [0.3]}  # the teacher's own normalisation
        # the teacher's config: its model and input normalisation only, no train section
        with open(w.file("teacher.yaml"), "w") as f:
            yaml.safe_dump({"model": dict(TOKEN_TEACHER if token else IMAGE_TEACHER, attention=attention),
                            "data": teacher_data}, f)
        self.cfg = {
            "model": dict(TOKEN_STUDENT if token else IMAGE_STUDENT, init_from=w.file("init.h5"), attention=attention),
            "data": dict(data, shuffle=False),
            "train": {"epochs": 1, "global_batch_size": BATCH, "seed": 3},
            "distill": {"teacher": w.file("teacher.yaml"), "weights": w.file("teacher.h5"),
                        "temperature": temperature, "alpha": alpha, "loss": loss},
            "log": {"dir": w.file("log"), "every_steps": 1},
            "checkpoint": {"dir": w.file("ckpt")},
        }

    def write(self, name="student.yaml", plain=False, **sections):
        """The student's config with sections updated; plain: without the distill section."""
        cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in self.cfg.items() if not (plain and k == "distill")}
        for k, v in sections.items():
            cfg[k] = dict(cfg.get(k, {}), **v)
        path = self.w.file(name)
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        return path

    def batches(self):
        """(x, y) of each step, as PyTorch's twin sees them (float64)."""
        if self.token:
            for s in range(STEPS):
                yield ddp_model.token_rows(self.rows[BATCH * s:BATCH * (s + 1)])
            return
        with h5py.File(self.cfg["data"]["path"], "r") as f:
            x = torch.tensor(f["train/images"][...], dtype=torch.float64) / 255
            y = torch.tensor(f["train/labels"][...].astype(np.int64))
        for s in range(STEPS):
            yield x[BATCH * s:BATCH * (s + 1)], y[BATCH * s:BATCH * (s + 1)]

    def teacher_logits(self, x):
        self.teacher.eval()
        if not self.token:
            x = (x - 0.4) / 0.3
        with torch.no_grad():
            return self.teacher(x)

    def loss(self, s, t, y):
        """The twin's loss: PyTorch's kl_div (batchmean) or mse_loss, mixed with the model's own."""
        own = self.own_loss(s, y)
        if self.token:  # per token, the padding (ignore_index 0) left out of both terms
            keep = (y != 0).reshape(-1)
            s, t = s.reshape(-1, s.shape[-1])[keep], t.reshape(-1, t.shape[-1])[keep]
        T = self.temperature
        if self.kind == "kl":
            d = F.kl_div(F.log_softmax(s / T, dim=-1), F.softmax(t / T, dim=-1), reduction="batchmean") * T * T
        else:
            d = F.mse_loss(s, t)
        return self.alpha * d + (1 - self.alpha) * own

    def twin(self, optim):
        """PyTorch's losses and final state_dict, float64."""
        self.teacher.double()
        self.student.double()
        if optim["name"] == "sgd":
            opt = torch.optim.SGD(self.student.parameters(), lr=optim["lr"], momentum=optim["momentum"])
        else:
            opt = torch.optim.AdamW(self.student.parameters(), lr=optim["lr"], weight_decay=optim["weight_decay"])
        losses = []
        self.student.train()
        for x, y in self.batches():
            t = self.teacher_logits(x)
            opt.zero_grad()
            loss = self.loss(self.student(x), t, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, {k: v.numpy() for k, v in self.student.state_dict().items()}


OPTIMS = {"sgd": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
          "adamw": {"name": "adamw", "lr": 0.01, "weight_decay": 0.01}}


class Twin(unittest.TestCase):
    def compare(self, token, optim, np_, loss="kl", attention="auto"):
        w = Workdir()
        try:
            case = Case(w, token, loss=loss, attention=attention)
            before = file_digest(w.file("teacher.h5"))
            rc, out, err = run([case.write(optim=OPTIMS[optim])], np_=np_, timeout=300)
            self.assertEqual(rc, 0, out + err)
            self.assertIn("distill: teacher", out)
            self.assertEqual(file_digest(w.file("teacher.h5")), before, "the teacher's file was written")
            ours = [r["loss"] for r in w.metrics() if "loss" in r]
            theirs, state = case.twin(OPTIMS[optim])
            self.assertEqual(len(ours), STEPS)
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, err_msg="losses")
            final = params(w.latest())
            for name, want in state.items():
                got = final[name]
                if optim == "adamw" and name.endswith("qkv.bias"):
                    # the keys' bias adds the same q.b to every score of a row, which softmax ignores: its
                    # gradient is 0 but for rounding, and Adam scales rounding up to steps of lr (float64
                    # PyTorch's too); the queries' and values' biases are compared
                    c = want.shape[0] // 3
                    got, want = np.r_[got[:c], got[2 * c:]], np.r_[want[:c], want[2 * c:]]
                err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12)
                self.assertLess(err, 1e-5, f"{name}: relative error {err:.3g}")
            # the checkpoint holds the student only
            with h5py.File(w.latest(), "r") as f:
                self.assertEqual(sorted(f["model"]), sorted(state))
        finally:
            w.cleanup()

    def test_image_sgd_1_rank(self):
        self.compare(False, "sgd", 1)

    def test_image_sgd_2_ranks(self):
        self.compare(False, "sgd", 2)

    def test_image_adamw_2_ranks(self):
        self.compare(False, "adamw", 2)

    def test_image_adamw_1_rank_mse(self):
        self.compare(False, "adamw", 1, loss="mse")

    def test_token_ignore_index_sgd_2_ranks(self):
        self.compare(True, "sgd", 2)

    def test_token_ignore_index_adamw_1_rank(self):
        self.compare(True, "adamw", 1)

    def test_token_fused_attention_sgd_2_ranks(self):
        """model.attention fused on the CPU (auto picks materialized there), student and teacher."""
        self.compare(True, "sgd", 2, attention="fused")

    def test_token_fused_attention_adamw_1_rank(self):
        self.compare(True, "adamw", 1, attention="fused")


class Runs(unittest.TestCase):
    def test_resume_is_bit_exact(self):
        """10 steps straight, against 4, a stop, and 6 more from the checkpoint."""
        w = Workdir()
        try:
            case = Case(w, False)
            cfg = case.write(optim=OPTIMS["adamw"], train={"epochs": 2}, data={"shuffle": True})
            rc, out, err = run([cfg, "--set", f"checkpoint.dir={w.file('a')}"], np_=2)
            self.assertEqual(rc, 0, out + err)
            rc, out, err = run([cfg, "--set", f"checkpoint.dir={w.file('b')}", "--set", "train.max_steps=4"], np_=2)
            self.assertEqual(rc, 0, out + err)
            rc, out, err = run([cfg, "--set", f"checkpoint.dir={w.file('b')}", "--resume", "auto"], np_=2)
            self.assertEqual(rc, 0, out + err)
            self.assertTrue(w.latest("a").endswith("step-00000010.h5"), w.latest("a"))
            a, b = params(w.latest("a")), params(w.latest("b"))
            for k in a:
                self.assertTrue(np.array_equal(a[k], b[k]), k)
        finally:
            w.cleanup()

    def test_distillation_changes_the_run(self):
        """alpha 0 is the plain run bit for bit (the teacher's term weighs nothing); alpha 0.7 is not."""
        w = Workdir()
        try:
            case = Case(w, False)
            rc, out, err = run([case.write("plain.yaml", plain=True, checkpoint={"dir": w.file("p")})])
            self.assertEqual(rc, 0, out + err)
            for alpha, sub in ((0.0, "a0"), (0.7, "a7")):
                rc, out, err = run([case.write(), "--set", f"distill.alpha={alpha}", "--set",
                                    f"checkpoint.dir={w.file(sub)}"])
                self.assertEqual(rc, 0, out + err)
            p, a0, a7 = params(w.latest("p")), params(w.latest("a0")), params(w.latest("a7"))
            for k in p:
                self.assertTrue(np.array_equal(p[k], a0[k]), k)
            self.assertFalse(all(np.array_equal(p[k], a7[k]) for k in p))
        finally:
            w.cleanup()

    def test_shapes_that_do_not_fit_are_exit_2(self):
        w = Workdir()
        try:
            case = Case(w, False)
            student = case.write()
            wide = dict(IMAGE_TEACHER, layers=IMAGE_TEACHER["layers"][:-1] + [{"linear": {"out": 4}}])
            with open(w.file("teacher.yaml"), "w") as f:
                yaml.safe_dump({"model": wide}, f)
            rc, out, err = run([student], np_=2)
            self.assertEqual(rc, 2, out + err)
            msg = errors(err)
            self.assertEqual(len(msg), 1, err)
            for part in (w.file("teacher.yaml"), student, "4 outputs", "3 at layer '3' (linear",
                         "layer '5' (linear"):
                self.assertIn(part, msg[0])
            small = dict(IMAGE_TEACHER, input=[1, 5, 5])
            with open(w.file("teacher.yaml"), "w") as f:
                yaml.safe_dump({"model": small}, f)
            rc, out, err = run([student, "--dry-run"], np_=1)
            self.assertEqual(rc, 2, out + err)
            self.assertIn("takes (1, 5, 5) at layer '0' (conv2d", errors(err)[0])
            self.assertIn("takes (1, 6, 6) at layer '0' (flatten", errors(err)[0])
            # the teacher's weights must be its model's
            with open(w.file("teacher.yaml"), "w") as f:
                yaml.safe_dump({"model": dict(IMAGE_TEACHER, layers=IMAGE_TEACHER["layers"][:-1] + [
                    {"linear": {"out": 3, "bias": False}}])}, f)
            rc, out, err = run([student], np_=2)
            self.assertEqual(rc, 2, out + err)
            self.assertIn("distill.weights", errors(err)[0])
            self.assertIn("teacher.h5", errors(err)[0])
            # a missing teacher config, and a teacher without weights
            rc, out, err = run([student, "--set", "distill.teacher=nowhere.yaml"])
            self.assertEqual(rc, 2, out + err)
            self.assertIn("distill.teacher: nowhere.yaml: cannot open config", errors(err)[0])
            rc, out, err = run([student, "--set", "distill.weights=''"])
            self.assertEqual(rc, 2, out + err)
            self.assertIn("needs distill.weights", errors(err)[0])
        finally:
            w.cleanup()

    def test_dry_run_counts_the_teacher(self):
        """The teacher's parameters, buffers and forward activations (no gradients, no dy) are a part
        of the estimate: at 40,000 rows a rank (40,001 held) the input and each layer's output once,
        36 + 4 x 144 (conv2d, batchnorm with its relu fused, dropout, flatten) + 3 values a row."""
        w = Workdir()
        try:
            case = Case(w, False)
            rc, out, err = run([case.write(train={"global_batch_size": 40000}), "--dry-run"])
            self.assertEqual(rc, 0, out + err)
            self.assertIn("distillation: 0.7 x T^2 KL from a frozen teacher + 0.3 x the loss; teacher: 483 "
                          "parameters", out)
            line = [l for l in out.splitlines() if l.startswith("memory per rank")][0]
            teacher = float(line.split("+ teacher ")[1].split()[0])
            values = 483 + 8 + 40001 * (36 + 4 * 144 + 3)
            self.assertAlmostEqual(teacher, values * 4 / 1048576, delta=0.06, msg=line)
            rc, out2, err = run([case.write("plain.yaml", plain=True), "--dry-run"])
            self.assertEqual(rc, 0, out2 + err)
            self.assertNotIn("teacher", out2)
        finally:
            w.cleanup()


    def test_status_shows_the_teacher(self):
        from test_monitor import Job, request
        w = Workdir()
        try:
            case = Case(w, False)
            cfg = case.write(train={"epochs": 1000000}, monitor={"listen": "127.0.0.1:0"}, log={"every_steps": 1000},
                             checkpoint={"dir": ""})
            job = Job([cfg, "--device", "cpu"], np_=2)
            try:
                addr = job.address()
                deadline = time.monotonic() + 60
                while True:
                    status, _, body = request(addr, "/status")
                    st = json.loads(body)
                    if st["state"] == "training" or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                self.assertEqual(st["state"], "training")
                self.assertEqual(st["distill"], {"teacher": w.file("teacher.yaml"), "weights": w.file("teacher.h5"),
                                                 "teacher_parameters": 483, "loss": "kl", "temperature": 3,
                                                 "alpha": 0.7})
            finally:
                job.stop()
        finally:
            w.cleanup()


    def test_the_shipped_configs_run(self):
        """configs/distill_fmnist.yaml and configs/distill_gpt_tiny.yaml as the README runs them, on their
        real data for 3 steps, with teachers of random weights in place of the trained ones."""
        w = Workdir()
        try:
            for config in ("configs/distill_fmnist.yaml", "configs/distill_gpt_tiny.yaml"):
                with open(os.path.join(ROOT, config)) as f:
                    cfg = yaml.safe_load(f)
                teacher, _ = ddp_model.build_from_yaml(os.path.join(ROOT, cfg["distill"]["teacher"]))
                ddp_model.save_h5(teacher, w.file("teacher.h5"))
                out_dir = w.file(os.path.basename(config))
                rc, out, err = run([config, "--set", f"distill.weights={w.file('teacher.h5')}", "--set",
                                    "train.max_steps=3", "--set", f"log.dir={out_dir}", "--set",
                                    f"checkpoint.dir={out_dir}", "--set", "data.cache=none"], np_=2, timeout=300)
                self.assertEqual(rc, 0, out + err)
                self.assertIn(f"distill: teacher {cfg['distill']['teacher']}", out)
        finally:
            w.cleanup()


class Gpu(unittest.TestCase):
    def test_cuda_with_graphs_equals_the_cpu(self):
        """The stand-in (or a GPU): the image and the token case, CUDA graphs on, to 1e-5 of the CPU."""
        env, visible, _ = helpers.gpu_setup(1)
        if visible < 1:
            self.skipTest("no GPU")
        for token in (False, True):
            w = Workdir()
            try:
                case = Case(w, token)
                cfg = case.write(optim=OPTIMS["sgd"])
                rc, out, err = run([cfg, "--set", f"checkpoint.dir={w.file('cpu')}"])
                self.assertEqual(rc, 0, out + err)
                rc, out, err = run([cfg, "--device", "cuda", "--set", "train.cuda_graph=on", "--set",
                                    f"checkpoint.dir={w.file('gpu')}"],
                                   binary=helpers.GPU_BINARY, env=env, timeout=300)
                self.assertEqual(rc, 0, out + err)
                self.assertIn("cuda graph: 2 steps captured, 2 replayed", out)
                cpu, gpu = params(w.latest("cpu")), params(w.latest("gpu"))
                for k in cpu:
                    err_ = np.linalg.norm(gpu[k] - cpu[k]) / max(np.linalg.norm(cpu[k]), 1e-12)
                    self.assertLess(err_, 1e-5, f"token {token}: {k}")
            finally:
                w.cleanup()


    def test_16_bit_precisions_run_the_teacher_too(self):
        """bf16 and fp16 (loss scaling, which the teacher's term carries too): the taught run's losses
        stay within 2% of fp32's on the same device, and differ from them (the teacher's and the
        student's products both ran in 16 bits). The teacher's convolution reads its filter's 16-bit copy,
        made once as the teacher is loaded (the student, an MLP narrower than 16, has none): on the stand-in
        one weights16_kernel in the run, not one a step."""
        env, visible, sim = helpers.gpu_setup(1)
        if visible < 1:
            self.skipTest("no GPU")
        w = Workdir()
        try:
            case = Case(w, False)
            cfg = case.write(optim=OPTIMS["sgd"])
            losses = {}
            for precision in ("fp32", "bf16", "fp16"):
                log = w.file(f"log-{precision}")
                rc, out, err = run([cfg, "--device", "cuda", "--set", f"train.precision={precision}", "--set",
                                    f"log.dir={log}", "--set", f"checkpoint.dir={log}"],
                                   binary=helpers.GPU_BINARY, env=dict(env, GPUSIM_PROFILE="1"), timeout=300)
                self.assertEqual(rc, 0, out + err)
                losses[precision] = [r["loss"] for r in w.metrics(f"log-{precision}") if "loss" in r]
                if sim:
                    copies = re.findall(r"^\s*weights16_kernel\s+(\d+)\s", err, re.M)
                    self.assertEqual(copies, [] if precision == "fp32" else ["1"], (precision, err))
            for precision in ("bf16", "fp16"):
                np.testing.assert_allclose(losses[precision], losses["fp32"], rtol=0.02, err_msg=precision)
                self.assertNotEqual(losses[precision], losses["fp32"], precision)
        finally:
            w.cleanup()


if __name__ == "__main__":
    unittest.main()
