#!/usr/bin/env python3
"""Prints the README's table of GPT-2 memory per rank (124M, 355M, 774M, 1.5B at 8 x 1024 tokens a
rank, AdamW, fp32) under each train.recompute setting, from `ddp_train --dry-run`'s estimate, and with
blocks and dist.zero 1 on 8 ranks. The sizes are configs/gpt2_124m.yaml with GPT-2's widths, heads and
depths. Without ZeRO a rank holds the same whatever the world size, so one process gives the figure for 8
ranks; with it, rank 0 keeps AdamW's state for its eighth of the parameters (split_lo(n, 8, 1) of n, as
the binary splits them), the only part that changes. Without checkpoints: the copy
rank 0 makes while it writes one is host memory on a GPU (in the CPU backend's estimate, it is added).

    /usr/bin/python3 scripts/memory_table.py [./ddp_train]
"""
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [("GPT-2 124M", 768, 12, 12), ("GPT-2 355M", 1024, 16, 24), ("GPT-2 774M", 1280, 20, 36),
         ("GPT-2 1.5B", 1600, 25, 48)]
SETTINGS = ["none", "blocks"]
PARTS = re.compile(r"memory per rank at 8 rows of 1024 tokens: ([\d.]+) MiB = parameters ([\d.]+) \+ gradients "
                   r"([\d.]+) \+ optimizer ([\d.]+) \+ buffers [\d.]+ \+ activations ([\d.]+) ")


def config(dim, heads, blocks):
    with open(os.path.join(ROOT, "configs", "gpt2_124m.yaml")) as f:
        text = f.read()
    for old, new in (("dim: 768", f"dim: {dim}"), ("heads: 12", f"heads: {heads}"), ("times: 12", f"times: {blocks}"),
                     ("linear: {out: 3072}", f"linear: {{out: {4 * dim}}}"), ("linear: {out: 768}",
                                                                               f"linear: {{out: {dim}}}")):
        if text.count(old) != 1:
            sys.exit(f"memory_table.py: configs/gpt2_124m.yaml no longer has one '{old}'")
        text = text.replace(old, new)
    return text


def estimate(binary, path, recompute):
    """(total, parameters, gradients, optimizer, activations) in MiB, and the parameter count."""
    p = subprocess.run([binary, path, "--dry-run", "--set", "data.path=", "--set", "model.input=[1024]", "--set",
                        "train.batch_size=8", "--set", "train.grad_accum=1", "--set", f"train.recompute={recompute}",
                        "--set", "checkpoint.dir="],
                       capture_output=True, text=True, cwd=ROOT)
    m = PARTS.search(p.stdout)
    n = re.search(r"total parameters: ([\d,]+)", p.stdout)
    if not m or not n:  # a machine too small for the estimate still prints it before refusing
        sys.exit(f"memory_table.py: no estimate from {binary}:\n{p.stdout}{p.stderr}")
    return tuple(float(x) for x in m.groups()), int(n[1].replace(",", ""))


def gib(mib):
    return f"{mib / 1024:.1f}"


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "ddp_train")
    print("| model (parameters) | weights, gradients, AdamW (GiB) | activations, `recompute: none` | total | "
          "activations, `recompute: blocks` | total | total, `dist.zero: 1` on 8 ranks | total, `blocks` and "
          "`dist.zero: 1` on 8 ranks |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="ddp_train_memory_") as tmp:
        for name, dim, heads, blocks in SIZES:
            path = os.path.join(tmp, "gpt2.yaml")
            with open(path, "w") as f:
                f.write(config(dim, heads, blocks))
            got = {r: estimate(binary, path, r) for r in SETTINGS}
            (total, params, grads, optim, _), n = got["none"]
            cells = [f"{name} ({n:,})", gib(params + grads + optim)]
            for r in SETTINGS:
                cells += [gib(got[r][0][4]), gib(got[r][0][0])]
            for r in SETTINGS:  # rank 0's eighth of AdamW's state instead of all of it
                cells.append(gib(got[r][0][0] - optim + optim * (n * 1 // 8) / n))
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
