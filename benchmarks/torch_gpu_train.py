#!/usr/bin/python3
"""PyTorch's training throughput on a GPU for the model of a ddp_train config, for benchmarks/gpu_bench.sh.

usage: torch_gpu_train.py [--seq T] CONFIG.yaml BATCH PRECISION STEPS WINDOWS
         -> one tab-separated line: eager samples/s, best samples/s, best setting, every setting's result
            (a token model: target tokens/s instead of samples/s; --seq T replaces model.input with [T])
       torch_gpu_train.py --flops-per-token CONFIG.yaml T
         -> the training FLOPs per token of a token model at sequence length T (the MFU of the GPT rows)
       torch_gpu_train.py --first-step CONFIG.yaml BATCH PRECISION
         -> "ready" once torch is imported and the model, data and optimizer are on the device, then
            "first step" once the first training step has finished (the launch-to-first-step row)

Same model (scripts/ddp_model.py) and optimizer as torch_train.py (SGD, Nesterov momentum, weight decay),
synthetic data already on the device, cudnn.benchmark on (off for --first-step, as PyTorch's default).
Token models (the first layer `embedding`, e.g. configs/gpt2_124m.yaml): random token ids, a LongTensor
(BATCH, T) of inputs and one of targets, the cross-entropy over the (BATCH*T, V) logits; the config's
AdamW (betas, eps, weight decay with the optim.no_decay groups of ddp_model.param_groups; fused=True where
this PyTorch has it, capturable=True for cuda-graph) and train.clip_grad_norm, as ddp_train runs them.
PRECISION as ddp_train's train.precision: fp32 (TF32 off for matrix products and convolutions), tf32
(torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32), bf16 (autocast to bfloat16,
convolutional models in channels_last).

Settings, each in a process of its own (BENCH_TORCH_SETTINGS, space-separated, this order by default):
  eager            the model as built
  channels-last    eager with the model and input in channels_last (convolutional models; bf16's eager has it)
  sdpa             eager with the attention computed by F.scaled_dot_product_attention (flash or
                   memory-efficient kernels; PyTorch 2); the torch.compile settings use it too where it exists
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
import torch.nn.functional as F
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import ddp_model  # noqa: E402

SETTINGS = ("eager", "channels-last", "sdpa", "cuda-graph", "reduce-overhead", "max-autotune")
DEVICE = os.environ.get("BENCH_TORCH_DEVICE", "cuda")


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def load_config(cfg, seq=None):
    """The config as a dict; seq replaces a token model's model.input ([T])."""
    with open(cfg) as f:
        conf = yaml.safe_load(f)
    if seq:
        conf["model"]["input"] = [int(seq)]
    return conf


