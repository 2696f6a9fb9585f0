#!/usr/bin/python3
"""Converts a Hugging Face GPT2LMHeadModel (or GPT2Model) state_dict into ddp_train's model layout,
for `model.init_from`.

usage: import_gpt2.py SRC OUT.h5 [--heads H] [--seq-len T]

SRC is a pytorch_model.bin (torch.load), a model.safetensors (read here, without the safetensors
package), or a directory holding one of them; its config.json, when present, gives the head
count, layernorm epsilon and activation (else --heads, or width / 64 as in every GPT-2 size).
OUT.h5 gets group /model with one float32 dataset per tensor, named as ddp_train names them for
the layer list this prints (configs/gpt2_124m.yaml is GPT-2 small), e.g.

    transformer.wte.weight          -> 0.tok.weight (V, D)        (the head is tied to it)
    transformer.wpe.weight          -> 0.pos.weight (P, D)
    transformer.h.{i}.ln_1          -> {1+2i}.body.0
    transformer.h.{i}.attn.c_attn   -> {1+2i}.body.1.qkv         Conv1D (in, out) -> (out, in)
    transformer.h.{i}.attn.c_proj   -> {1+2i}.body.1.proj        transposed
    transformer.h.{i}.ln_2          -> {2+2i}.body.0
    transformer.h.{i}.mlp.c_fc      -> {2+2i}.body.1             transposed
    transformer.h.{i}.mlp.c_proj    -> {2+2i}.body.3             transposed
    transformer.ln_f                -> {1+2L}

lm_head.weight must equal wte (GPT-2 ties them) and is not stored; the attention mask buffers
(attn.bias, attn.masked_bias) are skipped. `scripts/export_torch.py CKPT OUT.bin --gpt2` goes back.
"""
import argparse
import json
import os
import re
import struct
import sys

import numpy as np

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

# per block i: HF suffix -> (ddp_train name with {a} = 1+2i and {m} = 2+2i, transposed)
BLOCK = [
    ("ln_1.weight", "{a}.body.0.weight"), ("ln_1.bias", "{a}.body.0.bias"),
    ("attn.c_attn.weight", "{a}.body.1.qkv.weight"), ("attn.c_attn.bias", "{a}.body.1.qkv.bias"),
    ("attn.c_proj.weight", "{a}.body.1.proj.weight"), ("attn.c_proj.bias", "{a}.body.1.proj.bias"),
    ("ln_2.weight", "{m}.body.0.weight"), ("ln_2.bias", "{m}.body.0.bias"),
    ("mlp.c_fc.weight", "{m}.body.1.weight"), ("mlp.c_fc.bias", "{m}.body.1.bias"),
    ("mlp.c_proj.weight", "{m}.body.3.weight"), ("mlp.c_proj.bias", "{m}.body.3.bias"),
]


def name_map(n_layer):
    """[(HF name without the "transformer." prefix, ddp_train name, transposed)] of a GPT-2 with
    n_layer blocks, in ddp_train's tensor order."""
    out = [("wte.weight", "0.tok.weight", False), ("wpe.weight", "0.pos.weight", False)]
    for i in range(n_layer):
        for hf, ours in BLOCK:
            out.append((f"h.{i}.{hf}", ours.format(a=1 + 2 * i, m=2 + 2 * i), hf in CONV1D))
    out += [("ln_f.weight", f"{1 + 2 * n_layer}.weight", False), ("ln_f.bias", f"{1 + 2 * n_layer}.bias", False)]
    return out


SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
                      "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path):
    """{name: float or integer ndarray} of a .safetensors file: an 8-byte little-endian header
    length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}}, then the bytes."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        buf = data[begin:end]
        if info["dtype"] == "BF16":  # bfloat16: the high half of a float32
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in SAFETENSORS_DTYPES:
            a = np.frombuffer(buf, dtype=np.dtype(SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<"))
        else:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {info['dtype']}")
        if a.size != int(np.prod(shape)):
            raise ValueError(f"{path}: tensor {name}: {a.size} values for shape {shape} (truncated file?)")
        out[name] = a.reshape(shape)
    return out


def read_torch(path):
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except TypeError:  # torch < 1.13
        state = torch.load(path, map_location="cpu")
    if hasattr(state, "state_dict"):
        state = state.state_dict()
    return {k: v.detach().float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}


def find_source(src):
    """(weights file, config.json path or None)."""
    if os.path.isdir(src):
        for name in ("model.safetensors", "pytorch_model.bin"):
            if os.path.exists(os.path.join(src, name)):
                cfg = os.path.join(src, "config.json")
                return os.path.join(src, name), cfg if os.path.exists(cfg) else None
        if any(n.endswith(".index.json") for n in os.listdir(src)):
            raise ValueError(f"{src}: sharded checkpoints are not supported: merge the shards first")
        raise ValueError(f"{src}: no model.safetensors or pytorch_model.bin in it")
    cfg = os.path.join(os.path.dirname(os.path.abspath(src)), "config.json")
    return src, cfg if os.path.exists(cfg) else None


def read_state(path):
    with open(path, "rb") as f:
        magic = f.read(8)
    if path.endswith(".safetensors") or (len(magic) == 8 and magic[:2] != b"PK" and magic[:1] != b"\x80"):
        state = read_safetensors(path)
    else:
        state = read_torch(path)
    # GPT2LMHeadModel's keys start with "transformer."; GPT2Model's (the hub's gpt2 files) do not;
    # a model saved from inside DistributedDataParallel has "module."
    out = {}
    for k, v in state.items():
        for p in ("module.", "transformer."):
            if k.startswith(p):
                k = k[len(p):]
        out[k] = v
    return out


def convert(state):
    """(n_layer, {ddp_train name: float32 array}) of a GPT-2 state_dict (keys without
    "transformer."). Raises ValueError naming what does not fit."""
    layers = {int(m.group(1)) for k in state for m in [re.match(r"h\.(\d+)\.", k)] if m}
    n_layer = len(layers)
    if layers != set(range(n_layer)):
        raise ValueError(f"blocks h.N are not numbered 0..{n_layer - 1}: {sorted(layers)}")
    mapping = name_map(n_layer)
    missing = [hf for hf, _, _ in mapping if hf not in state]
    if missing:
        raise ValueError(f"not a GPT-2 state_dict: missing {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    known = {hf for hf, _, _ in mapping} | {"lm_head.weight"}
    buffers = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")
    extra = [k for k in state if k not in known and not buffers.match(k)]
    if extra:
        raise ValueError(f"unexpected tensors (not GPT-2's): {', '.join(sorted(extra)[:5])}")
    wte = state["wte.weight"]
    if "lm_head.weight" in state and not np.array_equal(state["lm_head.weight"], wte):
        raise ValueError("lm_head.weight differs from wte.weight: an untied head is not GPT-2's")
    v, d = wte.shape
    out = {}
    for hf, ours, transposed in mapping:
        a = np.asarray(state[hf], dtype=np.float32)
        out[ours] = np.ascontiguousarray(a.T) if transposed else a
    expect = {"0.pos.weight": (state["wpe.weight"].shape[0], d)}
    for i in range(n_layer):
        a, m = 1 + 2 * i, 2 + 2 * i
        expect.update({f"{a}.body.1.qkv.weight": (3 * d, d), f"{a}.body.1.proj.weight": (d, d),
                       f"{m}.body.1.weight": (out[f"{m}.body.1.weight"].shape[0], d),
                       f"{m}.body.3.weight": (d, out[f"{m}.body.1.weight"].shape[0])})
    for name, shape in expect.items():
        if out[name].shape != shape:
            raise ValueError(f"{name}: shape {out[name].shape}, expected {shape}")
    return n_layer, out


def model_yaml(n_layer, vocab, dim, heads, max_len, hidden, eps=1e-5, approximate="tanh", seq_len=None):
    """The model section whose tensors these are (configs/gpt2_124m.yaml for GPT-2 small)."""
    eps = repr(float(eps))
    if "e" in eps and "." not in eps:  # 1e-05 is a string to YAML 1.1 readers (PyYAML): write 1.0e-05
        eps = eps.replace("e", ".0e")
    return f"""model:
  input: [{seq_len or max_len}]
  layers:
    - embedding: {{vocab: {vocab}, dim: {dim}, positions: true, max_len: {max_len}}}
    - repeat:
        times: {n_layer}
        layers:
          - residual:
              body:
                - layernorm: {{eps: {eps}}}
                - attention: {{heads: {heads}, causal: true, dropout: 0.0}}
          - residual:
              body:
                - layernorm: {{eps: {eps}}}
                - linear: {{out: {hidden}}}
                - gelu: {{approximate: {approximate}}}
                - linear: {{out: {dim}}}
    - layernorm: {{eps: {eps}}}
    - linear: {{out: {vocab}, bias: false, tie: "0"}}
  loss: cross_entropy
