#!/usr/bin/python3
"""Projects ddp_train's step time and weak-scaling efficiency to N GPUs from one run's
metrics.jsonl, with an alpha-beta model of the gradient all-reduce and of its overlap with backward;
and checks the same model against measured multi-rank CPU runs (--validate).

    scripts/scaling.py runs/x/metrics.jsonl --gpus 8,64,512 --intra nvlink4 --inter ib-ndr400 --gpu h100
    scripts/scaling.py runs/np2/metrics.jsonl --validate --measured build/allreduce_np2.json

The input (metrics.jsonl on the CPU backend, every log.every_steps; means over the interval): forward_s,
backward_s and its MPI part backward_mpi_s, update_s, data_s, comm_wait_s, agree_s, step_s, and per
gradient bucket its bytes and ready_s (from the start of backward until its gradients were final;
mpi_s of that was spent in MPI calls). The medians over the logged intervals are used, the first
--skip of them dropped as warm-up. host_s is the rest of the step (loss read-back, loader hand-off,
logging): step_s less every part named above.

The all-reduce of n bytes over p ranks, g per node on N = p/g nodes, with link presets (alpha: seconds
per message step, B: bytes/s per direction per GPU); the fastest of (NCCL picks per size):
  ring          2(p-1) a' + 2(p-1)/p n/B'
  tree          2((g-1) a_intra + ceil(log2 N) a_inter) + 2 n/B'   (NCCL's: a chain through the node's
                GPUs, a double binary tree across nodes, pipelined; the ~2 log2(p) a + 2 n B of a
                tree over every GPU, with the node's part a chain as NCCL builds it)
  hierarchical  (N > 1) reduce-scatter in the node: (g-1) a_intra + (g-1)/g n/B_intra
                then an all-reduce of n/g over the N nodes (ring or tree above, inter-node link;
                the node's g NICs carry the g slices at once), then all-gather in the node (as the
                reduce-scatter)
where B' is B_intra in one node, else B_inter (a flat ring or tree through one NIC per ring: the
pessimistic single-rail form), and a' the hop-weighted alpha ((p-N) a_intra + N a_inter)/p.
The `measured` preset replaces all of this in one node by allreduce_bench's fit for that rank count
(t = alpha + beta n per size range, of the MPI_Iallreduce grad_sync uses).

The step, two progress models:
  async (GPU, NCCL: the sums run on their own stream beside backward): bucket k's all-reduce starts
    when it is ready and after bucket k-1's ends; step = data + forward + max(backward end, last
    all-reduce end) + update + host + agree + wake.
  host (CPU, MPI: Open MPI moves and sums the bytes inside the rank's own MPI calls, on the thread
    that runs backward, so nothing overlaps): step = share * (data + forward + backward + update +
    host) + sum of the buckets' all-reduces + agree + wake, where share = ranks x threads per node /
    cores (at least 1): with more ranks than cores the ranks take turns.
  agree: the per-step agreement, an MPI all-gather of 32 bytes per rank: ceil(log2 g) a_intra +
    ceil(log2 N) a_inter (recursive doubling); measured: the fitted all-reduce time of 32 p bytes.
  wake: ddp_train's waits poll, then sleep usleep(50) between polls (host_sleep_s, measured by
    allreduce_bench: ~120 us here, the kernel's 50 us timer slack included). A GPU step's wait
    (wait_step) polls the local device: it ends on average half a sleep late. Over MPI (host mode,
    p > 1) an exchange needs both ranks inside MPI, and both sleep: the rank the data reached asleep
    wakes half a sleep late on average, then its peer waits for its answer asleep too, so the
    gradient wait and the agreement cost a whole sleep each. (On this machine a 512 KiB
    MPI_Iallreduce completed by comm_wait's loop takes ~410 us against ~130 us with MPI_Wait: the
    stalls are real and larger for many-round collectives; one sleep per wait is the low estimate.)

GPU compute (--gpu h100): the CPU run's forward, backward and bucket ready times are scaled by one
factor so that forward + backward take 3 x flops_per_sample x rank_batch / (peak x mfu) (forward
FLOPs from the model, backward twice forward); the backward timeline keeps its measured shape. The
update is memory-bound: 20 bytes per parameter (SGD with momentum, fp32: read parameter, gradient,
momentum; write parameter, momentum) at the HBM bandwidth. The CPU run's host_s and data_s are not
carried over: the host queues a GPU step while the previous one runs, so only --gpu-host-us (a CUDA
graph launch and the results' read-back, 20 us) is added, and data is taken as ready (data.cache
device). --compute-scale X instead multiplies forward, backward and update by X.
Weak scaling: the per-GPU batch stays the run's; efficiency(N) = step(1) / step(N)."""
import argparse
import json
import math
import os
import statistics
import sys

