"""Writes the fuzzers' seed corpora into tests/fuzz/corpus/{config,data,checkpoint} (committed).
Run from the repository root with Debian's python3 after `make`:
    /usr/bin/python3 tests/fuzz/make_seeds.py
Data seeds are small valid files for the harnesses' model (input (1, 6, 6), 3 classes) in each
layout the reader accepts, plus a few it must refuse; checkpoint seeds are real checkpoints that
./ddp_train writes for the same model."""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")
MODEL = """model:
  input: [1, 6, 6]
  layers: [{conv2d: {out: 4, kernel: 3, pad: 1}}, {batchnorm: {}}, relu,
    {maxpool: {kernel: 2}}, flatten, {linear: {out: 3}}]
"""


def data_file(path, x_dtype=np.uint8, y_dtype=np.int64, n=8, shape=(1, 6, 6), val=True, chunks=None, gzip=False,
              labels=None):
    rng = np.random.default_rng(len(path))
    with h5py.File(path, "w") as f:
        for split, rows in (("train", n),) + ((("test", 4),) if val else ()):
            x = rng.random((rows,) + shape) * (255 if x_dtype == np.uint8 else 1)
            y = rng.integers(0, 3, rows) if labels is None else np.array(labels[:rows])
            kw = {"chunks": chunks or True, "compression": "gzip" if gzip else None} if chunks or gzip else {}
            f.create_dataset(f"{split}/images", data=x.astype(x_dtype), **kw)
            f.create_dataset(f"{split}/labels", data=y.astype(y_dtype))


def main():
    for sub in ("config", "data", "checkpoint"):
        shutil.rmtree(os.path.join(OUT, sub), ignore_errors=True)
        os.makedirs(os.path.join(OUT, sub))
    # configs: the shipped ones, and --set sections
    for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")):
        shutil.copy(p, os.path.join(OUT, "config", os.path.basename(p)))
    with open(os.path.join(OUT, "config", "sets.yaml"), "w") as f:
        f.write(MODEL + "data: {path: x.h5}\ntrain: {batch_size: 4}\n#--set\ntrain.epochs=3\n"
                "optim.lr=0.01\nmodel.layers=[flatten, {linear: {out: 3}}]\n")
    with open(os.path.join(OUT, "config", "residual.yaml"), "w") as f:
        f.write("model:\n  input: [4, 6, 6]\n  layers:\n    - residual:\n        body: [{conv2d: {out: 8, kernel: 3, "
                "stride: 2, pad: 1}}, {batchnorm: {momentum: 0.2, sync: true}}, gelu]\n        shortcut: [{conv2d: "
                "{out: 8, kernel: 1, stride: 2}}]\n    - global_avgpool\n    - {dropout: {p: 0.1}}\n    - {linear: "
                "{out: 2}}\n  loss: mse\ndata: {path: x.h5, mean: [0.5, 0.5, 0.5, 0.5], std: [0.2, 0.2, 0.2, 0.2]}\n"
                "train: {global_batch_size: 16, grad_accum: 2, early_stopping: {metric: val_loss, patience: 3}}\n"
                "optim: {name: adamw, betas: [0.9, 0.99], schedule: {name: cosine, warmup_steps: 5}}\n")
    # data files
    d = os.path.join(OUT, "data")
    data_file(os.path.join(d, "u8.h5"))
    data_file(os.path.join(d, "f32_i32_no_val.h5"), x_dtype=np.float32, y_dtype=np.int32, val=False)
    data_file(os.path.join(d, "f64_hw.h5"), x_dtype=np.float64, shape=(6, 6))
    data_file(os.path.join(d, "chunked_gzip.h5"), chunks=(2, 1, 6, 6), gzip=True)
    data_file(os.path.join(d, "label_out_of_range.h5"), labels=[0, 1, 2, 3, 0, 1, 2, 0])
    data_file(os.path.join(d, "wrong_shape.h5"), shape=(2, 6, 6))
    # checkpoints: written by ddp_train for the harness's model
    with tempfile.TemporaryDirectory() as t:
        data_file(os.path.join(t, "data.h5"), n=16)
        for name, optim in (("sgd", "{momentum: 0.9}"), ("plain_sgd", "{momentum: 0}")):
            cfg = os.path.join(t, f"{name}.yaml")
            with open(cfg, "w") as f:
                f.write(MODEL + f"data: {{path: {t}/data.h5, scale: 0.0039}}\ntrain: {{epochs: 1, batch_size: 4}}\n"
                        f"optim: {optim}\ncheckpoint: {{dir: {t}/{name}}}\nlog: {{dir: {t}/{name}}}\n")
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            subprocess.run(["mpirun", "-np", "1", os.path.join(ROOT, "ddp_train"), cfg], check=True, env=env,
                           capture_output=True)
            newest = sorted(glob.glob(os.path.join(t, name, "step-*.h5")))[-1]
            shutil.copy(newest, os.path.join(OUT, "checkpoint", f"{name}.h5"))
    for sub in ("config", "data", "checkpoint"):
        files = os.listdir(os.path.join(OUT, sub))
        print(f"{sub}: {len(files)} seeds, {sum(os.path.getsize(os.path.join(OUT, sub, f)) for f in files)} bytes")


if __name__ == "__main__":
    sys.exit(main())