"""


def write_h5(tensors, path, attrs=None):
    """/model/<name> float32 datasets, chunked whole with Fletcher-32 checksums as ddp_train writes
    them; written under a temporary name, then renamed."""
    import h5py

    tmp = f"{path}.tmp.{os.getpid()}"  # one per process: two runs may write the same file
    with h5py.File(tmp, "w", libver="latest") as f:
        g = f.create_group("model")
        for name, a in tensors.items():
            g.create_dataset(name, data=a.astype(np.float32), chunks=a.shape, fletcher32=True)
        for k, v in (attrs or {}).items():
            f.attrs[k] = v
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("src", help="pytorch_model.bin, model.safetensors or a directory holding one")
    ap.add_argument("out", help="the HDF5 file to write (model.init_from)")
    ap.add_argument("--heads", type=int, help="attention heads (default: config.json's n_head, else width / 64)")
    ap.add_argument("--seq-len", type=int, help="model.input [T] of the printed config (default: the context)")
    args = ap.parse_args()
    try:
        path, cfg_path = find_source(args.src)
        state = read_state(path)
        n_layer, tensors = convert(state)
    except (OSError, ValueError, RuntimeError) as e:
        sys.exit(f"import_gpt2.py: {args.src}: {e}")
    hf_cfg = {}
    if cfg_path:
        with open(cfg_path) as f:
            hf_cfg = json.load(f)
    vocab, dim = tensors["0.tok.weight"].shape
    max_len = tensors["0.pos.weight"].shape[0]
    hidden = tensors["2.body.1.weight"].shape[0] if n_layer else 4 * dim
    heads = args.heads or hf_cfg.get("n_head") or max(1, dim // 64)
    heads_from = "--heads" if args.heads else "config.json" if hf_cfg.get("n_head") else "width / 64"
    if dim % heads:
        sys.exit(f"import_gpt2.py: width {dim} is not a multiple of {heads} heads")
    act = hf_cfg.get("activation_function", "gelu_new")
    approximate = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}.get(act)
    if approximate is None:
        sys.exit(f"import_gpt2.py: activation_function {act} has no ddp_train layer (gelu_new, gelu)")
    eps = hf_cfg.get("layer_norm_epsilon", 1e-5)
    try:
        # what the tensors cannot tell, for export_torch.py --gpt2
        write_h5(tensors, args.out, {"source": os.path.abspath(path), "format": "GPT-2 (Hugging Face) imported",
                                     "n_head": heads, "layer_norm_epsilon": float(eps), "activation_function": act})
    except OSError as e:
        sys.exit(f"import_gpt2.py: {args.out}: {e}")
    n_params = sum(a.size for a in tensors.values())
    print(f"read {path}: GPT-2 with {n_layer} layers, width {dim}, {heads} heads ({heads_from}), "
          f"vocab {vocab}, context {max_len}")
    print(f"wrote {args.out}: {len(tensors)} tensors, {n_params:,} parameters (the head is tied to 0.tok.weight)")
    print("# the layers these tensors fit; use with --set model.init_from=" + args.out)
    print(model_yaml(n_layer, vocab, dim, heads, max_len, hidden, eps, approximate, args.seq_len), end="")


if __name__ == "__main__":
    main()
