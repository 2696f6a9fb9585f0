#!/usr/bin/python3
"""PyTorch's training throughput on a GPU for the model of a ddp_train config, for benchmarks/gpu_bench.sh.

usage: torch_gpu_train.py CONFIG.yaml BATCH PRECISION STEPS WINDOWS
         -> one tab-separated line: eager samples/s, best samples/s, best setting, every setting's result
       torch_gpu_train.py --first-step CONFIG.yaml BATCH PRECISION
         -> "ready" once torch is imported and the model, data and optimizer are on the device, then
            "first step" once the first training step has finished (the launch-to-first-step row)

Same model (scripts/ddp_model.py) and optimizer as torch_train.py (SGD, Nesterov momentum, weight decay),
synthetic data already on the device, cudnn.benchmark on (off for --first-step, as PyTorch's default).
PRECISION as ddp_train's train.precision: fp32 (TF32 off for matrix products and convolutions), tf32
(torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32), bf16 (autocast to bfloat16,
convolutional models in channels_last).

Settings, each in a process of its own (BENCH_TORCH_SETTINGS, space-separated, this order by default):
  eager            the model as built
  channels-last    eager with the model and input in channels_last (convolutional models; bf16's eager has it)
  cuda-graph       the whole step (forward, backward, optimizer) captured once with torch.cuda.graph, replayed
  reduce-overhead  torch.compile(model, mode="reduce-overhead"): Inductor kernels replayed as CUDA graphs
  max-autotune     torch.compile(model, mode="max-autotune"): also autotunes matrix products and convolutions
"Best" is the fastest that ran; one that is unavailable (torch.compile before PyTorch 2, CUDA graphs
without CUDA) or fails is skipped and named with the reason. Each setting: warm-up steps (compilation
and capture happen there), then the median of WINDOWS timed windows of STEPS steps, each window between
torch.cuda.synchronize() calls. BENCH_TORCH_DEVICE=cpu runs everything on the CPU (smoke tests without CUDA).
"""
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import ddp_model  # noqa: E402

