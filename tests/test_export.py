"""Taking the model elsewhere: scripts/export_torch.py writes a state_dict that loads into the
module scripts/ddp_model.py builds from the same YAML, and PyTorch's logits on the validation set
equal ddp_train's own evaluation of the same checkpoint (--predict) to 1e-4. Also the .npz
export and scripts/plot_metrics.py."""
import os
import subprocess
import sys
import unittest

import h5py
import numpy as np
import torch
import yaml

from helpers import ROOT, Workdir, run

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import ddp_model  # noqa: E402

PY = "/usr/bin/python3"
MODEL = """\
model:
  input: [2, 6, 6]
  layers:
    - conv2d: {{out: 4, kernel: 3, pad: 1, bias: false}}
    - batchnorm: {{}}
    - relu: {{}}
    - residual: {{body: [{{conv2d: {{out: 4, kernel: 3, pad: 1}}}}, {{batchnorm: {{}}}}, gelu]}}
    - maxpool: {{kernel: 2}}
    - flatten: {{}}
    - dropout: {{p: 0.2}}
    - linear: {{out: 3}}
data: {{path: {dir}/data.h5, scale: 0.00392156862745098, mean: [0.4, 0.5], std: [0.2, 0.3]}}
train: {{epochs: 3, global_batch_size: 8, seed: 4}}
optim: {{name: sgd, lr: 0.05, momentum: 0.9}}
log: {{dir: {dir}/log, every_steps: 2}}
checkpoint: {{dir: {dir}/ckpt}}
"""


class Export(unittest.TestCase):
    def test_pytorch_logits_equal_ddp_train_evaluation(self):
        w = Workdir()
        try:
            w.dataset(n=48, n_val=21, shape=(2, 6, 6))
            cfg = w.config(MODEL)
            rc, out, err = run([cfg], np_=2)
            self.assertEqual(rc, 0, out + err)
            ckpt = w.latest()
            rc, out, err = run([cfg, "--resume", ckpt, "--predict", w.file("pred.h5")], np_=2)
            self.assertEqual(rc, 0, out + err)
            with h5py.File(w.file("pred.h5"), "r") as f:
                ours, labels = f["logits"][...], f["labels"][...]
            self.assertEqual(ours.shape, (21, 3))
            p = subprocess.run([PY, os.path.join(ROOT, "scripts", "export_torch.py"), ckpt, w.file("m.pt"),
                                "--npz", w.file("m.npz")], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            model, _ = ddp_model.build_from_yaml(cfg)
            model.load_state_dict(torch.load(w.file("m.pt")))  # strict: every key, every shape
            model.eval()
            with open(cfg) as f:
                data = yaml.safe_load(f)["data"]
            with h5py.File(w.file("data.h5"), "r") as f:
                x = torch.tensor(f["test/images"][...], dtype=torch.float32)
                y = f["test/labels"][...]
            mean = torch.tensor(data["mean"]).reshape(1, -1, 1, 1)
            std = torch.tensor(data["std"]).reshape(1, -1, 1, 1)
            with torch.no_grad():
                theirs = model((x * data["scale"] - mean) / std).numpy()
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(labels, y)
            npz = np.load(w.file("m.npz"))
            self.assertEqual(sorted(npz.files), sorted(model.state_dict().keys()))
            with h5py.File(ckpt, "r") as f:
                np.testing.assert_array_equal(npz["3.body.0.weight"], f["model/3.body.0.weight"][...])
                self.assertEqual(int(npz["1.num_batches_tracked"]), int(f["meta"].attrs["step"]))
            # the same module, rebuilt from the checkpoint alone
            again, _ = ddp_model.build_from_checkpoint(ckpt)
            again.eval()
            with torch.no_grad():
                np.testing.assert_allclose(again((x * data["scale"] - mean) / std).numpy(), theirs, rtol=1e-6)
        finally:
            w.cleanup()

    def test_plot_metrics_makes_a_png(self):
        w = Workdir()
        try:
            w.dataset(n=48, n_val=21, shape=(2, 6, 6))
            cfg = w.config(MODEL)
            rc, out, err = run([cfg], np_=1)
            self.assertEqual(rc, 0, err)
            m = w.file("log/metrics.jsonl")
            p = subprocess.run([PY, os.path.join(ROOT, "scripts", "plot_metrics.py"), m, m, "-o", w.file("p.png"),
                                "--labels", "a,b"], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(w.file("p.png"), "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            self.assertGreater(os.path.getsize(w.file("p.png")), 20000)
        finally:
            w.cleanup()


if __name__ == "__main__":
    unittest.main()
