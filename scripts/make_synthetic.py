#!/usr/bin/python3
"""A small synthetic image-classification set for models without a real dataset here
(configs/resnet18_cifar.yaml): 3x32x32 uint8 images whose class sets the colour and position of a
bright square on noise, so the task is learnable.
usage: make_synthetic.py OUT.h5 [N_TRAIN N_TEST]  (written under a temporary name, then renamed)"""
import os
import sys

import h5py
import numpy as np


def make(n, rng, classes=10):
    y = rng.integers(0, classes, n)
    x = rng.integers(0, 96, (n, 3, 32, 32), dtype=np.uint8)
    for i in range(n):
        c = y[i]
        top, left = 4 + 12 * (c // 4 % 2), 4 + 6 * (c % 4)
        x[i, c % 3, top:top + 10, left:left + 10] = 255
    return x, y.astype(np.uint8)


def main():
    out = sys.argv[1]
    n_train = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    n_test = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    rng = np.random.default_rng(2026)
    tmp = f"{out}.tmp.{os.getpid()}"  # one per process: two runs may write the same file
    with h5py.File(tmp, "w") as f:
        for split, n in (("train", n_train), ("test", n_test)):
            x, y = make(n, rng)
            f.create_dataset(f"/{split}/images", data=x, chunks=(64, 3, 32, 32))
            f.create_dataset(f"/{split}/labels", data=y)
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
