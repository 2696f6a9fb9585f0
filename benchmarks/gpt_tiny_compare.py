#!/usr/bin/python3
"""The gpt_tiny recipe in ddp_train and in PyTorch, in one run (make bench-gpt): final validation loss,
wall time and tokens/s of each, and PASS/FAIL for "ddp_train's validation loss within 2% of PyTorch's".

    /usr/bin/python3 benchmarks/gpt_tiny_compare.py [--config configs/gpt_tiny.yaml] [--np 2]
        [--threads 2] [--max-steps N] [--same-init] [--keep DIR] [--tolerance 0.02]

ddp_train: `mpirun --oversubscribe -np 2 ./ddp_train configs/gpt_tiny.yaml` with the config's own recipe,
its log and checkpoints in a temporary directory (--set log.dir=... checkpoint.dir=...); every rank
has cores / ranks threads (dist.threads 0), 1 each on a 2-core machine.

PyTorch: one process with --threads threads (torch.set_num_threads; default the number of cores, the
same cores ddp_train's ranks use), the twin of scripts/ddp_model.py (same parameter names, same
initial distributions: embeddings N(0, 0.02), linear and attention weights and biases uniform
+-1/sqrt(fan_in), layernorm 1 and 0), float32, the same recipe read from the same YAML:
torch.optim.AdamW with the config's betas, eps and weight decay, the decay exempted as optim.no_decay
says (ddp_model.param_groups), the learning rate of src/optim.c schedule_lr set before every step
(cosine: lr (t+1)/warmup for t < warmup, then min_lr + (lr - min_lr)/2 (1 + cos(pi (t - warmup) /
(total - warmup))), t the 0-based optimizer step, total the steps of the run), clip_grad_norm_ with
train.clip_grad_norm, the global batch of train.global_batch_size rows (the last batch of an epoch
partial, data.drop_last false), the rows shuffled every epoch (torch.randperm with train.seed; not
ddp_train's permutation), the loss the mean cross-entropy over every target token of the batch.
With one process the global batch is one batch, so no gradient averaging is involved.

Both final models are evaluated by the same code here (the twin loads ddp_train's last checkpoint with
ddp_model.load_h5): the mean cross-entropy per token over every token of /val/tokens. ddp_train's own
end-of-epoch val_loss is printed beside it as a check.

Times: "wall" is from the launch of the process (mpirun; the PyTorch subprocess, import torch included)
to its exit; ddp_train's includes its own end-of-epoch validation and checkpoint writes. "train" is the
training loop alone (ddp_train: the sum of its logged windows, step_ms x steps; PyTorch: the loop
timed with perf_counter), and tokens/s = target tokens trained / train.

--same-init starts both from the same weights: the twin's initial weights are written with
ddp_model.save_h5 and given to ddp_train as model.init_from (to tell the initialisation apart from
the rest); --seed N replaces train.seed on both sides; --seeds 1,2,3 runs one pair per seed and decides
PASS/FAIL on the two means (one run's final loss moves by a few per cent with the seed on either side,
as much as the tolerance); --ddp-order makes the twin take the rows in ddp_train's order (its src/sampler.c permutation,
reproduced here) instead of torch.randperm's: with both, the two runs differ only in arithmetic, and
their first steps agree to ~1e-5. --max-steps N caps both runs at N optimizer steps (train.max_steps; the schedule then
spans N steps on both sides): a quick check, not the recipe. Exit status 0 on PASS, 1 on FAIL.
"""
import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def recipe(cfg_path, seed=None):
    import yaml

    with open(cfg_path) as f:
        cfg = yaml.safe_load(f)
    if seed is not None:
        cfg.setdefault("train", {})["seed"] = seed
    tr, op, data = cfg.get("train", {}), cfg.get("optim", {}), cfg["data"]
    sch = op.get("schedule", {}) or {}
    if op.get("name") != "adamw":
        raise SystemExit(f"gpt_tiny_compare: {cfg_path}: optim.name {op.get('name')}: only adamw is mirrored")
    if tr.get("grad_accum", 1) != 1 or not tr.get("global_batch_size"):
        raise SystemExit(f"gpt_tiny_compare: {cfg_path}: needs train.global_batch_size and grad_accum 1")
    if data.get("drop_last", False) or not data.get("shuffle", True):
        raise SystemExit(f"gpt_tiny_compare: {cfg_path}: mirrors data.shuffle true, data.drop_last false only")
    return {
        "path": os.path.join(ROOT, data["path"]) if not os.path.isabs(data["path"]) else data["path"],
        "train": data["train"]["x"], "val": data["val"]["x"],
        "epochs": int(tr.get("epochs", 1)), "batch": int(tr["global_batch_size"]),
        "clip": float(tr.get("clip_grad_norm", 0)), "seed": int(tr.get("seed", 0)),
        "max_steps": int(tr.get("max_steps", 0)),
        "lr": float(op.get("lr", 0.01)), "betas": tuple(float(b) for b in op.get("betas", [0.9, 0.999])),
        "eps": float(op.get("eps", 1e-8)), "wd": float(op.get("weight_decay", 0)),
        "no_decay": tuple(op.get("no_decay", []) or []),
        "schedule": sch.get("name", "constant"), "warmup": int(sch.get("warmup_steps", 0)),
        "min_lr": float(sch.get("min_lr", 0)),
    }