def sdpa_forward(self, x):
    """ddp_model.Attention's forward through F.scaled_dot_product_attention (same math)."""
    b, t, c = x.shape
    hd = c // self.heads
    q, k, v = self.qkv(x).split(c, dim=2)
    q, k, v = (z.reshape(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.drop.p if self.training else 0.0,
                                       is_causal=self.causal)
    return self.proj(y.transpose(1, 2).reshape(b, t, c))


def use_sdpa(net):
    """Switches every attention layer to sdpa_forward; returns how many (0 without PyTorch 2's sdpa)."""
    if not hasattr(F, "scaled_dot_product_attention"):
        return 0
    n = 0
    for m in net.modules():
        if isinstance(m, ddp_model.Attention):
            m.forward = sdpa_forward.__get__(m)
            n += 1
    return n


def flops_per_token(cfg, seq):
    """Training FLOPs per token, 6 N + 12 L T C (PaLM's appendix B, nanoGPT's estimate_mfu): N the
    parameters less the position embedding (the tied head counted once, as a matrix product), L the
    attention layers, T the sequence length, C their width; the attention term counts the full T x T
    products, the causal half that is masked included."""
    net, _ = ddp_model.build(load_config(cfg, seq)["model"])
    n = ddp_model.count_parameters(net)
    n -= sum(m.pos.weight.numel() for m in net.modules() if isinstance(m, ddp_model.Embedding) and m.pos is not None)
    att = [m for m in net.modules() if isinstance(m, ddp_model.Attention)]
    t = int(seq) if seq else int(load_config(cfg)["model"]["input"][0])
    return 6 * n + sum(12 * t * m.proj.in_features for m in att)


class Bench:
    """The model, optimizer and one synthetic batch on DEVICE, and a training step."""

    def __init__(self, cfg, batch, precision, setting, benchmark=True, seq=None):
        if precision not in ("fp32", "tf32", "bf16"):
            raise SystemExit(f"torch_gpu_train: precision {precision}: fp32, tf32 or bf16")
        torch.manual_seed(0)
        if DEVICE == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
            torch.backends.cudnn.allow_tf32 = precision == "tf32"
            torch.backends.cudnn.benchmark = benchmark
        conf = load_config(cfg, seq)
        shape = ddp_model.input_shape(conf["model"]["input"])
        net, self.loss_fn = ddp_model.build(conf["model"])
        self.tokens = ddp_model.is_token_model(conf["model"])
        if setting == "sdpa" or (self.tokens and setting in ("reduce-overhead", "max-autotune")):
            use_sdpa(net)
        conv = any(isinstance(m, nn.Conv2d) for m in net.modules())
        fmt = torch.channels_last if conv and (precision == "bf16" or setting == "channels-last") else None
        self.net = net.to(DEVICE, memory_format=fmt) if fmt else net.to(DEVICE)
        self.net.train()
        self.clip, self.per_sample = 0.0, 1
        if self.tokens:  # token ids in, the config's AdamW and clipping
            vocab = net[0].tok.weight.shape[0]
            self.x = torch.randint(0, vocab, (batch,) + shape, device=DEVICE)
            self.y = torch.randint(0, vocab, (batch,) + shape, device=DEVICE)
            self.per_sample = shape[0]
            o = conf.get("optim", {})
            wd = float(o.get("weight_decay", 0.0))
            kw = {}
            params = __import__("inspect").signature(torch.optim.AdamW).parameters
            if setting == "cuda-graph":
                kw["capturable"] = True
            elif DEVICE == "cuda" and "fused" in params:
                kw["fused"] = True
            self.opt = torch.optim.AdamW(ddp_model.param_groups(self.net, wd, o.get("no_decay") or ()), lr=1e-4,
                                         betas=tuple(o.get("betas", (0.9, 0.999))), eps=float(o.get("eps", 1e-8)),
                                         weight_decay=wd, **kw)
            self.clip = float(conf.get("train", {}).get("clip_grad_norm", 0.0))
        else:
            classes = [m for m in net.modules() if isinstance(m, nn.Linear)][-1].out_features
            self.x = torch.randn((batch,) + shape, device=DEVICE)
            if fmt:
                self.x = self.x.contiguous(memory_format=fmt)
            self.y = torch.randint(0, classes, (batch,), device=DEVICE)
            self.opt = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9, nesterov=True,
                                       weight_decay=5e-4)
        self.params = list(self.net.parameters())
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
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
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
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip)
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
    with open(cfg) as f:
        layers = str(yaml.safe_load(f)["model"]["layers"])
    if setting == "sdpa":
        if "attention" not in layers:
            return "no attention"
        if not hasattr(F, "scaled_dot_product_attention"):
            return f"F.scaled_dot_product_attention needs PyTorch 2 (this is {torch.__version__})"
    if setting == "channels-last":
        if "conv2d" not in layers:
            return "no convolutions"
        if precision == "bf16":
            return "bf16's eager is channels_last already"
    if setting == "cuda-graph" and DEVICE != "cuda":
        return "needs CUDA"
    if setting in ("reduce-overhead", "max-autotune") and not hasattr(torch, "compile"):
        return f"torch.compile needs PyTorch 2 (this is {torch.__version__})"
    return None


def measure(cfg, batch, precision, setting, steps, windows, seq=None):
    """samples/s (a token model: target tokens/s) of one setting: the median of the timed windows."""
    b = Bench(cfg, batch, precision, setting, seq=seq)
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
        rates.append(batch * b.per_sample * steps / (time.perf_counter() - t0))
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
    if args and args[0] == "--flops-per-token":
        print(flops_per_token(args[1], int(args[2])))
        return 0
    seq = None
    if args and args[0] == "--seq":
        seq, args = args[1], args[2:]
    if args and args[0] == "--setting":  # one setting, in its own process: prints samples/s
        setting, cfg, batch, precision, steps, windows = args[1:7]
        print(f"{measure(cfg, int(batch), precision, setting, int(steps), int(windows), seq):.1f}")
        return 0
    if len(args) != 5:
        raise SystemExit(__doc__.split("\n\n")[1])
    cfg, batch, precision, steps, windows = args
    results, skipped, notes = {}, {}, []
    for setting in os.environ.get("BENCH_TORCH_SETTINGS", " ".join(SETTINGS)).split():
        why = unavailable(setting, cfg, precision)
        if why is None:
            p = subprocess.run([sys.executable, os.path.abspath(__file__)] + (["--seq", seq] if seq else []) +
                               ["--setting", setting, cfg, batch, precision, steps, windows],
                               capture_output=True, text=True)
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