# Link presets: alpha (s), bandwidth (bytes/s per direction per GPU), and where the figures come from.
LINKS = {
    # NVIDIA H100 SXM5 datasheet: NVLink 4, 900 GB/s bidirectional per GPU (18 links x 50 GB/s), so
    # 450 GB/s each way; nccl-tests all_reduce_perf on 8x H100 SXM (DGX H100 / HGX) reports a bus
    # bandwidth of about 360-480 GB/s for large messages: 400e9 here. Latency: NCCL's intra-node
    # LL/LL128 steps are a few microseconds.
    "nvlink4": {"alpha_s": 3e-6, "bw": 400e9, "source": "H100 SXM5 datasheet (900 GB/s bidirectional NVLink 4); "
                "nccl-tests busbw ~360-480 GB/s on 8x H100; alpha a few us"},
    # ConnectX-7 NDR InfiniBand, 400 Gb/s per port, one port per GPU (DGX H100: 8 for the compute
    # fabric): 50 GB/s each way, 40-48 GB/s achieved by RDMA (ib_write_bw, nccl-tests per-rail busbw);
    # 45e9 here. Latency across a switch: ~1-2 us verbs, 5-10 us for an NCCL step: 7 us.
    "ib-ndr400": {"alpha_s": 7e-6, "bw": 45e9, "source": "NDR 400 Gb/s per GPU = 50 GB/s per direction, "
                  "~40-48 GB/s achievable; alpha ~5-10 us across nodes"},
    # For comparison: HDR 200 Gb/s (DGX A100), 25 GB/s each way, ~23 achievable.
    "ib-hdr200": {"alpha_s": 7e-6, "bw": 23e9, "source": "HDR 200 Gb/s per GPU (DGX A100)"},
}

# GPU presets for --gpu: dense bf16 peak (FLOP/s), the fraction of it achieved (MFU), HBM bytes/s.
GPUS = {
    # H100 SXM5 datasheet: 989 TFLOP/s dense bf16 (1979 with sparsity), 3.35 TB/s HBM3. 40% MFU gives
    # ~400 TFLOP/s achieved, what large, well-shaped convolution and GEMM work reaches in bf16; small
    # layers reach much less (then the projection is optimistic about compute, pessimistic about scaling).
    "h100": {"peak_flops": 989e12, "mfu": 0.4, "hbm_bw": 3.35e12},
}

DEFAULT_HOST_SLEEP_S = 120e-6  # usleep(50) measured on the development machine (allreduce_bench)
# A GPU step's host work that the GPU waits for: a CUDA graph launch and the read-back of the step's
# results (the queued work itself overlaps the GPU). Data: data.cache device, or a loader that keeps up.
DEFAULT_GPU_HOST_S = 20e-6
AGREE_BYTES = 32  # sizeof(dt_step_report), all-gathered by every rank each step
UPDATE_BYTES_PER_PARAM = 20


def median(xs):
    return statistics.median(xs) if xs else 0.0


