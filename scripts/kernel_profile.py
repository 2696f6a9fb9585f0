#!/usr/bin/python3
"""The top kernels of a profiled run, as a Markdown table: per kernel the launches, the total time, its
share of all kernels' time and the mean per launch (gpu_check.sh's profile stage).

  kernel_profile.py ncu PROFILE.csv [TOP]     Nsight Compute's --csv output of gpu__time_duration.sum
  kernel_profile.py gpusim STDERR.txt [TOP]   the stand-in's GPUSIM_PROFILE table (CPU seconds: the
                                              plumbing only, nothing about a GPU)

Exits 1 naming the file when it holds no kernel."""
import csv
import io
import re
import sys
import zlib
from collections import defaultdict

UNITS = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}


def from_ncu(text):
    """(name, launches, seconds) per kernel from ncu --csv rows (one per launch and metric)."""
    start = text.find('"ID"')  # ncu prints its own progress lines before the table
    if start < 0:
        return []
    per = defaultdict(lambda: [0, 0.0])
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = re.sub(r"\(.*", "", row["Kernel Name"]).strip() or row["Kernel Name"]
        value = float(row["Metric Value"].replace(",", ""))
        per[name][0] += 1
        per[name][1] += value * UNITS.get(row.get("Metric Unit", "nsecond"), 1e-9)
    return [(k, n, s) for k, (n, s) in per.items()]


def from_gpusim(text):
    """The stand-in's table: `name launches threads seconds ns-per-thread` under its header line."""
    rows = []
    on = False
    for line in text.splitlines():
        if line.startswith("gpusim profile"):
            on = True
            continue
        m = re.match(r"^\s+(\S.*?)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+[\d.]+$", line) if on else None
        if m:
            rows.append((m.group(1), int(m.group(2)), float(m.group(4))))
        elif on and line.strip() and not line.startswith(" "):
            on = False
    return rows


def short(name, most=120):
    """A kernel's name for the table: cuDNN's CUTLASS templates run to thousands of characters, so a long
    one keeps its head and tail and a CRC-32 of the whole, so that two kernels never look alike (they are
    summed under their whole names before this)."""
    if len(name) <= most:
        return name
    return f"{name[:60]} ... {name[-(most - 80):]} [{zlib.crc32(name.encode()):08x}]"


def main():
    kind, path = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    text = open(path, errors="replace").read()
    rows = from_ncu(text) if kind == "ncu" else from_gpusim(text)
    if not rows:
        sys.exit(f"kernel_profile.py: {path}: no kernel in it")
    total = sum(s for _, _, s in rows)
    rows.sort(key=lambda r: -r[2])
    print(f"| kernel | launches | total ms | share | mean us |")
    print("|---|---|---|---|---|")
    for name, n, s in rows[:top]:
        print(f"| {short(name)} | {n} | {s * 1e3:.3f} | {100 * s / total:.1f}% | {s / n * 1e6:.1f} |")
    rest = rows[top:]
    if rest:
        s = sum(r[2] for r in rest)
        print(f"| {len(rest)} others | {sum(r[1] for r in rest)} | {s * 1e3:.3f} | {100 * s / total:.1f}% | |")
    print(f"\n{len(rows)} kernels, {sum(r[1] for r in rows)} launches, {total * 1e3:.3f} ms in all")


if __name__ == "__main__":
    main()
