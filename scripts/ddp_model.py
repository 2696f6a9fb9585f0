#!/usr/bin/python3
"""The torch.nn equivalent of a ddp_train model YAML, and the HDF5 tensor layout both share.

    import ddp_model
    model, loss_fn = ddp_model.build_from_yaml("configs/model.yaml")
    ddp_model.load_h5(model, "runs/model/final.h5")     # the /model group of a ddp_train file

The module is an nn.Sequential whose state_dict keys are the dataset names ddp_train uses
("0.weight", "3.body.1.running_var"); residual blocks are Residual(body, shortcut), and a
`repeat: {times, layers}` item is expanded in place, as if its copies were written out.

Token models (the first layer is `embedding`) take a LongTensor (B, T) of token ids and give
logits (B, T, V); activations are (B, T, C) and `linear` applies to the last dimension. A head
tied to an embedding (`linear: {out: V, tie: "0"}`) uses that embedding's `tok.weight` Parameter
itself, so the state_dict (and an HDF5 file) holds the tensor once, as `0.tok.weight`:

    model, loss_fn = ddp_model.build_from_yaml("configs/gpt_tiny.yaml")
    x, y = ddp_model.token_rows(f["/train/tokens"][:8])     # (8, T) inputs, (8, T) targets
    loss = loss_fn(model(x), y)                             # mean over every target token
"""
import math
import os
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


class Embedding(nn.Module):
    """Token embedding plus learned positions: (B, T) ids -> (B, T, D) = tok(ids) + pos(0..T-1)."""

    def __init__(self, vocab, dim, positions, max_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim) if positions else None
        for e in (self.tok, self.pos):  # GPT-2's init, as ddp_train's (nn.Embedding's own is N(0, 1))
            if e is not None:
                nn.init.normal_(e.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx.long())
        if self.pos is not None:
            x = x + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return x


