#!/usr/bin/python3
"""Converts the IDX files of Debian's dataset-fashion-mnist into one HDF5 file:
/train/images (60000,1,28,28) uint8, /train/labels (60000,) uint8, /test/images, /test/labels,
and /train/images_flat, /test/images_flat (N,784) for vector models.
usage: make_fashion_mnist.py SRC_DIR OUT.h5   (written under a temporary name, then renamed)"""
import gzip
import os
import struct
import sys

import h5py
import numpy as np


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        sys.exit(f"{path}: not an IDX uint8 file")
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        sys.exit(f"{path}: truncated ({arr.size} values, header says {dims})")
    return arr.reshape(dims)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    tmp = f"{out}.tmp.{os.getpid()}"  # one per process: two runs may write the same file
    with h5py.File(tmp, "w") as f:
        for split, prefix in (("train", "train"), ("test", "t10k")):
            images = read_idx(os.path.join(src, f"{prefix}-images-idx3-ubyte.gz"))
            labels = read_idx(os.path.join(src, f"{prefix}-labels-idx1-ubyte.gz"))
            f.create_dataset(f"/{split}/images", data=images[:, None, :, :], chunks=(1024, 1, 28, 28))
            f.create_dataset(f"/{split}/labels", data=labels)
            # the same pixels as vectors, for models whose input is [784] (configs/mlp.yaml)
            f.create_dataset(f"/{split}/images_flat", data=images.reshape(len(images), -1), chunks=(1024, 784))
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
