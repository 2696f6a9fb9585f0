"""--dry-run's memory estimate against the memory a run really holds, within 10%, for the default CNN
(configs/model.yaml), ResNet-18 (configs/resnet18_cifar.yaml), gpt_tiny (configs/gpt_tiny.yaml) and a
GPT-2-shaped model (2 blocks, 768 wide, 12 heads, vocabulary 50257 with the head tied, context 64),
on the CPU backend and on the GPU (the stand-in, tests/gpusim, in `make test`; a real GPU in
`make test-gpu`).

What is measured (src/memory.h): on the CPU, the rank's peak resident set above its resident set
after MPI and the libraries started and before the data and every buffer; on the GPU, the most
device memory the backend held by its own count, which must equal the stand-in's allocator
high-water mark above its context (GPUSIM_MEMORY_REPORT), an independent reference. The run writes
it in its last metrics.jsonl record ("mem_peak_mib"), beside the estimate it checked before
allocating, which must be --dry-run's.

Each run takes 2 optimizer steps and then evaluates (the peak needs the first backward, the
optimizer's state and evaluation's batch), and its batch keeps the activations at least a fifth of
the estimate (checked), so that 10% is not absorbed by the parts that are sure to be right (the
parameters and their gradients and optimizer state): 64 rows for the CNN (activations 63-88% of its
estimate), 8 for ResNet-18 (36-50%: its 11M parameters and their momentum are most of the rest), 8
and 4 sequences of 128 tokens for gpt_tiny (85-91%), 4 of 64 tokens for the GPT-2 shape on the CPU and 8
on the GPU (21% and 30%: its 54M parameters, their gradients and AdamW's state are most of the rest; its
activations are mostly the 50257-wide logits and their gradient; on the GPU the fused attention keeps no
(B, H, T, T) scores, which 4 sequences left at 19%), and 12 on the GPU in bf16 (23%: the logits and their
gradient, the MLPs' hidden activations and the attention's heads in bfloat16, half the bytes; 8 sequences left
them at 20%). The stand-in runs kernels thread by thread, so its batches
are what takes it a few seconds. More in CASES, one line each: the 16-bit convolution operands, the
bf16 gradient bucket, the EMA and the device cache on the GPU; checkpoints, two ranks' MPI sums and 4
threads (oneDNN's Winograd filter gradient touches a share of its per-thread copies) on the CPU. The
whole module takes about 100 s on the 2-core development machine (102 s in CI).

CASES is a list of Case: a new setting is a new line (train.recompute blocks has two), and each line
a test on the CPU and one on the GPU where it gives a batch for them."""
import os
import re
import unittest
from typing import NamedTuple, Optional

import h5py
import numpy as np

from helpers import BINARY, GPU_BINARY, ROOT, Workdir, gpu_setup, run

GPU_ENV, GPU_VISIBLE, SIM = gpu_setup(1)
TOLERANCE = 0.10
MIN_ACTIVATIONS = 0.2  # of the estimate

GPT2_SHAPED = """\
model:
  input: [64]
  layers:
    - embedding: {vocab: 50257, dim: 768, positions: true, max_len: 1024}
    - repeat:
        times: 2
        layers:
          - residual:
              body:
                - layernorm: {eps: 1.0e-5}
                - attention: {heads: 12, causal: true, dropout: 0.0}
          - residual:
              body:
                - layernorm: {eps: 1.0e-5}
                - linear: {out: 3072}
                - gelu: {approximate: tanh}
                - linear: {out: 768}
    - layernorm: {eps: 1.0e-5}
    - linear: {out: 50257, bias: false, tie: "0"}
  loss: cross_entropy
data: {train: {x: /train/tokens}, val: {x: /val/tokens}}
train: {clip_grad_norm: 1.0, seed: 1}
optim: {name: adamw, lr: 5.0e-5, weight_decay: 0.01, no_decay: [bias, norm, embedding]}
"""

IMAGES = ["data.train.x=/train/images", "data.train.y=/train/labels", "data.val.x=/test/images",
          "data.val.y=/test/labels"]


class Case(NamedTuple):
    """One comparison: config (a file under configs/ or a config's text), its --set overrides ({dir}: the
    work directory), its data (("images", shape) or ("tokens", (T, vocab))), the global batch on the CPU
    and on the GPU (None: no such test), and the ranks."""
    name: str
    config: str
    sets: list
    data: tuple
    cpu_batch: Optional[int]
    gpu_batch: Optional[int]
    ranks: int = 1