class Attention(nn.Module):
    """Multi-head self-attention on (B, T, C), GPT-2's: one qkv projection whose output is
    [q | k | v] (each C wide, head h the contiguous columns h*C/H..(h+1)*C/H), softmax(q k^T /
    sqrt(C/H)) with an optional causal mask, dropout on the probabilities, then proj."""

    def __init__(self, dim, heads, causal, dropout):
        super().__init__()
        if dim % heads:
            raise ValueError(f"attention: width {dim} is not a multiple of heads {heads}")
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        hd = c // self.heads
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.reshape(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))  # (B, H, T, hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)  # (B, H, T, T)
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        att = self.drop(torch.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class TiedLinear(nn.Module):
    """A linear layer whose weight is another layer's embedding matrix (V, D): y = x W^T (+ b).
    The weight is not registered here, so state_dict() and parameters() hold it once, under the
    embedding's name, and its gradient is the sum of both uses."""

    def __init__(self, source, bias):
        super().__init__()
        object.__setattr__(self, "source", source)  # not a submodule: no second copy in state_dict
        v = source.tok.weight.shape[0]
        self.bias = nn.Parameter(torch.zeros(v)) if bias else None
        if bias:
            bound = 1 / math.sqrt(source.tok.weight.shape[1])
            nn.init.uniform_(self.bias, -bound, bound)

    @property
    def weight(self):
        return self.source.tok.weight

    def forward(self, x):
        return F.linear(x, self.source.tok.weight, self.bias)

    def extra_repr(self):
        v, d = self.source.tok.weight.shape
        return f"in_features={d}, out_features={v}, bias={self.bias is not None}, tied"


def _layer(kind, args, shape, name, named):
    """Returns (module, output shape) for one layer given the per-sample input shape.
    name: the layer's dotted name ("3", "4.body.1"); named: the modules built so far, by name."""
    args = args or {}
    if kind == "embedding":
        if len(shape) != 1:
            raise ValueError(f"layer {name}: embedding needs a token input [T], got {list(shape)}")
        t = shape[0]
        max_len = args.get("max_len") or t  # 0 or absent: T
        if max_len < t:
            raise ValueError(f"layer {name}: embedding max_len {max_len} < sequence length {t}")
        m = Embedding(args["vocab"], args["dim"], args.get("positions", True), max_len)
        return m, (t, args["dim"])
    if kind == "linear":
        out = args["out"]
        tie = args.get("tie")
        if tie not in (None, ""):
            src = named.get(str(tie))
            if not isinstance(src, Embedding):
                raise ValueError(f"layer {name}: tie '{tie}' does not name an earlier embedding layer")
            v, d = src.tok.weight.shape
            if out != v or shape[-1] != d:
                raise ValueError(f"layer {name}: tied to '{tie}' ({v}, {d}) but maps {shape[-1]} -> {out}")
            return TiedLinear(src, args.get("bias", True)), tuple(shape[:-1]) + (out,)
        return nn.Linear(shape[-1], out, bias=args.get("bias", True)), tuple(shape[:-1]) + (out,)
    if kind == "layernorm":
        return nn.LayerNorm(shape[-1], eps=float(args.get("eps", 1e-5))), shape
    if kind == "attention":
        if len(shape) != 2:
            raise ValueError(f"layer {name}: attention needs a sequence (T, C), got {list(shape)}")
        return Attention(shape[1], args["heads"], args.get("causal", True), args.get("dropout", 0.0)), shape
    if kind == "gelu":
        return nn.GELU(approximate=args.get("approximate", "none")), shape
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
    if kind in ("relu", "tanh", "sigmoid"):
        return {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}[kind](), shape
    if kind == "residual":
        body, out = build_layers(args["body"], shape, f"{name}.body.", named)
        shortcut, _ = build_layers(args.get("shortcut") or [], shape, f"{name}.shortcut.", named)
        return Residual(body, shortcut), out
    raise ValueError(f"unknown layer {kind}")


def _kind_args(item):
    if isinstance(item, str):
        return item, {}
    (kind, args), = item.items()
    return kind, args or {}


def expand(items):
    """The layer list with every `repeat: {times: N, layers: [...]}` replaced by N copies of its
    layers in place (nested repeats too); residual bodies are expanded when they are built."""
    out = []
    for item in items:
        kind, args = _kind_args(item)
        if kind == "repeat":
            out += expand(args["layers"]) * args["times"]
        else:
            out.append(item)
    return out


def build_layers(items, shape, prefix="", named=None):
    named = {} if named is None else named
    mods = []
    for i, item in enumerate(expand(items)):
        kind, args = _kind_args(item)
        m, shape = _layer(kind, args, shape, f"{prefix}{i}", named)
        named[f"{prefix}{i}"] = m
        mods.append(m)
    return nn.Sequential(*mods), shape


def is_token_model(model_cfg):
    """True when the model's first layer is `embedding`: its input is T integer tokens."""
    layers = expand(model_cfg["layers"])
    return bool(layers) and _kind_args(layers[0])[0] == "embedding"


def input_shape(spec):
    spec = list(spec)
    return tuple(spec) if len(spec) != 2 else (1, spec[0], spec[1])


def token_rows(rows):
    """(inputs, targets) LongTensors (N, T) of (N, T+1) token rows: row[0:T] and row[1:T+1]."""
    rows = torch.as_tensor(rows.astype("int64") if hasattr(rows, "astype") else rows).long()
    return rows[:, :-1], rows[:, 1:]


def param_groups(model, weight_decay, no_decay=()):
    """torch.optim parameter groups as ddp_train's optim.no_decay makes them: "bias" exempts the
    biases, "norm" batchnorm and layernorm weights and biases, "embedding" the embedding matrices
    (and so a head tied to one); every other tensor decays."""
    norms = (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)
    decay, keep, seen = [], [], set()
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            exempt = (("norm" in no_decay and isinstance(mod, norms))
                      or ("embedding" in no_decay and (isinstance(mod, nn.Embedding) or isinstance(mod, Embedding)))
                      or ("bias" in no_decay and pname == "bias" and not isinstance(mod, norms)))
            (keep if exempt else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def count_parameters(model):
    """Parameters, a tied matrix counted once (as PyTorch's model.parameters() does)."""
    return sum(p.numel() for p in model.parameters())


def build(model_cfg):
    """(nn.Sequential, loss function of (logits, targets) giving the mean loss). For a sequence
    model the logits are (B, T, V) and the targets (B, T): the mean over every target token that
    is not ignore_index."""
    model, _ = build_layers(model_cfg["layers"], input_shape(model_cfg["input"]))
    loss = model_cfg.get("loss", "cross_entropy")
    if isinstance(loss, dict):
        (name, args), = loss.items()
    else:
        name, args = loss, {}
    args = args or {}
    if name == "cross_entropy":
        ls = args.get("label_smoothing", 0.0)
        ignore = args.get("ignore_index", -100)

        def cross_entropy(z, y):
            return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1).long(), ignore_index=ignore,
                                   label_smoothing=ls)
        return model, cross_entropy
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
    """Writes the module's tensors in ddp_train's layout (usable as model.init_from), under a temporary
    name and then renamed: an interrupted write never leaves a partial file at path."""
    import h5py

    tmp = f"{path}.tmp.{os.getpid()}"  # one per process: two runs may write the same file
    with h5py.File(tmp, "w") as f:
        g = f.create_group("model")
        for name, t in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                continue
            g.create_dataset(name, data=t.detach().float().numpy())
    os.replace(tmp, path)


if __name__ == "__main__":
    m, _ = build_from_yaml(sys.argv[1])
    print(m)
    print(f"{count_parameters(m):,} parameters")
