"""Long-run resource check (make longrun): a 20,000-step run of a tiny MLP (784-64-10) on
Fashion-MNIST, 2 ranks, a checkpoint every 500 steps with checkpoint.keep 3, validation every
1,000 steps. While it runs, every 0.1 s, for each rank: resident memory (VmRSS) and open file
descriptors; and the checkpoint directory's entries, counted exactly from inotify events (every
create, rename and delete, so a file that exists for a microsecond is seen too).

Pass criteria (the script exits 1 if one fails):
  RSS after the warm-up (the first 2,000 steps) stays within 5% of its value at the warm-up's end;
  open file descriptors (other than one into the checkpoint directory while a checkpoint is
  written) never exceed their count at the warm-up's end;
  the checkpoint directory never holds more than 4 files (3 checkpoints and `latest`) other than
  a temporary being written and renamed (`*.tmp.<pid>`: the next checkpoint, which only exists
  once the oldest is gone, or the new `latest` during its rename); the exact maximum with them is
  printed too.
Writes runs/longrun/samples.csv and runs/longrun/longrun.png. Debian's python3:
    /usr/bin/python3 benchmarks/longrun.py [--steps N] [--np 2] [--binary ./ddp_train]"""
import argparse
import ctypes
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "runs", "longrun")

CONFIG = """\
model:
  input: [784]
  layers: [{{linear: {{out: 64}}}}, relu, {{linear: {{out: 10}}}}]
data:
  path: {data}
  train: {{x: /train/images_flat, y: /train/labels}}
  val: {{x: /test/images_flat, y: /test/labels}}
  scale: 0.00392156862745098
train: {{global_batch_size: 64, epochs: 1000, max_steps: {steps}, eval_every_steps: 1000, seed: 1}}
optim: {{name: sgd, lr: 0.05, momentum: 0.9}}
checkpoint: {{dir: {ckpt}, every_steps: 500, every_epochs: 0, keep: 3}}
log: {{dir: {log}, every_steps: 100}}
"""

IN_CREATE, IN_DELETE, IN_MOVED_FROM, IN_MOVED_TO, IN_Q_OVERFLOW = 0x100, 0x200, 0x40, 0x80, 0x4000


class DirWatch:
    """The exact set of entries of a directory, kept from inotify events."""

    def __init__(self, path):
        self.libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0 or self.libc.inotify_add_watch(
                self.fd, path.encode(), IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), "inotify")
        self.names = set(os.listdir(path))
        self.most, self.at_most, self.overflow = len(self.names), sorted(self.names), False
        self.most_durable, self.temporaries = 0, set()

    def poll(self):
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            off = 0
            while off < len(buf):
                _, mask, _, n = struct.unpack_from("iIII", buf, off)
                name = buf[off + 16:off + 16 + n].rstrip(b"\0").decode()
                off += 16 + n
                if mask & IN_Q_OVERFLOW:
                    self.overflow = True
                elif mask & (IN_CREATE | IN_MOVED_TO):
                    self.names.add(name)
                elif mask & (IN_DELETE | IN_MOVED_FROM):
                    self.names.discard(name)
                if len(self.names) > self.most:
                    self.most, self.at_most = len(self.names), sorted(self.names)
                temporary = {x for x in self.names if ".tmp." in x}
                self.temporaries |= {re.sub(r"\.\d+$", ".<pid>", x) for x in temporary}
                self.most_durable = max(self.most_durable, len(self.names) - len(temporary))


