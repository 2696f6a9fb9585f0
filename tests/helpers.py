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
# DDP_TRAIN_BINARY: another build of ddp_train (the sanitizer builds, make test-asan)
BINARY = os.path.abspath(os.environ.get("DDP_TRAIN_BINARY", os.path.join(ROOT, "ddp_train")))
# odls_base_sigkill_timeout 0: when a rank exits nonzero, mpirun ends the others with SIGKILL at once
# instead of SIGTERM and a second's wait, and exits 2 s sooner (Open MPI 4.1: 2.2 s against 0.4 s for
# a 2-rank config error). Many tests run jobs that exit 2, 3, 4 or 75, where ddp_train has ended every
# rank itself; where a test kills a rank, the others lose a second in which their SIGTERM handler asks
# for a checkpoint that a job short of a rank cannot write (test_faults passes either way).
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_odls_base_sigkill_timeout="0")

# The binary the GPU suites run: ./ddp_train on a GPU machine (make test-gpu), the CUDA variant
# built against the CPU stand-in in `make test` (build/sim/ddp_train, tests/gpusim).
GPU_BINARY = os.path.abspath(os.environ.get("DDP_TRAIN_GPU_BINARY", BINARY))


def run(args, np_=1, timeout=120, cwd=None, mpmd=None, binary=BINARY, env=None):
    """Runs ddp_train on np_ ranks; returns (exit code, stdout, stderr).
    mpmd: a list of per-rank argument lists instead (mpirun's ':' syntax); an item may be a pair
    (variables, arguments) to set environment variables for that rank only.
    env: extra environment variables for every rank.
    A run that names no --device gets --device cpu."""
    cmd = ["mpirun", "--oversubscribe"]
    # the CPU backend unless the test names a device: --device auto would take a GPU where there is one
    pin = lambda a: a if any(x == "--device" or x.startswith("--device=") for x in a) else a + ["--device", "cpu"]
    if mpmd:
        for i, item in enumerate(mpmd):
            rank_env, args_ = item if isinstance(item, tuple) else ({}, item)
            prefix = ["env"] + [f"{k}={v}" for k, v in rank_env.items()] if rank_env else []
            cmd += ([":"] if i else []) + ["-np", "1"] + prefix + [binary] + pin(args_)
    else:
        cmd += ["-np", str(np_), binary] + pin(args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
                       env=dict(ENV, **(env or {})))
    return p.returncode, p.stdout, p.stderr


def gpu_setup(devices):
    """(environment, GPUs visible, is the stand-in) for GPU runs that want `devices` GPUs: the
    stand-in is given that many; real hardware has what it has."""
    env = {"GPUSIM_DEVICES": str(devices)}
    p = subprocess.run(["mpirun", "-np", "1", GPU_BINARY, "--info"], capture_output=True, text=True,
                       env=dict(ENV, **env), cwd=ROOT)
    visible = p.stdout.count("  GPU ")
    return env, visible, "CPU stand-in" in p.stdout


def params(path):
    """The /model tensors of a checkpoint, by name."""
    with h5py.File(path, "r") as f:
        return {k: f["model"][k][...] for k in f["model"]}


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

    def corrupt_chunk(self, path, row):
        """Rewrites /train/images of path in gzip chunks of 10 rows and overwrites the chunk holding row
        with 0xff bytes: HDF5 fails to read it, and only it."""
        with h5py.File(path, "a") as f:
            x = f["train/images"][...]
            del f["train/images"]
            f.create_dataset("train/images", data=x, chunks=(10,) + x.shape[1:], compression="gzip")
        with h5py.File(path, "r") as f:
            chunk = f["train/images"].id.get_chunk_info_by_coord((row,) + (0,) * (len(x.shape) - 1))
        with open(path, "r+b") as f:
            f.seek(chunk.byte_offset)
            f.write(b"\xff" * chunk.size)

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