def schedule_lr(r, t, total):
    """src/optim.c schedule_lr for the constant and cosine schedules; t is the 0-based step."""
    if r["schedule"] == "constant":
        return r["lr"]
    if r["schedule"] != "cosine":
        raise SystemExit(f"gpt_tiny_compare: schedule {r['schedule']} is not mirrored (constant, cosine)")
    w = r["warmup"]
    if t < w:
        return r["lr"] * (t + 1) / w
    span = total - w
    pct = min((t - w) / span, 1.0) if span > 0 else 1.0
    return r["min_lr"] + (r["lr"] - r["min_lr"]) / 2 * (math.cos(math.pi * pct) + 1)


M64 = (1 << 64) - 1


def hash64(x):
    """src/hash.h dt_hash64 (splitmix64's finaliser)."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def ddp_permutation(n, seed, epoch):
    """ddp_train's order of the rows in an epoch (src/sampler.c, data.sharding global): its global batch
    s is rows [s G, (s + 1) G) of this list, whatever the number of ranks."""
    key = hash64(((seed * 0x100000001B3) & M64) ^ hash64(epoch + 0x5151))
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = (hash64(key ^ hash64(i)) * (i + 1)) >> 64
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def twin_train(args):
    """The PyTorch side, in a process of its own: prints one JSON line."""
    import h5py
    import torch

    import ddp_model

    torch.set_num_threads(args.threads)
    r = recipe(args.config, args.seed)
    torch.manual_seed(r["seed"])
    model, loss_fn = ddp_model.build_from_yaml(args.config)
    if args.init_out:
        ddp_model.save_h5(model, args.init_out)
    with h5py.File(r["path"], "r") as f:
        rows = torch.from_numpy(f[r["train"]][...].astype("int64"))
    n, g = rows.shape[0], r["batch"]
    per_epoch = (n + g - 1) // g
    total = per_epoch * r["epochs"]
    cap = args.max_steps or r["max_steps"]
    if cap:
        total = min(total, cap)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(ddp_model.param_groups(model, r["wd"], r["no_decay"]), lr=r["lr"], betas=r["betas"],
                            eps=r["eps"], weight_decay=r["wd"])
    gen = torch.Generator().manual_seed(r["seed"])
    model.train()
    step, tokens, window, curve = 0, 0, [], []
    t0 = time.perf_counter()
    epoch = 0
    while step < total:
        if args.ddp_order:
            perm = torch.tensor(ddp_permutation(n, r["seed"], epoch))
        else:
            perm = torch.randperm(n, generator=gen)
        epoch += 1
        for b in range(per_epoch):
            if step >= total:
                break
            batch = rows[perm[b * g:(b + 1) * g]]
            x, y = batch[:, :-1], batch[:, 1:]
            lr = schedule_lr(r, step, total)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            if r["clip"] > 0:
                torch.nn.utils.clip_grad_norm_(params, r["clip"])
            opt.step()
            step += 1
            tokens += y.numel()
            window.append(loss.item())
            if step % args.every == 0 or step == total:
                curve.append((step, statistics.fmean(window)))
                window = []
    train_s = time.perf_counter() - t0
    ddp_model.save_h5(model, args.out)
    print(json.dumps({"steps": step, "tokens": tokens, "train_s": train_s, "curve": curve}))


def evaluate(cfg, r, weights, threads):
    """Mean cross-entropy per target token over every row of the validation set."""
    import h5py
    import torch
    import torch.nn.functional as F

    import ddp_model

    torch.set_num_threads(threads)
    model, _ = ddp_model.build_from_yaml(cfg)
    ddp_model.load_h5(model, weights)
    model.eval()
    with h5py.File(r["path"], "r") as f:
        rows = f[r["val"]][...]
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), 128):
            x, y = ddp_model.token_rows(rows[i:i + 128])
            z = model(x)
            total += F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction="sum").item()
            count += y.numel()
    return total / count, count


def run_ddp(args, r, tmp, init):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    log, ck = os.path.join(tmp, "ddp_log"), os.path.join(tmp, "ddp_ckpt")
    cmd = [os.environ.get("MPIRUN", "mpirun"), "--oversubscribe", "-np", str(args.np), args.binary, args.config, "--device", "cpu",
           "--set", f"log.dir={log}", "--set", f"checkpoint.dir={ck}", "--set", f"log.every_steps={args.every}"]
    if args.max_steps:
        cmd += ["--set", f"train.max_steps={args.max_steps}"]
    if args.seed is not None:
        cmd += ["--set", f"train.seed={args.seed}"]
    if init:
        cmd += ["--set", f"model.init_from={init}"]
    print("ddp_train:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    with open(os.path.join(tmp, "ddp_out.txt"), "w") as f:
        f.write(p.stdout)
    if p.returncode != 0:
        sys.stdout.write(p.stdout)
        raise SystemExit(f"gpt_tiny_compare: ddp_train exited {p.returncode}")
    rows = [json.loads(l) for l in open(os.path.join(log, "metrics.jsonl"))]
    windows = [x for x in rows if "step_ms" in x]
    train_s, last = 0.0, 0
    for x in windows:
        train_s += x["step_ms"] / 1e3 * (x["step"] - last)
        last = x["step"]
    own_val = [x["val_loss"] for x in rows if "val_loss" in x]
    ckpts = sorted(glob.glob(os.path.join(ck, "step-*.h5")))
    if not ckpts:
        raise SystemExit(f"gpt_tiny_compare: no checkpoint in {ck}")
    return {"wall_s": wall, "train_s": train_s, "steps": last, "curve": [(x["step"], x["loss"]) for x in windows],
            "own_val": own_val[-1] if own_val else None, "weights": ckpts[-1],
            "tokens_per_s_logged": statistics.median(x["tokens_per_s"] for x in windows if "tokens_per_s" in x)}


def run_twin(args, r, tmp):
    out = os.path.join(tmp, "torch_final.h5")
    init = os.path.join(tmp, "torch_init.h5") if args.same_init else ""
    cmd = [sys.executable, os.path.abspath(__file__), "--twin", "--config", args.config, "--threads",
           str(args.threads), "--every", str(args.every), "--out", out, "--max-steps", str(args.max_steps)]
    if init:
        cmd += ["--init-out", init]
    if args.ddp_order:
        cmd += ["--ddp-order"]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    print("PyTorch:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"gpt_tiny_compare: the PyTorch twin exited {p.returncode}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res.update(wall_s=wall, weights=out, init=init)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/gpt_tiny.yaml")
    ap.add_argument("--binary", default=os.environ.get("DDP_TRAIN_BINARY", "./ddp_train"))
    ap.add_argument("--np", type=int, default=2, help="ddp_train ranks (2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="PyTorch threads (the cores)")
    ap.add_argument("--max-steps", type=int, default=0, help="cap both runs at N steps (a quick check)")
    ap.add_argument("--every", type=int, default=50, help="loss-curve window in steps (log.every_steps)")
    ap.add_argument("--same-init", action="store_true", help="start ddp_train from the twin's initial weights")
    ap.add_argument("--ddp-order", action="store_true",
                    help="the twin takes the rows in ddp_train's order (src/sampler.c) instead of torch.randperm's")
    ap.add_argument("--seed", type=int, help="train.seed for both (initialisation and order) instead of the config's")
    ap.add_argument("--seeds", help="comma-separated train.seed values: one pair of runs each, PASS/FAIL on the means")
    ap.add_argument("--tolerance", type=float, default=0.02, help="PASS when |ddp - torch| / torch <= this")
    ap.add_argument("--keep", help="a directory to keep the logs and weights in (default a temporary one)")
    ap.add_argument("--twin", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--init-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.chdir(ROOT)
    if args.twin:
        return twin_train(args)
    tmpobj = None
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        tmp = args.keep
    else:
        tmpobj = tempfile.TemporaryDirectory(prefix="gpt_tiny_compare_")
        tmp = tmpobj.name
    if not args.seeds:
        ddp_val, torch_val = compare(args, tmp)
    else:  # one pair of runs per seed, PASS/FAIL on the means
        pairs = []
        for seed in [int(x) for x in args.seeds.split(",")]:
            args.seed = seed
            print(f"\n== train.seed {seed}", flush=True)
            d = os.path.join(tmp, f"seed{seed}")
            os.makedirs(d, exist_ok=True)
            pairs.append((seed,) + compare(args, d))
        print(f"\n== {len(pairs)} seeds\n")
        print("| train.seed | ddp_train val loss | PyTorch val loss | relative difference |")
        print("|---|---|---|---|")
        for seed, a, b in pairs:
            print(f"| {seed} | {a:.4f} | {b:.4f} | {100 * (a - b) / b:+.2f}% |")
        ddp_val = statistics.fmean(a for _, a, _ in pairs)
        torch_val = statistics.fmean(b for _, _, b in pairs)
        sd = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
        print(f"| mean (standard deviation) | {ddp_val:.4f} ({sd([a for _, a, _ in pairs]):.4f}) | "
              f"{torch_val:.4f} ({sd([b for _, _, b in pairs]):.4f}) | {100 * (ddp_val - torch_val) / torch_val:+.2f}% |")
    rel = (ddp_val - torch_val) / torch_val
    ok = abs(rel) <= args.tolerance
    print(f"\nddp_train within {100 * args.tolerance:g}% of PyTorch{' (the means)' if args.seeds else ''}: "
          f"{'PASS' if ok else 'FAIL'}")
    if args.keep:
        print(f"\nlogs and weights kept in {tmp}")
    return 0 if ok else 1


def compare(args, tmp):
    """One pair of runs with train.seed args.seed (None: the config's); prints their table, returns the
    two validation losses."""
    r = recipe(args.config, args.seed)
    # PyTorch first when ddp_train starts from its initial weights; else ddp_train first
    if args.same_init:
        torch_res = run_twin(args, r, tmp)
        ddp_res = run_ddp(args, r, tmp, torch_res["init"])
    else:
        ddp_res = run_ddp(args, r, tmp, "")
        torch_res = run_twin(args, r, tmp)
    ddp_val, count = evaluate(args.config, r, ddp_res["weights"], args.threads)
    torch_val, _ = evaluate(args.config, r, torch_res["weights"], args.threads)
    rel = (ddp_val - torch_val) / torch_val
    tokens = torch_res["tokens"]
    print()
    print(f"gpt_tiny recipe ({args.config}, train.seed {r['seed']}): {ddp_res['steps']} steps of a global batch of "
          f"{r['batch']} rows, {tokens:,} target tokens; validation: {count:,} tokens of {r['val']}"
          f"{'; both from the same initial weights' if args.same_init else ''}"
          f"{'; the twin in ddp_train order' if args.ddp_order else ''}")
    print()
    print("| run | final val loss | wall s | train s | tokens/s |")
    print("|---|---|---|---|---|")
    threads = max(1, (os.cpu_count() or 1) // args.np)
    print(f"| ddp_train, mpirun -np {args.np}, {threads} thread{'s' if threads > 1 else ''} per rank"
          f" | {ddp_val:.4f} | {ddp_res['wall_s']:.1f} | {ddp_res['train_s']:.1f} | {tokens / ddp_res['train_s']:.0f} |")
    print(f"| PyTorch {__import__('torch').__version__}, 1 process, {args.threads} threads"
          f" | {torch_val:.4f} | {torch_res['wall_s']:.1f} | {torch_res['train_s']:.1f} |"
          f" {tokens / torch_res['train_s']:.0f} |")
    print()
    print(f"relative difference (ddp_train - PyTorch) / PyTorch: {100 * rel:+.2f}% "
          f"(ddp_train's own end-of-epoch val_loss: {ddp_res['own_val']})")
    print()
    print("training loss, mean of each window (step: ddp_train / PyTorch):")
    tc = dict((s, l) for s, l in torch_res["curve"])
    print("  " + ", ".join(f"{s}: {l:.4f}/{tc[s]:.4f}" if s in tc else f"{s}: {l:.4f}/-" for s, l in ddp_res["curve"]))
    return ddp_val, torch_val


if __name__ == "__main__":
    sys.exit(main())
