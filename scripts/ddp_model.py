#!/usr/bin/python3
"""The torch.nn equivalent of a ddp_train model YAML, and the HDF5 tensor layout both share.

    import ddp_model
    model, loss_fn = ddp_model.build_from_yaml("configs/model.yaml")
    ddp_model.load_h5(model, "runs/model/final.h5")     # the /model group of a ddp_train file

The module is an nn.Sequential whose state_dict keys are the dataset names ddp_train uses
("0.weight", "3.body.1.running_var"); residual blocks are Residual(body, shortcut).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml


class Residual(nn.Module):
    """y = body(x) + shortcut(x); an empty shortcut is the identity."""

    def __init__(self, body, shortcut):
        super().__init__()
        self.body = body
        self.shortcut = shortcut

    def forward(self, x):
        return self.body(x) + (self.shortcut(x) if len(self.shortcut) else x)


class GlobalAvgPool(nn.Module):
    def forward(self, x):
        return x.mean(dim=(2, 3))


def _layer(kind, args, shape):
    """Returns (module, output shape) for one layer given the per-sample input shape."""
    args = args or {}
    if kind == "linear":
        out = args["out"]
        return nn.Linear(shape[0], out, bias=args.get("bias", True)), (out,)
    if kind == "conv2d":
        c, h, w = shape
        k, s, p = args["kernel"], args.get("stride", 1), args.get("pad", 0)
        m = nn.Conv2d(c, args["out"], k, stride=s, padding=p, bias=args.get("bias", True))
        return m, (args["out"], (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1)
    if kind == "batchnorm":
        cls = nn.BatchNorm2d if len(shape) == 3 else nn.BatchNorm1d
        return cls(shape[0], eps=args.get("eps", 1e-5), momentum=args.get("momentum", 0.1)), shape
    if kind in ("maxpool", "avgpool"):
        k = args["kernel"]
        s = args.get("stride", 0) or k
        cls = nn.MaxPool2d if kind == "maxpool" else nn.AvgPool2d
        c, h, w = shape
        return cls(k, stride=s), (c, (h - k) // s + 1, (w - k) // s + 1)
    if kind == "global_avgpool":
        return GlobalAvgPool(), (shape[0],)
    if kind == "flatten":
        n = 1
        for d in shape:
            n *= d
        return nn.Flatten(), (n,)
    if kind == "dropout":
        return nn.Dropout(args.get("p", 0.5)), shape
    if kind in ("relu", "gelu", "tanh", "sigmoid"):
        return {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}[kind](), shape
    if kind == "residual":
        body, out = build_layers(args["body"], shape)
        shortcut, _ = build_layers(args.get("shortcut") or [], shape)
        return Residual(body, shortcut), out
    raise ValueError(f"unknown layer {kind}")


def build_layers(items, shape):
    mods = []
    for item in items:
        if isinstance(item, str):
            kind, args = item, {}
        else:
            (kind, args), = item.items()
        m, shape = _layer(kind, args, shape)
        mods.append(m)
    return nn.Sequential(*mods), shape


def input_shape(spec):
    spec = list(spec)
    return tuple(spec) if len(spec) != 2 else (1, spec[0], spec[1])


def build(model_cfg):
    """(nn.Sequential, loss function of (logits, targets) giving the mean loss)."""
    model, _ = build_layers(model_cfg["layers"], input_shape(model_cfg["input"]))
    loss = model_cfg.get("loss", "cross_entropy")
    if isinstance(loss, dict):
        (name, args), = loss.items()
    else:
        name, args = loss, {}
    args = args or {}
    if name == "cross_entropy":
        ls = args.get("label_smoothing", 0.0)
        return model, lambda z, y: F.cross_entropy(z, y.long(), label_smoothing=ls)
    return model, lambda z, t: ((z - t.reshape(z.shape)) ** 2).mean()


def build_from_yaml(path):
    with open(path) as f:
        return build(yaml.safe_load(f)["model"])


def config_from_checkpoint(path):
    """The model section stored in a checkpoint's /meta config text (one `key: value` line per key,
    the values in YAML flow style), as the dict build() takes."""
    import h5py

    with h5py.File(path, "r") as f:
        text = f["meta"].attrs["config"]
    text = text.decode() if isinstance(text, bytes) else text
    model = {}
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key.startswith("model.") and key != "model.init_from":
            model[key[len("model."):]] = yaml.safe_load(value)
    return model


def build_from_checkpoint(path):
    """(module with the checkpoint's weights, loss function)."""
    model, loss = build(config_from_checkpoint(path))
    load_h5(model, path)
    return model, loss


def load_h5(model, path, group="model"):
    """Loads /<group>/<name> datasets (/model, or /ema for the moving average) into the module's
    parameters and buffers."""
    import h5py

    state = model.state_dict()
    with h5py.File(path, "r") as f:
        if group not in f:
            raise KeyError(f"{path} has no /{group} (train.ema was off when it was written)")
        for name, t in state.items():
            if name.endswith("num_batches_tracked"):
                continue
            t.copy_(torch.from_numpy(f[group][name][...]))


def save_h5(model, path):
    """Writes the module's tensors in ddp_train's layout (usable as model.init_from)."""
    import h5py

    with h5py.File(path, "w") as f:
        g = f.create_group("model")
        for name, t in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                continue
            g.create_dataset(name, data=t.detach().float().numpy())


if __name__ == "__main__":
    m, _ = build_from_yaml(sys.argv[1])
    print(m)
