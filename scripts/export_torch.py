#!/usr/bin/python3
"""Exports a ddp_train checkpoint for PyTorch or NumPy.

usage: export_torch.py CKPT.h5 OUT.pt [--npz OUT.npz] [--ema]

OUT.pt is a state_dict for the module scripts/ddp_model.py builds from the same config, so
    model, _ = ddp_model.build_from_yaml("configs/model.yaml")   # or build_from_checkpoint(CKPT)
    model.load_state_dict(torch.load("OUT.pt"))
works (batchnorm's num_batches_tracked is filled from the checkpoint's step). OUT.npz holds the
same tensors as NumPy arrays under the same names. --ema exports the moving average of the
weights (/ema, written with train.ema) instead of the weights."""
import argparse
import os
import sys

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--npz", help="also write the tensors to this .npz file")
    ap.add_argument("--ema", action="store_true", help="export the EMA of the weights (/ema) instead")
    args = ap.parse_args()
    model, _ = ddp_model.build_from_checkpoint(args.checkpoint)
    if args.ema:
        try:
            ddp_model.load_h5(model, args.checkpoint, "ema")
        except KeyError as e:
            sys.exit(f"export_torch.py: {e.args[0]}")
    with h5py.File(args.checkpoint, "r") as f:
        step = int(f["meta"].attrs["step"])
    state = model.state_dict()
    for name in state:
        if name.endswith("num_batches_tracked"):
            state[name].fill_(step)
    tmp = args.out + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(state)} tensors")
    if args.npz:
        arrays = {k: v.numpy() for k, v in state.items()}
        tmp = args.npz + ".tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, args.npz)
        print(f"wrote {args.npz}")


if __name__ == "__main__":
    main()