class Profile:
    """The medians of a run's training records (metrics.jsonl): seconds per step."""

    FIELDS = ("step_s", "data_s", "forward_s", "backward_s", "backward_mpi_s", "comm_wait_s", "update_s", "agree_s")

    def __init__(self, path, skip=1):
        recs = []
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    r = json.loads(line)
                    if "step_s" in r:
                        recs.append(r)
        if not recs:
            raise ValueError(f"{path}: no training record with step timing (step_s): a CPU-backend run of this "
                             "ddp_train writes them every log.every_steps")
        if any(r.get("buckets") is None for r in recs):
            raise ValueError(f"{path}: records without the per-bucket list (more than 1024 buckets: "
                             "raise dist.bucket_mb)")
        recs = recs[skip:] if len(recs) > skip else recs[-1:]
        self.path, self.records = path, recs
        for k in self.FIELDS:
            setattr(self, k, median([r[k] for r in recs]))
        self.host_s = median([r["step_s"] - r["data_s"] - r["forward_s"] - r["backward_s"] - r["comm_wait_s"]
                              - r["update_s"] - r["agree_s"] for r in recs])
        last = recs[-1]
        self.world_size, self.local_size = last["world_size"], last["local_size"]
        self.threads, self.grad_accum = last["threads"], last["grad_accum"]
        self.rank_batch, self.flops_per_sample = last["rank_batch"], last["flops_per_sample"]
        nb = len(last["buckets"])
        # (bytes, compute seconds from the start of backward until ready): MPI time inside backward removed
        self.buckets = [(last["buckets"][i]["bytes"],
                         median([r["buckets"][i]["ready_s"] - r["buckets"][i]["mpi_s"] for r in recs]))
                        for i in range(nb)]
        self.backward_compute_s = self.backward_s - self.backward_mpi_s
        self.grad_bytes = sum(b for b, _ in self.buckets)

    def compute_s(self):
        """The step's own work, no communication: what a single rank does."""
        return self.data_s + self.forward_s + self.backward_compute_s + self.update_s + self.host_s


def load_measured(paths):
    """allreduce_bench JSON files: {(ranks, nodes): bench}."""
    out = {}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        out[(d["ranks"], d["nodes"])] = d
    return out


def segment_time(op, n):
    """The fitted time of n bytes: the line of the size range holding n (the nearest below it)."""
    segs = op["segments"]
    s = segs[0]
    for cand in segs:
        if n >= cand["from_bytes"]:
            s = cand
    return max(s["alpha_s"] + s["beta_s_per_byte"] * n, 0.0)


class Network:
    """All-reduce time for p GPUs, gpus_per_node of them per node, over named link presets (or
    `measured`: allreduce_bench fits by rank count)."""

    def __init__(self, intra, inter, gpus_per_node, measured=None, op="iallreduce"):
        self.intra, self.inter, self.gpn, self.measured, self.op = intra, inter, gpus_per_node, measured or {}, op
        for name in (intra, inter):
            if name != "measured" and name not in LINKS:
                raise ValueError(f"unknown link preset {name!r}: one of {', '.join(sorted(LINKS))}, measured")

    def link(self, name):
        return LINKS[name]

    def allreduce(self, n, p):
        """(seconds, algorithm) for an all-reduce of n bytes over p GPUs."""
        if p <= 1 or n <= 0:
            return 0.0, "none"
        g = min(p, self.gpn)
        nodes = math.ceil(p / g)
        if (self.intra == "measured" and nodes == 1) or (self.inter == "measured" and nodes > 1):
            key = (p, nodes)
            if key not in self.measured:
                have = ", ".join(f"{r} ranks on {k} node(s)" for r, k in sorted(self.measured)) or "none"
                raise ValueError(f"no allreduce_bench measurement for {p} ranks on {nodes} node(s) (have: {have}); "
                                 f"run mpirun -np {p} build/allreduce_bench --out FILE and pass --measured FILE")
            return segment_time(self.measured[key]["ops"][self.op], n), f"measured {self.op}"
        li = self.link(self.intra if self.intra != "measured" else self.inter)
        le = self.link(self.inter if self.inter != "measured" else self.intra)
        if nodes == 1:
            return min((ring(n, p, li["alpha_s"], li["bw"]), "ring"),
                       (tree(n, g, li["alpha_s"], 1, 0.0, li["bw"]), "tree"))
        a_hop = ((p - nodes) * li["alpha_s"] + nodes * le["alpha_s"]) / p
        cands = [(ring(n, p, a_hop, le["bw"]), "ring"),
                 (tree(n, g, li["alpha_s"], nodes, le["alpha_s"], le["bw"]), "tree")]
        rs = (g - 1) * li["alpha_s"] + (g - 1) / g * n / li["bw"]
        inter, how = min((ring(n / g, nodes, le["alpha_s"], le["bw"]), "ring"),
                         (tree(n / g, 1, 0.0, nodes, le["alpha_s"], le["bw"]), "tree"))
        cands.append((2 * rs + inter, f"hierarchical ({how} across nodes)"))
        return min(cands)


    def agree(self, p):
        """The per-step agreement: a host MPI all-gather of AGREE_BYTES per rank, latency-bound
        (recursive doubling: ceil(log2) steps in the node, then across nodes); measured: the fit."""
        if p <= 1:
            return 0.0
        g = min(p, self.gpn)
        nodes = math.ceil(p / g)
        if (self.intra == "measured" and nodes == 1) or (self.inter == "measured" and nodes > 1):
            return self.allreduce(AGREE_BYTES * p, p)[0]
        li = self.link(self.intra if self.intra != "measured" else self.inter)
        le = self.link(self.inter if self.inter != "measured" else self.intra)
        return math.ceil(math.log2(g)) * li["alpha_s"] + math.ceil(math.log2(nodes)) * le["alpha_s"]