CASES = [
    # writes checkpoints: rank 0's copy and the file it builds in memory are part of the CPU's estimate
    Case("default_cnn", "model.yaml", IMAGES + ["checkpoint.dir={dir}/ckpt"], ("images", (1, 28, 28)), 64, 64),
    # 16-bit convolution operands, the bf16 gradient bucket, the EMA and the rows cached on the device
    Case("default_cnn_bf16", "model.yaml", IMAGES + ["train.precision=bf16", "dist.grad_dtype=bf16",
                                                     "train.ema.decay=0.999", "data.cache=device"],
         ("images", (1, 28, 28)), None, 64),
    Case("resnet18", "resnet18_cifar.yaml", IMAGES, ("images", (3, 32, 32)), 8, 8),
    # bf16: the 16-bit NHWC trunk (the residuals' sums, their gradients and the shortcuts' dx at 2 bytes a value)
    Case("resnet18_bf16", "resnet18_cifar.yaml", IMAGES + ["train.precision=bf16"], ("images", (3, 32, 32)), None, 8),
    # oneDNN's Winograd filter gradient books a copy per thread and touches a share of each (src/cpu/dnnl.c)
    Case("resnet18_4_threads", "resnet18_cifar.yaml", IMAGES + ["dist.threads=4"], ("images", (3, 32, 32)), 8, None),
    Case("gpt_tiny", "gpt_tiny.yaml", [], ("tokens", (128, 256)), 8, 4),
    Case("gpt2_shaped", GPT2_SHAPED, [], ("tokens", (64, 50257)), 4, 8),
    # bf16: the classifier's logits and dlogits, and the MLPs' hidden activations, in bfloat16 rows, with no copies
    Case("gpt2_shaped_bf16", GPT2_SHAPED, ["train.precision=bf16"], ("tokens", (64, 50257)), None, 12),
    # train.recompute blocks: the insides of the blocks in one region all blocks share
    Case("resnet18_recompute", "resnet18_cifar.yaml", IMAGES + ["train.recompute=blocks"], ("images", (3, 32, 32)),
         16, 16),
    Case("gpt_tiny_recompute", "gpt_tiny.yaml", ["train.recompute=blocks"], ("tokens", (128, 256)), 16, 8),
    # Open MPI's non-blocking sums of 9 buckets of gradients (the CPU's "MPI sums"): 6 sequences a rank
    Case("gpt2_shaped_2_ranks", GPT2_SHAPED, [], ("tokens", (64, 50257)), 12, None, ranks=2),
    # dist.zero 1: each rank keeps AdamW's moments and the EMA of half the parameters (on the GPU the
    # two ranks share the stand-in's GPU over MPI: the gradients and the gathered parameters through host memory)
    Case("gpt2_shaped_2_ranks_zero", GPT2_SHAPED, ["dist.zero=1", "train.ema.decay=0.999"], ("tokens", (64, 50257)),
         12, 8, ranks=2),
]


def estimate(out):
    """(total, activations) in MiB from --dry-run's "memory per rank" line."""
    m = re.search(r"memory per rank at .*?: ([0-9.]+) MiB = .* activations ([0-9.]+) ", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


class Estimate(unittest.TestCase):
    def setUp(self):
        self.w = Workdir()

    def tearDown(self):
        self.w.cleanup()

    def data(self, kind, shape, batch):
        """Enough rows for the steps and one evaluation chunk (the buffers' batch + 1 rows)."""
        path = self.w.file("data.h5")
        n, n_val = 3 * batch, batch + 1
        if kind == "images":
            self.w.dataset("data.h5", n=n, n_val=n_val, shape=shape, classes=10)
        else:
            t, vocab = shape
            rng = np.random.default_rng(0)
            with h5py.File(path, "w") as f:
                f["train/tokens"] = rng.integers(0, vocab, (n, t + 1)).astype(np.int32)
                f["val/tokens"] = rng.integers(0, vocab, (n_val, t + 1)).astype(np.int32)
        return path

    def check(self, case, gpu):
        batch = case.gpu_batch if gpu else case.cpu_batch
        cfg = os.path.join(ROOT, "configs", case.config)
        if not case.config.endswith(".yaml"):  # a config's text
            cfg = self.w.file("cfg.yaml")
            with open(cfg, "w") as f:
                f.write(case.config)
        sets = [f"data.path={self.data(*case.data, batch)}", f"train.global_batch_size={batch}", "train.max_steps=2",
                "train.epochs=1", f"log.dir={self.w.path}/log", "checkpoint.dir="]
        args = [cfg] + [a for s in sets + [s.format(dir=self.w.path) for s in case.sets] for a in ("--set", s)]
        binary, env = (GPU_BINARY, dict(GPU_ENV, GPUSIM_MEMORY_REPORT=self.w.file("sim.txt"))) if gpu else (BINARY, {})
        if gpu:
            args += ["--device", "cuda"]
        rc, out, err = run(args + ["--dry-run"], np_=case.ranks, binary=binary, env=env)
        self.assertEqual(rc, 0, out + err)
        total, activations = estimate(out)
        self.assertGreaterEqual(activations, MIN_ACTIVATIONS * total, f"activations are too small a part: {out}")
        rc, out, err = run(args, np_=case.ranks, binary=binary, env=env, timeout=300)
        self.assertEqual(rc, 0, out + err)
        rec = [r for r in self.w.metrics() if "mem_peak_mib" in r][-1]
        self.assertEqual(rec["mem_measured"], "device" if gpu else "host RSS")
        self.assertAlmostEqual(rec["mem_estimate_mib"], total, delta=0.06)  # the run's own check: the same estimate
        peak = rec["mem_peak_mib"]
        if gpu and SIM:  # the backend's count against the stand-in's allocator, to the byte (%.3f MiB)
            with open(self.w.file("sim.txt")) as f:
                line = [l for l in f if " peak " in l][-1].split()
            sim = (int(line[line.index("peak") + 1]) - int(line[line.index("context") + 1])) / 1048576
            self.assertAlmostEqual(peak, sim, delta=0.001, msg=line)
        print(f"# {case.name} on the {'GPU' if gpu else 'CPU'}: estimated {total:.1f} MiB (activations "
              f"{activations:.1f}), measured {peak:.1f} MiB, estimate/measured {total / peak:.3f}", flush=True)
        self.assertLessEqual(abs(total / peak - 1), TOLERANCE,
                             f"estimated {total} MiB, measured {peak} MiB ({total / peak - 1:+.1%}): {out}")


def add_cases():
    for case in CASES:
        if case.cpu_batch:
            setattr(Estimate, f"test_{case.name}_cpu", lambda self, case=case: self.check(case, gpu=False))
        if case.gpu_batch:
            setattr(Estimate, f"test_{case.name}_gpu",
                    unittest.skipUnless(GPU_VISIBLE, "no GPU visible (ddp_train --info)")(
                        lambda self, case=case: self.check(case, gpu=True)))


add_cases()

if __name__ == "__main__":
    unittest.main()
