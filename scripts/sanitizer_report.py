"""Counts what compute-sanitizer reported in one run's output, less NCCL's probes of kernels built
for other GPUs, and says whether the run was clean.

    scripts/sanitizer_report.py [LOG]     (stdin without LOG)

Prints one line, "sanitizer: N errors (TOOL summary: M reported, K of them NCCL's probes ...)", and
exits 0 when N is 0, 1 when not, 2 when the output holds no summary (a run cut off or not started).

NCCL's probes: at init NCCL asks cudaFuncGetAttributes of every kernel it was built with, and
ignores "no kernel image" for those built only for other GPUs (ncclInitKernelsForDevice: its
CUDACHECKGOTO to ignore0). compute-sanitizer reports each such call; on an H100 with NCCL 2.28 there
were 4. Only an API error of exactly that kind whose first frame past the driver is in libnccl is
left out: anything else, ours or NCCL's, counts.
"""
import re
import sys

BLOCK_START = re.compile(r"^========= (Program hit|Invalid|Race|Uninitialized|Barrier|Leaked|Error|Warning)", re.M)
PROBE = re.compile(r"Program hit cudaErrorNoKernelImageForDevice \(error \d+\) due to \"[^\"]*\" on CUDA API call to "
                   r"cudaFuncGetAttributes\.")
FRAME = re.compile(r"Host Frame:.*? in (\S+)")


def nccl_probes(text):
    """The reports that are NCCL's probes of kernels built for other GPUs."""
    starts = [m.start() for m in BLOCK_START.finditer(text)] + [len(text)]
    n = 0
    for a, b in zip(starts, starts[1:]):
        block = text[a:b]
        if not PROBE.search(block.splitlines()[0]):
            continue
        libs = [lib for lib in FRAME.findall(block) if not lib.startswith("libcuda.so")]
        n += bool(libs) and libs[0].startswith("libnccl.so")
    return n


def summary(text):
    """(tool, errors reported) from the run's last summary line, or None."""
    found = re.findall(r"ERROR SUMMARY: (\d+) errors?", text)
    if found:
        return "error", int(found[-1])
    found = re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, \d+ warnings?\)", text)
    if found:
        return "racecheck", int(found[-1])
    return None


def main():
    text = open(sys.argv[1], errors="replace").read() if len(sys.argv) > 1 else sys.stdin.read()
    s = summary(text)
    if s is None:
        print("sanitizer: no summary (the run was cut off or did not start)")
        return 2
    tool, reported = s
    probes = min(nccl_probes(text), reported)
    errors = reported - probes
    print(f"sanitizer: {errors} errors ({tool} summary: {reported} reported, {probes} of them NCCL's probes of "
          "kernels built for other GPUs)")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
