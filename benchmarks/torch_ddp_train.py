#!/usr/bin/python3
"""PyTorch DDP's training throughput on the model of a ddp_train config: the twin of `make run`
(`mpirun -np 2 ./ddp_train configs/model.yaml`) in benchmarks/cpu_bench.sh.
usage: torch_ddp_train.py CONFIG.yaml GLOBAL_BATCH STEPS [WINDOWS [NPROC]]  -> prints samples/s
NPROC (default 2) processes started with torch.multiprocessing.spawn, one thread each
(torch.set_num_threads(1)), torch.distributed with the gloo backend over tcp://127.0.0.1:<a free port>,
each bound to one CPU (rank r to the r-th CPU this process may use, as mpirun binds ddp_train's ranks to
a core each) when there are enough. Same model (scripts/ddp_model.py) and optimizer as torch_train.py
(SGD, Nesterov momentum 0.9, weight decay 5e-4), float32, GLOBAL_BATCH / NPROC random samples per
process already in memory, DistributedDataParallel with broadcast_buffers=False (ddp_train's batchnorm
keeps each rank's running statistics, sync: false). WINDOWS (default 4) windows of STEPS steps timed on
rank 0: the first is the warm-up, the figure is the median of the others, in samples/s of the global
batch. Image and vector models only (the bench's DDP row is the default CNN)."""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import ddp_model  # noqa: E402
from torch_train import median_rate  # noqa: E402


def worker(rank, nproc, port, cfg, global_batch, steps, windows):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= nproc:
        os.sched_setaffinity(0, {cpus[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    net, loss_fn = ddp_model.build_from_yaml(cfg)
    net.train()
    model = DistributedDataParallel(net, broadcast_buffers=False)
    torch.manual_seed(1 + rank)  # each rank its own samples
    batch = global_batch // nproc
    with open(cfg) as f:
        shape = ddp_model.input_shape(yaml.safe_load(f)["model"]["input"])
    x = torch.randn((batch,) + shape)
    y = torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()  # the gradients averaged over the ranks in backward
        opt.step()

    rate = median_rate(step, steps, windows, batch * nproc)
    if rank == 0:
        print(f"{rate:.1f}", flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    if len(sys.argv) not in (4, 5, 6):
        sys.exit(__doc__)
    cfg, global_batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    windows = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    nproc = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    if steps < 1 or windows < 2 or nproc < 1 or global_batch % nproc:
        sys.exit("torch_ddp_train.py: STEPS >= 1, WINDOWS >= 2, and GLOBAL_BATCH a multiple of NPROC")
    with open(cfg) as f:
        if ddp_model.is_token_model(yaml.safe_load(f)["model"]):
            sys.exit(f"torch_ddp_train.py: {cfg} is a token model; only image and vector models are supported")
    # spawn raises ProcessRaisedException (a non-zero exit) when a rank fails
    mp.spawn(worker, args=(nproc, free_port(), cfg, global_batch, steps, windows), nprocs=nproc)


if __name__ == "__main__":
    main()
