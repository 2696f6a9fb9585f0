#!/usr/bin/python3
"""PyTorch's training throughput on the model of a ddp_train config, for comparison in the same run.
usage: torch_train.py CONFIG.yaml BATCH STEPS THREADS  -> prints samples/s (median of 3 windows)
Same model (scripts/ddp_model.py), same batch, SGD with Nesterov momentum and weight decay,
float32, data already in memory as float tensors (PyTorch's best case on the CPU)."""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import ddp_model  # noqa: E402


def main():
    cfg, batch, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net, loss_fn = ddp_model.build_from_yaml(cfg)
    shape = ddp_model.input_shape(__import__("yaml").safe_load(open(cfg))["model"]["input"])
    x = torch.randn((batch,) + shape)
    y = torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    net.train()

    def step():
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(3):  # warm-up
        step()
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(batch * steps / (time.perf_counter() - t0))
    print(f"{statistics.median(rates):.1f}")


if __name__ == "__main__":
    main()
