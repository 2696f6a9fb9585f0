#!/usr/bin/python3
"""Exports a ddp_train checkpoint for PyTorch or NumPy.

usage: export_torch.py CKPT.h5 OUT.pt [--npz OUT.npz] [--ema]
       export_torch.py CKPT.h5 OUT.bin --gpt2 [--ema]     (OUT.bin, or OUT/ for a Hugging Face directory)

OUT.pt is a state_dict for the module scripts/ddp_model.py builds from the same config, so
    model, _ = ddp_model.build_from_yaml("configs/model.yaml")   # or build_from_checkpoint(CKPT)
    model.load_state_dict(torch.load("OUT.pt"))
works (batchnorm's num_batches_tracked is filled from the checkpoint's step). OUT.npz holds the
same tensors as NumPy arrays under the same names. --ema exports the moving average of the
weights (/ema, written with train.ema) instead of the weights.

--gpt2 writes a Hugging Face GPT2LMHeadModel state_dict instead (the inverse of import_gpt2.py:
Conv1D weights transposed back to (in, out), lm_head.weight the same tensor as wte), for a model
with GPT-2's layer list (configs/gpt2_124m.yaml's form); it reads only /model (or /ema), so an
import_gpt2.py output works too. When OUT names a directory (ends with /), it gets
pytorch_model.bin and a config.json, so that GPT2LMHeadModel.from_pretrained(OUT) loads it."""
import argparse
import json
import os
import sys

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_model  # noqa: E402
import import_gpt2  # noqa: E402


def gpt2_state(path, group):
    """(HF GPT2LMHeadModel state_dict, n_layer) of the /<group> tensors of a ddp_train file."""
    with h5py.File(path, "r") as f:
        if group not in f:
            raise KeyError(f"{path} has no /{group}")
        tensors = {k: f[group][k][...] for k in f[group]}
    n_layer = sum(1 for k in tensors if k.endswith(".body.1.qkv.weight"))
    mapping = import_gpt2.name_map(n_layer)
    missing = [ours for _, ours, _ in mapping if ours not in tensors]
    extra = sorted(set(tensors) - {ours for _, ours, _ in mapping})
    if missing or extra:
        raise KeyError(f"{path}: not GPT-2's layer list with a tied head: "
                       + (f"missing {', '.join(missing[:4])} " if missing else "")
                       + (f"unexpected {', '.join(extra[:4])}" if extra else ""))
    state = {}
    for hf, ours, transposed in mapping:
        a = tensors[ours]
        state["transformer." + hf] = torch.from_numpy(np.ascontiguousarray(a.T) if transposed else a)
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: torch.save stores it once
    return state, n_layer


def gpt2_config(path, n_layer, state, heads=None):
    """GPT2Config fields of the model: the head count, epsilon and activation from the checkpoint's
    config, or from the attributes import_gpt2.py writes, or --heads (else width / 64)."""
    vocab, dim = state["transformer.wte.weight"].shape
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": int(vocab),
           "n_positions": int(state["transformer.wpe.weight"].shape[0]), "n_embd": int(dim), "n_layer": n_layer,
           "n_head": max(1, int(dim) // 64), "n_inner": int(state["transformer.h.0.mlp.c_fc.weight"].shape[1])
           if n_layer else None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True}
    with h5py.File(path, "r") as f:
        for k in ("n_head", "layer_norm_epsilon", "activation_function"):
            if k in f.attrs:
                v = f.attrs[k]
                cfg[k] = v.decode() if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v
    try:
        layers = ddp_model.expand(ddp_model.config_from_checkpoint(path)["layers"])
    except (KeyError, OSError):
        layers = []
    for item in layers:
        if isinstance(item, dict) and "residual" in item:
            for sub in item["residual"].get("body", []):
                kind, args = ddp_model._kind_args(sub)
                if kind == "attention":
                    cfg["n_head"] = args["heads"]
                elif kind == "layernorm":
                    cfg["layer_norm_epsilon"] = args.get("eps", 1e-5)
                elif kind == "gelu":
                    cfg["activation_function"] = "gelu" if args.get("approximate", "none") == "none" else "gelu_new"
    if heads:
        cfg["n_head"] = heads
    return cfg


def export_gpt2(args):
    group = "ema" if args.ema else "model"
    try:
        state, n_layer = gpt2_state(args.checkpoint, group)
    except KeyError as e:
        sys.exit(f"export_torch.py: {e.args[0]}")
    out = args.out
    if out.endswith("/") or os.path.isdir(out):
        os.makedirs(out, exist_ok=True)
        cfg, tmp = os.path.join(out, "config.json"), os.path.join(out, f"config.json.tmp.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(gpt2_config(args.checkpoint, n_layer, state, args.heads), f, indent=2)
        os.replace(tmp, cfg)
        out = os.path.join(out, "pytorch_model.bin")
    tmp = f"{out}.tmp.{os.getpid()}"  # one per process: two runs may write the same file
    torch.save(state, tmp)
    os.replace(tmp, out)
    print(f"wrote {out}: GPT2LMHeadModel state_dict, {n_layer} layers, {len(state)} tensors")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--npz", help="also write the tensors to this .npz file")
    ap.add_argument("--ema", action="store_true", help="export the EMA of the weights (/ema) instead")
    ap.add_argument("--gpt2", action="store_true",
                    help="write a Hugging Face GPT2LMHeadModel state_dict (OUT.bin, or OUT/ with a config.json)")
    ap.add_argument("--heads", type=int, help="--gpt2 into a directory: config.json's n_head when the file "
                    "does not say (default: width / 64)")
    args = ap.parse_args()
    if args.gpt2:
        if args.npz:
            sys.exit("export_torch.py: --npz does not go with --gpt2")
        return export_gpt2(args)
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
    tmp = f"{args.out}.tmp.{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(state)} tensors")
    if args.npz:
        arrays = {k: v.numpy() for k, v in state.items()}
        tmp = f"{args.npz}.tmp.{os.getpid()}.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, args.npz)
        print(f"wrote {args.npz}")


if __name__ == "__main__":
    main()
