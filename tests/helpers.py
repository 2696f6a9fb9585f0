"""Shared pieces of the integration tests: running ddp_train under mpirun, small HDF5 datasets
and configs written into a temporary directory."""
import json
import os
import subprocess
import tempfile
import textwrap

import h5py
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "ddp_train")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")


def run(args, np_=1, timeout=120, cwd=None, mpmd=None):
    """Runs ddp_train on np_ ranks; returns (exit code, stdout, stderr).
    mpmd: a list of per-rank argument lists instead (mpirun's ':' syntax)."""
    cmd = ["mpirun", "--oversubscribe"]
    if mpmd:
        for i, a in enumerate(mpmd):
            cmd += ([":"] if i else []) + ["-np", "1", BINARY] + a
    else:
        cmd += ["-np", str(np_), BINARY] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT, env=ENV)
    return p.returncode, p.stdout, p.stderr


def errors(text):
    """The ddp_train error lines of a run's stderr."""
    return [l for l in text.splitlines() if l.startswith("ddp_train: error")]


class Workdir:
    """A temporary directory with helpers to write datasets and configs into it."""

    def __init__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="ddp_train_")
        self.path = self.tmp.name

    def file(self, name):
        return os.path.join(self.path, name)

    def dataset(self, name="data.h5", n=40, shape=(1, 6, 6), classes=3, n_val=20, dtype=np.uint8, seed=0,
                targets=None):
        """Random images whose class is decided by a simple pattern, so a model can learn it."""
        rng = np.random.default_rng(seed)
        path = self.file(name)
        with h5py.File(path, "w") as f:
            for split, rows in (("train", n), ("test", n_val)):
                y = rng.integers(0, classes, rows)
                x = rng.random((rows,) + tuple(shape)) * 0.5
                flat = x.reshape(rows, -1)
                for i in range(rows):  # class c brightens the c-th block of features
                    k = flat.shape[1] // classes
                    flat[i, y[i] * k:(y[i] + 1) * k] += 0.5
                x = flat.reshape((rows,) + tuple(shape))
                if dtype == np.uint8:
                    x = (x * 255).astype(np.uint8)
                f.create_dataset(f"{split}/images", data=x.astype(dtype))
                if targets:
                    f.create_dataset(f"{split}/labels", data=rng.random((rows, targets)).astype(np.float32))
                else:
                    f.create_dataset(f"{split}/labels", data=y.astype(np.int64))
        return path

    def config(self, text, name="cfg.yaml", **fmt):
        path = self.file(name)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text).format(dir=self.path, **fmt))
        return path

    def metrics(self, sub="log"):
        with open(os.path.join(self.path, sub, "metrics.jsonl")) as f:
            return [json.loads(l) for l in f]

    def latest(self, sub="ckpt"):
        """The checkpoint the `latest` pointer of checkpoint.dir names."""
        with open(os.path.join(self.path, sub, "latest")) as f:
            return os.path.join(self.path, sub, f.read().strip())

    def cleanup(self):
        self.tmp.cleanup()


TINY_CNN = """\
model:
  input: [1, 6, 6]
  layers:
    - conv2d: {{out: 4, kernel: 3, pad: 1}}
    - relu: {{}}
    - maxpool: {{kernel: 2}}
    - flatten: {{}}
    - linear: {{out: 3}}
data:
  path: {dir}/data.h5
  scale: 0.00392156862745098
train:
  epochs: 2
  global_batch_size: 8
  seed: 3
optim: {{name: sgd, lr: 0.1, momentum: 0.9}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt}}
"""
