#!/usr/bin/python3
"""Plots one or more metrics.jsonl files (ddp_train's log.dir) into one PNG: training loss,
validation accuracy (or loss for regression), learning rate and throughput against the step,
one line per run, for comparing runs at a glance.

usage: plot_metrics.py RUN/metrics.jsonl [MORE.jsonl ...] -o OUT.png [--labels a,b]"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    steps, evals = [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            (steps if "loss" in r else evals if "val_loss" in r else []).append(r)
    return steps, evals


def main():
    ap = argparse.ArgumentParser(description="Plot ddp_train metrics.jsonl files.")
    ap.add_argument("files", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--labels", help="comma-separated names for the runs (default: their directories)")
    args = ap.parse_args()
    labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.dirname(os.path.abspath(p))) or p
                                                          for p in args.files]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_loss, ax_val), (ax_lr, ax_tp) = axes
    for path, label in zip(args.files, labels):
        steps, evals = load(path)
        x = [r["step"] for r in steps]
        ax_loss.plot(x, [r["loss"] for r in steps], label=label)
        ax_lr.plot(x, [r["lr"] for r in steps], label=label)
        ax_tp.plot(x, [r["samples_per_s"] for r in steps], label=label)
        if evals and "val_acc" in evals[0]:
            ax_val.plot([r["step"] for r in evals], [100 * r["val_acc"] for r in evals], "o-", label=label)
            ax_val.set_ylabel("validation accuracy (%)")
        elif evals:
            ax_val.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label=label)
            ax_val.set_ylabel("validation loss")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_yscale("log")
    ax_lr.set_ylabel("learning rate")
    ax_tp.set_ylabel("samples/s")
    for ax in axes.flat:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("ddp_train: " + ", ".join(labels))
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
