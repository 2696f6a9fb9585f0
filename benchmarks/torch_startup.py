#!/usr/bin/python3
"""What a PyTorch DDP script does before its first step, for benchmarks/startup.py:
  torchrun --standalone --nproc_per_node 2 torch_startup.py CONFIG.yaml
gloo process group, the config's training data read from its HDF5 file into memory and normalised
(as ddp_train's data.cache: memory), the model of scripts/ddp_model.py in DistributedDataParallel,
one SGD step on this rank's share of the global batch; rank 0 prints "step 1 loss X"."""
import os
import sys

import h5py
import numpy as np
import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import ddp_model  # noqa: E402


def main():
    cfg_path = sys.argv[1]
    with open(cfg_path) as f:
        conf = yaml.safe_load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    d = conf["data"]
    with h5py.File(d["path"], "r") as f:
        x = torch.from_numpy(f[d["train"]["x"]][...].astype(np.float32))
        y = torch.from_numpy(f[d["train"]["y"]][...].astype(np.int64))
    x = x * float(d.get("scale", 1.0))
    if "mean" in d:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        x = (x - torch.tensor(d["mean"]).reshape(shape)) / torch.tensor(d["std"]).reshape(shape)
    net, loss_fn = ddp_model.build_from_yaml(cfg_path)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    per_rank = int(conf["train"].get("global_batch_size", 256)) // world
    xb, yb = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    opt.zero_grad()
    loss = loss_fn(model(xb), yb)
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step 1 loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
