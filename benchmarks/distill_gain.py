#!/usr/bin/python3
"""What distillation buys: a student trained alone and the same student taught by a frozen teacher,
with the same recipe and epochs, over several seeds, on the same machine and ranks. Prints a Markdown
table of the final validation metric of each run and the step time, whose difference is the
teacher's forward.

    benchmarks/distill_gain.py fmnist            # configs/distill_fmnist.yaml: test accuracy
    benchmarks/distill_gain.py gpt --seeds 1 2   # configs/distill_gpt_tiny.yaml: validation loss

The teacher is trained first with its own config when its best.h5 is missing: `make run`'s
configs/model.yaml (3 epochs), or configs/gpt_tiny.yaml for 2 epochs (after 1 its 4 blocks are still
behind a 2-block model's). Runs go under runs/distill_gain/.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# config, metric, its name, which way is better, the teacher's own run's extra settings
CASES = {"fmnist": ("configs/distill_fmnist.yaml", "val_acc", "test accuracy", "higher", []),
         "gpt": ("configs/distill_gpt_tiny.yaml", "val_loss", "validation loss", "lower",
                 ["--set", "train.epochs=2"])}
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def ddp_train(np_, args):
    cmd = ["mpirun", "--oversubscribe", "-np", str(np_), "./ddp_train"] + args
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, stdout=subprocess.DEVNULL)


def results(log_dir, metric):
    """(the last evaluation's metric, the median step time in ms past the first 10 logged steps)."""
    with open(os.path.join(ROOT, log_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    final = [r[metric] for r in recs if metric in r][-1]
    steps = [r["step_ms"] for r in recs if "step_ms" in r]
    return final, statistics.median(steps[10:] or steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    config, metric, what, better, teacher_sets = CASES[a.case]
    with open(os.path.join(ROOT, config)) as f:
        cfg = yaml.safe_load(f)
    teacher, weights = cfg["distill"]["teacher"], cfg["distill"]["weights"]
    if not os.path.exists(os.path.join(ROOT, weights)):
        ddp_train(a.np, [teacher, "--device", a.device, "--set", "checkpoint.best=true"] + teacher_sets)
    rows = []
    for seed in a.seeds:
        row = [seed]
        for taught in (False, True):
            out = f"runs/distill_gain/{a.case}-{'taught' if taught else 'alone'}-{seed}"
            sets = ["--set", f"train.seed={seed}", "--set", f"log.dir={out}", "--set", f"checkpoint.dir={out}",
                    "--set", "log.every_steps=10"]
            if not taught:
                sets += ["--set", "distill.teacher="]
            ddp_train(a.np, [config, "--device", a.device] + sets)
            row += list(results(out, metric))
        rows.append(row)
    print(f"{config} on {a.np} ranks ({a.device}), teacher {teacher} from {weights}; {what} ({better} is better) "
          f"after {cfg['train']['epochs']} epoch(s)\n")
    print(f"| seed | alone | taught | gain | step ms alone | step ms taught |")
    print("|---|---|---|---|---|---|")
    for seed, alone, ms_alone, taught, ms_taught in rows:
        print(f"| {seed} | {alone:.4f} | {taught:.4f} | {taught - alone:+.4f} | {ms_alone:.1f} | {ms_taught:.1f} |")
    mean = lambda i: statistics.mean(r[i] for r in rows)
    print(f"| mean | {mean(1):.4f} | {mean(3):.4f} | {mean(3) - mean(1):+.4f} | {mean(2):.1f} | {mean(4):.1f} |")
    print(f"\na taught step takes {mean(4) / mean(2):.2f}x as long as a step alone: the teacher's forward adds "
          f"{mean(4) - mean(2):.1f} ms")


if __name__ == "__main__":
    main()