def ring(n, p, alpha, bw):
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw


def tree(n, g, alpha_intra, nodes, alpha_inter, bw):
    """A chain through g GPUs in each node, a binary tree over the nodes: up (reduce) and down."""
    return 2 * ((g - 1) * alpha_intra + math.ceil(math.log2(nodes)) * alpha_inter) + 2 * n / bw


def predict(prof, net, p, mode, cores=None, host_sleep_s=DEFAULT_HOST_SLEEP_S, scale=None, grad_bytes=4,
            gpu_host_s=DEFAULT_GPU_HOST_S):
    """The modelled step at p ranks from a profile: a dict of its parts (seconds) and the algorithm
    of the largest bucket. scale: None (the CPU times as measured) or (compute factor, update
    seconds) for a GPU, whose host work per step is gpu_host_s and whose data waits are taken as 0."""
    fwd, bwd, upd = prof.forward_s, prof.backward_compute_s, prof.update_s
    f = 1.0
    if scale:
        f, upd = scale
        fwd, bwd = fwd * f, bwd * f
    k = max(prof.grad_accum, 1)
    last_bwd = bwd / k  # the overlapped backward: the last micro-batch's
    byte_scale = grad_bytes / 4
    buckets = [(b * byte_scale, min(r * f, last_bwd)) for b, r in prof.buckets]
    ars = [net.allreduce(b, p) for b, _ in buckets]
    comm_total = sum(t for t, _ in ars)
    algo = max(zip(buckets, ars), key=lambda x: x[0][0])[1][1] if ars else "none"
    agree = net.agree(p)
    data, host = (prof.data_s, prof.host_s) if not scale else (0.0, gpu_host_s)
    parts = {"data": data, "forward": fwd, "backward": bwd, "update": upd, "host": host,
             "comm_total": comm_total, "agree": agree}
    if mode == "async":
        end = 0.0
        for (_, ready), (t, _) in zip(buckets, ars):
            end = max(ready, end) + t
        exposed = max(0.0, end - last_bwd)
        wake = host_sleep_s / 2
        step = data + fwd + bwd + exposed + upd + host + agree + wake
    elif mode == "host":
        share = max(1.0, min(p, net.gpn) * prof.threads / cores) if cores else 1.0
        wake = 2 * host_sleep_s if p > 1 else 0.0
        exposed = comm_total
        parts["share"] = share
        step = share * (data + fwd + bwd + upd + host) + comm_total + agree + wake
    else:
        raise ValueError(f"unknown progress model {mode!r}")
    parts.update(exposed=exposed, wake=wake, step=step)
    return parts, algo


