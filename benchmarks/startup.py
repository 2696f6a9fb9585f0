#!/usr/bin/python3
"""Start-up time, ddp_train beside PyTorch's torchrun, measured in the same run (medians of N runs).

  startup.py [--runs N] [--binary ./ddp_train] [--config configs/model.yaml]

Rows:
- `--version`, `--help`, `--dry-run CONFIG`: one process, wall time from exec to exit;
- launch to the end of the first step: `mpirun -np 2 ddp_train CONFIG` (one training step, no
  validation, no checkpoint), from starting mpirun to reading rank 0's line for step 1; beside it
  2 processes of benchmarks/torch_startup.py started as torchrun starts them (launch_torch: Debian's
  torchrun fails on Python 3.11, so its own agent's time is left out), which does what a
  PyTorch user's script does before its first step (gloo process group, the same HDF5 data read
  into memory, the same model from scripts/ddp_model.py in DDP) and one step of the same batch;
- the cost of linking the CUDA libraries (cuDNN, cuBLAS, cudart, NCCL): two empty C programs, one
  linked against them, from exec to exit. Every ddp_train process pays it, GPU or not.
Prints a Markdown table; `make bench` runs it after the throughput table.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def wall(cmd, cwd=ROOT):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"startup.py: {' '.join(cmd)} exited {p.returncode}: {p.stderr[-2000:]}")
    return dt


def until_line(cmd, needle, timeout=120):
    """Seconds from starting cmd until a line of its stdout contains needle; then waits for it."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         bufsize=1)
    seen, lines = None, []
    for line in p.stdout:
        lines.append(line)
        if seen is None and needle in line:
            seen = time.perf_counter() - t0
    p.wait(timeout=timeout)
    if p.returncode != 0 or seen is None:
        sys.exit(f"startup.py: {' '.join(cmd)} exited {p.returncode} (line {needle!r} seen: {seen is not None}):\n"
                 + "".join(lines[-20:]))
    return seen


def cuda_link_cost(runs, tmp):
    cuda = "/usr/local/cuda"
    if not os.path.exists(os.path.join(cuda, "lib64", "libcudart.so")) or not shutil.which("cc"):
        return None
    src = os.path.join(tmp, "empty.c")
    with open(src, "w") as f:
        f.write("int main(void) { return 0; }\n")
    plain, linked = os.path.join(tmp, "plain"), os.path.join(tmp, "linked")
    subprocess.run(["cc", "-O2", "-o", plain, src], check=True)
    subprocess.run(["cc", "-O2", "-o", linked, src, "-Wl,--no-as-needed", f"-L{cuda}/lib64", f"-Wl,-rpath,{cuda}/lib64",
                    "-lcudnn", "-lcublas", "-lcudart", "-lnccl"], check=True)
    a = statistics.median(wall([plain]) for _ in range(runs))
    b = statistics.median(wall([linked]) for _ in range(runs))
    return b - a


def launch_torch(config):
    """torchrun's job without torchrun: Debian's torch 1.13 elastic agent fails on Python 3.11
    (AttributeError in multiprocessing.api.to_map), so this starts the 2 workers with the
    environment torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) and waits.
    It leaves out torchrun's own agent and rendezvous, in PyTorch's favour."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(ENV, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(["/usr/bin/python3", os.path.join(ROOT, "benchmarks", "torch_startup.py"),
                                       config], cwd=ROOT, env=env))
    sys.exit(max(p.wait() for p in procs))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--launch-torch":
        return launch_torch(sys.argv[2])
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--binary", default="./ddp_train")
    ap.add_argument("--config", default="configs/model.yaml")
    ap.add_argument("--mpirun", default=os.environ.get("MPIRUN", "mpirun"))
    a = ap.parse_args()
    py = "/usr/bin/python3"
    tmp = tempfile.mkdtemp(prefix="ddp_startup_")
    try:
        rows = []
        for name, args in (("--version", ["--version"]), ("--help", ["--help"]),
                           (f"--dry-run {a.config}", [a.config, "--dry-run"])):
            t = [wall([a.binary] + args) for _ in range(a.runs)]
            rows.append((f"`ddp_train {name}`", statistics.median(t), min(t), max(t), None))
        ours_cmd = [a.mpirun, "-np", "2", a.binary, a.config, "--set", "train.max_steps=1", "--set",
                    "checkpoint.dir=", "--set", "data.val.x=", "--set", f"log.dir={tmp}/log"]
        torch_cmd = [py, os.path.join(ROOT, "benchmarks", "startup.py"), "--launch-torch", a.config]
        ours, theirs = [], []
        for i in range(a.runs):  # paired, alternating which goes first
            if i % 2:
                theirs.append(until_line(torch_cmd, "step 1 "))
                ours.append(until_line(ours_cmd, "step 1/"))
            else:
                ours.append(until_line(ours_cmd, "step 1/"))
                theirs.append(until_line(torch_cmd, "step 1 "))
        rows.append(("launch to the end of step 1, 2 ranks: `mpirun -np 2 ddp_train`", statistics.median(ours),
                     min(ours), max(ours), (statistics.median(theirs), min(theirs), max(theirs))))
        link = cuda_link_cost(max(a.runs, 9), tmp)
        print("| what | ddp_train s (min-max) | PyTorch DDP s (min-max) |\n|---|---|---|")
        for name, med, lo, hi, peer in rows:
            other = f"{peer[0]:.3f} ({peer[1]:.3f}-{peer[2]:.3f})" if peer else ""
            print(f"| {name} | {med:.3f} ({lo:.3f}-{hi:.3f}) | {other} |")
        if link is not None:
            print(f"| linking cuDNN, cuBLAS, cudart and NCCL (an empty program with them against without) | "
                  f"{link:.3f} | |")
        print(f"\nmedians of {a.runs} runs; {a.config}, data from the page cache")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