SETTINGS = ("eager", "channels-last", "cuda-graph", "reduce-overhead", "max-autotune")
DEVICE = os.environ.get("BENCH_TORCH_DEVICE", "cuda")


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Bench:
    """The model, optimizer and one synthetic batch on DEVICE, and a training step."""

    def __init__(self, cfg, batch, precision, setting, benchmark=True):
        if precision not in ("fp32", "tf32", "bf16"):
            raise SystemExit(f"torch_gpu_train: precision {precision}: fp32, tf32 or bf16")
        torch.manual_seed(0)
        if DEVICE == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
            torch.backends.cudnn.allow_tf32 = precision == "tf32"
            torch.backends.cudnn.benchmark = benchmark
        with open(cfg) as f:
            shape = ddp_model.input_shape(yaml.safe_load(f)["model"]["input"])
        net, self.loss_fn = ddp_model.build_from_yaml(cfg)
        conv = any(isinstance(m, nn.Conv2d) for m in net.modules())
        fmt = torch.channels_last if conv and (precision == "bf16" or setting == "channels-last") else None
        classes = [m for m in net.modules() if isinstance(m, nn.Linear)][-1].out_features
        self.net = net.to(DEVICE, memory_format=fmt) if fmt else net.to(DEVICE)
        self.net.train()
        self.x = torch.randn((batch,) + shape, device=DEVICE)
        if fmt:
            self.x = self.x.contiguous(memory_format=fmt)
        self.y = torch.randint(0, classes, (batch,), device=DEVICE)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
        self.bf16 = precision == "bf16"
        self.model = self.net
        self.mark = None  # torch.compile: marks each step for CUDA graph trees

    def step(self):
        if self.mark:
            self.mark()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss_fn(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()

    def capture(self):
        """Captures the whole step as one CUDA graph (the whole-network capture of PyTorch's CUDA
        semantics notes); returns the replay function."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (cuDNN choices, optimizer state) outside the capture
            for _ in range(3):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)  # gradients then live in the graph's memory pool
        with torch.cuda.graph(graph):  # autocast's weight cache must be off inside a capture
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=False):
                loss = self.loss_fn(self.model(self.x), self.y)
            loss.backward()
            self.opt.step()
        return graph.replay

    def compile(self, mode):
        torch._dynamo.reset()
        self.model = torch.compile(self.net, mode=mode)
        self.mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)


def unavailable(setting, cfg, precision):
    """Why a setting cannot run here, or None."""
    if setting not in SETTINGS:
        return f"unknown setting (one of {', '.join(SETTINGS)})"
    if setting == "channels-last":
        with open(cfg) as f:
            layers = str(yaml.safe_load(f)["model"]["layers"])
        if "conv2d" not in layers:
            return "no convolutions"
        if precision == "bf16":
            return "bf16's eager is channels_last already"
    if setting == "cuda-graph" and DEVICE != "cuda":
        return "needs CUDA"
    if setting in ("reduce-overhead", "max-autotune") and not hasattr(torch, "compile"):
        return f"torch.compile needs PyTorch 2 (this is {torch.__version__})"
    return None


def measure(cfg, batch, precision, setting, steps, windows):
    """samples/s of one setting: the median of the timed windows."""
    b = Bench(cfg, batch, precision, setting)
    run = b.step
    if setting == "cuda-graph":
        run = b.capture()
    elif setting in ("reduce-overhead", "max-autotune"):
        b.compile(setting)
    for _ in range(max(steps, 3)):  # warm-up: compilation, capture, cudnn.benchmark's search
        run()
    sync()
    rates = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        sync()
        rates.append(batch * steps / (time.perf_counter() - t0))
    return statistics.median(rates)


def first_step(cfg, batch, precision):
    """As a first run would: PyTorch's defaults (no cudnn.benchmark search), eager."""
    b = Bench(cfg, batch, precision, "eager", benchmark=False)
    sync()
    print("ready", flush=True)
    b.step()
    sync()
    print("first step", flush=True)


def main():
    args = sys.argv[1:]
    if args and args[0] == "--first-step":
        cfg, batch, precision = args[1], int(args[2]), args[3]
        return first_step(cfg, batch, precision)
    if args and args[0] == "--setting":  # one setting, in its own process: prints samples/s
        setting, cfg, batch, precision, steps, windows = args[1:7]
        print(f"{measure(cfg, int(batch), precision, setting, int(steps), int(windows)):.1f}")
        return 0
    if len(args) != 5:
        raise SystemExit(__doc__.split("\n\n")[1])
    cfg, batch, precision, steps, windows = args
    results, skipped, notes = {}, {}, []
    for setting in os.environ.get("BENCH_TORCH_SETTINGS", " ".join(SETTINGS)).split():
        why = unavailable(setting, cfg, precision)
        if why is None:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--setting", setting, cfg, batch, precision,
                                steps, windows], capture_output=True, text=True)
            if p.returncode == 0:
                results[setting] = float(p.stdout.split()[-1])
                notes.append(f"{setting} {results[setting]:.1f}")
                continue
            err = [l for l in p.stderr.splitlines() if l.strip()]
            why = f"failed: {err[-1] if err else 'exit ' + str(p.returncode)}"
            print(f"torch_gpu_train: {setting} on {cfg} ({precision}, batch {batch}):\n{p.stderr}", file=sys.stderr)
        skipped[setting] = why
        notes.append(f"{setting} skipped: {why}")
    if not results:
        raise SystemExit(f"torch_gpu_train: no setting ran: {'; '.join(notes)}")
    best = max(results, key=results.get)
    label = best
    compiled = [s for s in ("reduce-overhead", "max-autotune") if s in skipped]
    if compiled and not any(s in results for s in ("reduce-overhead", "max-autotune")):
        label += " (torch.compile " + ("unavailable" if not hasattr(torch, "compile") else "failed") + ")"
    eager = f"{results['eager']:.1f}" if "eager" in results else "-"
    print(f"{eager}\t{results[best]:.1f}\t{label}\t{'; '.join(notes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