def gpu_scale(prof, gpu, mfu=None, batch=None):
    """(compute factor, update seconds) that turn the CPU profile into the GPU estimate, for batch
    samples per GPU per optimizer step, every micro-batch (default: the run's rank_batch)."""
    g = GPUS[gpu]
    achieved = g["peak_flops"] * (mfu if mfu else g["mfu"])
    gpu_compute = 3 * prof.flops_per_sample * (batch or prof.rank_batch) / achieved
    cpu_compute = prof.forward_s + prof.backward_compute_s
    params = prof.grad_bytes / 4
    return gpu_compute / cpu_compute, UPDATE_BYTES_PER_PARAM * params / g["hbm_bw"]


def validate(prof, measured, cores=None, host_sleep_s=None, op="iallreduce"):
    """The host-progress model at the profile's own rank count, against its measured step: a dict."""
    p = prof.world_size
    net = Network("measured", "measured", prof.local_size, measured, op)
    bench = measured.get((p, math.ceil(p / prof.local_size)))
    if host_sleep_s is None:
        host_sleep_s = bench["host_sleep_s"] if bench else DEFAULT_HOST_SLEEP_S
    parts, _ = predict(prof, net, p, "host", cores or os.cpu_count(), host_sleep_s)
    measured_comm = prof.backward_mpi_s + prof.comm_wait_s + prof.agree_s
    return {"ranks": p, "predicted_s": parts["step"], "measured_s": prof.step_s,
            "error": parts["step"] / prof.step_s - 1, "parts": parts, "measured_comm_s": measured_comm,
            "predicted_comm_s": parts["comm_total"] + parts["agree"] + parts["wake"]}