def ranks_of(mpirun_pid):
    """PIDs of ddp_train processes whose parent is mpirun."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == mpirun_pid and comm == "ddp_train":
            pids.append(int(d))
    return sorted(pids)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def open_fds(pid, ckpt):
    """(fds other than the checkpoint being written, fds into the checkpoint directory)."""
    other = into = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(ckpt + "/"):
            into += 1
        else:
            other += 1
    return other, into


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--binary", default=os.path.join(ROOT, "ddp_train"))
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "fashion_mnist.h5"))
    a = ap.parse_args()
    warmup = a.steps // 10
    shutil.rmtree(OUT, ignore_errors=True)
    ckpt = os.path.join(OUT, "ckpt")
    os.makedirs(ckpt)
    cfg = os.path.join(OUT, "tiny_mlp.yaml")
    with open(cfg, "w") as f:
        f.write(CONFIG.format(data=a.data, steps=a.steps, ckpt=ckpt, log=os.path.join(OUT, "log")))
    watch = DirWatch(ckpt)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    t0 = time.monotonic()
    p = subprocess.Popen(["mpirun", "--oversubscribe", "-np", str(a.np), a.binary, cfg], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    step = [0]
    lines = []

    def read_output():
        for line in p.stdout:
            lines.append(line)
            m = re.match(r"\s*step\s+(\d+)", line)
            if m:
                step[0] = int(m.group(1))

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    samples = []  # (seconds, step, [rss KiB per rank], [fds per rank], entries)
    pids = []
    while p.poll() is None:
        watch.poll()
        if len(pids) < a.np:
            pids = ranks_of(p.pid)
        try:
            rss = [rss_kib(q) for q in pids]
            fds = [open_fds(q, ckpt) for q in pids]
        except OSError:  # a rank is exiting
            break
        if len(pids) == a.np:
            samples.append((time.monotonic() - t0, step[0], rss, fds, len(watch.names)))
        time.sleep(0.1)
    p.wait()
    reader.join()
    watch.poll()
    wall = time.monotonic() - t0
    if p.returncode != 0:
        sys.stdout.write("".join(lines[-30:]))
        sys.exit(f"longrun: ddp_train exited {p.returncode}")

    # from the warm-up's end to the last step's log line (then the ranks free everything and exit)
    after = [s for s in samples if warmup <= s[1] < a.steps]
    if not after:
        sys.exit("longrun: no samples after the warm-up")
    base = after[0]
    ok = True
    print(f"longrun: {a.steps} steps on {a.np} ranks in {wall:.1f} s ({len(samples)} samples, warm-up "
          f"{warmup} steps; machine: {os.cpu_count()} cores)")
    for r in range(a.np):
        rss = [s[2][r] for s in after]
        lo, hi = min(rss), max(rss)
        drift = max(hi / base[2][r] - 1, 1 - lo / base[2][r])
        first = samples[0][2][r]
        print(f"  rank {r} RSS: {first / 1024:.1f} MiB at start, {base[2][r] / 1024:.1f} MiB at step {base[1]}, "
              f"{rss[-1] / 1024:.1f} MiB at step {after[-1][1]}; after warm-up {lo / 1024:.1f}-{hi / 1024:.1f} MiB, "
              f"at most {100 * drift:.2f}% from step {base[1]} (limit 5%)")
        ok &= drift <= 0.05
        fds = [s[3][r][0] for s in after]
        print(f"  rank {r} open fds: {base[3][r][0]} at step {base[1]}, {min(fds)}-{max(fds)} after, "
              f"{fds[-1]} at step {after[-1][1]}; besides, at most {max(s[3][r][1] for s in samples)} open "
              f"into the checkpoint directory (a checkpoint being written)")
        ok &= max(fds) <= base[3][r][0]
    sampled = max(s[4] for s in samples)
    print(f"  checkpoint dir: at most {watch.most_durable} files other than in-flight temporaries (limit 4); "
          f"with them at most {watch.most} entries, {watch.at_most} (exact, from inotify"
          f"{'; QUEUE OVERFLOWED' if watch.overflow else ''}); temporaries seen: {sorted(watch.temporaries)}; "
          f"at most {sampled} entries in the 0.1 s samples; at the end {sorted(watch.names)}")
    ok &= watch.most_durable <= 4 and not watch.overflow
    with open(os.path.join(OUT, "samples.csv"), "w") as f:
        f.write("seconds,step," + ",".join(f"rss_kib_{r},fds_{r}" for r in range(a.np)) + ",ckpt_entries\n")
        for s in samples:
            f.write(f"{s[0]:.2f},{s[1]}," + ",".join(f"{s[2][r]},{s[3][r][0]}" for r in range(a.np)) + f",{s[4]}\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
        for r in range(a.np):
            ax[0].plot([s[1] for s in samples], [s[2][r] / 1024 for s in samples], label=f"rank {r}")
            ax[1].plot([s[1] for s in samples], [s[3][r][0] for s in samples], label=f"rank {r}")
        ax[2].plot([s[1] for s in samples], [s[4] for s in samples])
        ax[0].set_ylabel("RSS (MiB)")
        ax[1].set_ylabel("open fds")
        ax[2].set_ylabel("ckpt entries")
        ax[2].set_xlabel("step")
        for x in ax:
            x.axvline(warmup, color="gray", ls=":")
        ax[0].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(OUT, "longrun.png"), dpi=90)
    except ImportError:
        pass
    print(f"longrun: {'PASS' if ok else 'FAIL'}; samples in {OUT}/samples.csv")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
