#!/usr/bin/python3
"""PyTorch's training throughput on the model of a ddp_train config, for comparison in the same run.
usage: torch_train.py CONFIG.yaml BATCH STEPS THREADS [WINDOWS]  -> prints samples/s;
       for a token model (first layer `embedding`, e.g. configs/gpt_tiny.yaml) target tokens/s
WINDOWS (default 4) windows of STEPS steps, as ddp_train's logged windows in benchmarks/cpu_bench.sh: the
first is the warm-up, the figure is the median of the others, so both sides train the same number of steps.
Same model (scripts/ddp_model.py), same batch, float32, data already in memory (PyTorch's best case on
the CPU). Image and vector models: SGD with Nesterov momentum and weight decay, float tensors. Token
models: random token ids, a LongTensor (BATCH, T) of inputs and (BATCH, T) targets, the loss the
cross-entropy over the (BATCH*T, V) logits, and the config's AdamW (betas, eps, weight decay with the
optim.no_decay groups, ddp_model.param_groups) with train.clip_grad_norm, as ddp_train runs it."""
import os
import statistics
import sys
import time

import torch
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import ddp_model  # noqa: E402


def median_rate(step, steps, windows, units_per_step):
    """Runs `windows` windows of `steps` calls of step(), the first the warm-up; the median over the
    others of units_per_step x steps / seconds (torch_ddp_train.py times its windows the same way)."""
    for _ in range(steps):
        step()
    rates = []
    for _ in range(windows - 1):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(units_per_step * steps / (time.perf_counter() - t0))
    return statistics.median(rates)


def main():
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    cfg, batch, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    windows = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    if steps < 1 or windows < 2:
        sys.exit("torch_train.py: STEPS must be >= 1 and WINDOWS >= 2 (a warm-up window and a timed one)")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with open(cfg) as f:
        conf = yaml.safe_load(f)
    net, loss_fn = ddp_model.build_from_yaml(cfg)
    shape = ddp_model.input_shape(conf["model"]["input"])
    clip = 0.0
    per_sample = 1
    if ddp_model.is_token_model(conf["model"]):
        vocab = net[0].tok.weight.shape[0]
        x = torch.randint(0, vocab, (batch,) + shape)
        y = torch.randint(0, vocab, (batch,) + shape)
        per_sample = shape[0]  # target tokens per row
        o = conf.get("optim", {})
        wd = float(o.get("weight_decay", 0.0))
        opt = torch.optim.AdamW(ddp_model.param_groups(net, wd, o.get("no_decay") or ()), lr=1e-3,
                                betas=tuple(o.get("betas", (0.9, 0.999))), eps=float(o.get("eps", 1e-8)),
                                weight_decay=wd)
        clip = float(conf.get("train", {}).get("clip_grad_norm", 0.0))
    else:
        x = torch.randn((batch,) + shape)
        y = torch.randint(0, 10, (batch,))
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    params = list(net.parameters())
    net.train()

    def step():
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()

    print(f"{median_rate(step, steps, windows, batch * per_sample):.1f}")


if __name__ == "__main__":
    main()