def project(prof, net, gpus, mode, scale, host_sleep_s, grad_bytes, batch=None, gpu_host_s=DEFAULT_GPU_HOST_S):
    rows = []
    base, _ = predict(prof, net, 1, mode, None, host_sleep_s, scale, grad_bytes, gpu_host_s)
    for p in gpus:
        parts, algo = predict(prof, net, p, mode, None, host_sleep_s, scale, grad_bytes, gpu_host_s)
        rows.append({"gpus": p, "nodes": math.ceil(p / net.gpn), "step_s": parts["step"],
                     "comm_s": parts["comm_total"], "exposed_s": parts["exposed"],
                     "compute_s": parts["forward"] + parts["backward"] + parts["update"],
                     "samples_per_s": p * (batch or prof.rank_batch) / parts["step"],
                     "efficiency": base["step"] / parts["step"], "algorithm": algo})
    return base, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="a CPU run's metrics.jsonl")
    ap.add_argument("--gpus", default="8,64,512", help="GPU counts to project to (comma-separated)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--intra", default="nvlink4", help=f"link in a node: {', '.join(LINKS)}, measured")
    ap.add_argument("--inter", default="ib-ndr400", help="link between nodes (same presets)")
    ap.add_argument("--measured", action="append", default=[],
                    help="allreduce_bench JSON (repeatable, one per rank count) for the `measured` preset")
    ap.add_argument("--op", default="iallreduce", choices=("iallreduce", "allreduce"),
                    help="which of allreduce_bench's fits `measured` uses (grad_sync does iallreduce)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--gpu", choices=sorted(GPUS), help="scale the CPU compute to this GPU by FLOPs")
    g.add_argument("--compute-scale", type=float, help="multiply forward, backward and update by this")
    ap.add_argument("--mfu", type=float, help="model FLOPs utilisation for --gpu (default: the preset's)")
    ap.add_argument("--batch-per-gpu", type=int, help="with --gpu: samples per GPU per step (default: the run's per "
                    "rank); the compute scales by FLOPs, the backward timeline keeps the run's shape")
    ap.add_argument("--grad-bytes", type=int, default=4, choices=(2, 4),
                    help="bytes per gradient value summed (4: fp32 as logged; 2: dist.grad_dtype bf16)")
    ap.add_argument("--progress", choices=("async", "host"),
                    help="overlap model (default: async with link presets, host with measured)")
    ap.add_argument("--host-sleep-us", type=float, help="usleep(50)'s real length (default: from --measured, "
                    f"else {DEFAULT_HOST_SLEEP_S * 1e6:.0f})")
    ap.add_argument("--gpu-host-us", type=float, default=DEFAULT_GPU_HOST_S * 1e6,
                    help="host work per step that a GPU waits for (with --gpu or --compute-scale)")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="cores per node (host progress model)")
    ap.add_argument("--skip", type=int, default=1, help="logged intervals dropped as warm-up")
    ap.add_argument("--validate", action="store_true",
                    help="predict this run's own step time at its rank count with --measured, and compare")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)

    try:
        prof = Profile(a.metrics, a.skip)
        measured = load_measured(a.measured)
    except (OSError, ValueError, KeyError) as e:
        print(f"scaling.py: error: {e}", file=sys.stderr)
        return 2
    sleep = a.host_sleep_us * 1e-6 if a.host_sleep_us else (
        next(iter(measured.values()))["host_sleep_s"] if measured else DEFAULT_HOST_SLEEP_S)
    if a.validate:
        try:
            v = validate(prof, measured, a.cores, sleep, a.op)
        except ValueError as e:
            print(f"scaling.py: error: {e}", file=sys.stderr)
            return 2
        if a.json:
            print(json.dumps(v, indent=1))
        else:
            pr = v["parts"]
            print(f"{v['ranks']} ranks ({prof.threads} thread(s) each, {a.cores} cores, share {pr['share']:.2f}): "
                  f"predicted {v['predicted_s'] * 1e3:.3f} ms/step, measured {v['measured_s'] * 1e3:.3f} ms/step "
                  f"({v['error'] * 100:+.1f}%)")
            print(f"  compute {1e3 * prof.compute_s():.3f} ms, all-reduce {1e3 * pr['comm_total']:.3f} ms "
                  f"(measured in MPI calls and waits: {1e3 * v['measured_comm_s']:.3f} ms with the agreement), "
                  f"agreement {1e3 * pr['agree']:.3f} ms, wake-ups {1e3 * pr['wake']:.3f} ms")
        return 0

    mode = a.progress or ("host" if "measured" in (a.intra, a.inter) else "async")
    try:
        gpus = [int(x) for x in a.gpus.split(",") if x]
        net = Network(a.intra, a.inter, a.gpus_per_node, measured, a.op)
        if a.batch_per_gpu and not a.gpu:
            raise ValueError("--batch-per-gpu needs --gpu (the CPU times are for the run's own batch)")
        scale = gpu_scale(prof, a.gpu, a.mfu, a.batch_per_gpu) if a.gpu else (
            (a.compute_scale, prof.update_s * a.compute_scale) if a.compute_scale else None)
        base, rows = project(prof, net, gpus, mode, scale, sleep, a.grad_bytes, a.batch_per_gpu,
                             a.gpu_host_us * 1e-6)
    except ValueError as e:
        print(f"scaling.py: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"single_step_s": base["step"], "rows": rows}, indent=1))
        return 0
    what = f"{a.gpu} ({'mfu ' + str(a.mfu or GPUS[a.gpu]['mfu'])})" if a.gpu else (
        f"CPU x {a.compute_scale}" if a.compute_scale else "CPU as measured")
    print(f"{a.metrics}: {prof.grad_bytes / 1e6:.2f} MB of gradients in {len(prof.buckets)} bucket(s), "
          f"{a.batch_per_gpu or prof.rank_batch:g} samples per GPU, "
          f"{prof.flops_per_sample / 1e6:.2f} MFLOP/sample forward")
    print(f"compute: {what}; links: {a.intra} in a node, {a.inter} across ({a.gpus_per_node} per node); "
          f"progress: {mode}; one GPU: {base['step'] * 1e3:.3f} ms/step")
    print(f"{'GPUs':>6} {'nodes':>5} {'compute ms':>10} {'allreduce ms':>12} {'exposed ms':>10} {'step ms':>9} "
          f"{'samples/s':>12} {'efficiency':>10}  algorithm (largest bucket)")
    for r in rows:
        print(f"{r['gpus']:>6} {r['nodes']:>5} {r['compute_s'] * 1e3:>10.3f} {r['comm_s'] * 1e3:>12.3f} "
              f"{r['exposed_s'] * 1e3:>10.3f} {r['step_s'] * 1e3:>9.3f} {r['samples_per_s']:>12.0f} "
              f"{r['efficiency'] * 100:>9.1f}%  {r['algorithm']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
