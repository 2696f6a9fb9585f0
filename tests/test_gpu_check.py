"""scripts/gpu_check.sh, the one command a lent GPU machine runs (issue 23), run here against the CPU
stand-in (--standin) so that the real run cannot fail on a typo: every stage runs and is summarised in
summary.json and summary.md; compute-sanitizer, which needs a GPU, is replaced by a stand-in tool that
checks the options it is given and runs the program; a failing stage, one past its time limit and one
the budget leaves no time for are each recorded as such while the others go on."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import h5py

from helpers import ENV, ROOT, gpu_setup

ENV1, VISIBLE1, SIM = gpu_setup(1)

# What compute-sanitizer is given, checked: the options the script may use, then the program, run
# as compute-sanitizer runs it (only under the tools FAKE_SANITIZER_RUNS names, where it is set), and
# the summary line it ends with.
FAKE_SANITIZER = """#!/usr/bin/env bash
echo "$@" >> "$(dirname "$0")/calls"
tool=
while [ $# -gt 0 ] && [[ $1 == --* ]]; do
  case $1 in
    --tool) case $2 in memcheck|racecheck|synccheck|initcheck) tool=$2 ;; *) echo "bad tool $2"; exit 98 ;; esac
      shift 2 ;;
    --error-exitcode|--leak-check) shift 2 ;;
    *) echo "unknown option $1"; exit 99 ;;
  esac
done
rc=0
if [ -z "${FAKE_SANITIZER_RUNS:-}" ] || [[ " $FAKE_SANITIZER_RUNS " == *" $tool "* ]]; then
  "$@"
  rc=$?
else  # not run: the program and every path it is given must be there
  [ -x "$(command -v "$1")" ] || { echo "no program $1"; exit 97; }
  for a in "$@"; do
    [[ $a == */* && $a != *=* ]] && ! [ -e "$a" ] && { echo "no file $a"; exit 96; }
  done
fi
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
"""


def check(args, env=None, timeout=900):
    out = tempfile.mkdtemp(prefix="gpu_check_")
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--standin"] + args + [out], capture_output=True, text=True,
                       cwd=ROOT, env=dict(ENV, **(env or {})), timeout=timeout)
    summary = json.load(open(os.path.join(out, "summary.json"))) if os.path.exists(
        os.path.join(out, "summary.json")) else None
    return p, out, summary


@unittest.skipUnless(SIM, "runs the script against the stand-in (build/sim); on a GPU run it directly")
class GpuCheck(unittest.TestCase):
    def test_every_stage_runs_and_is_summarised(self):
        tools = tempfile.mkdtemp(prefix="sanitizer_")
        tool = os.path.join(tools, "compute-sanitizer")
        with open(tool, "w") as f:
            f.write(FAKE_SANITIZER)
        os.chmod(tool, 0o755)
        # the tools over training only: the window plan's test below runs them over the op tests too
        # the bench stage's summary of both tables from the MLP and GPT rows (tests/test_bench.py checks every row)
        p, out, summary = check([], {"GPU_CHECK_SANITIZER": tool, "GPU_CHECK_SANITIZER_TARGETS": "train",
                                     "BENCH_ONLY": "MLP|GPT"})
        self.addCleanup(shutil.rmtree, out, True)
        self.addCleanup(shutil.rmtree, tools, True)
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        stages = {s["stage"]: s for s in summary["stages"]}
        self.assertEqual(list(stages), ["build", "data", "ops", "train", "faults", "sanitizer", "startup", "bench",
                                        "fmnist", "profile"])
        for name, s in stages.items():
            self.assertEqual(s["status"], "passed", (name, s, open(os.path.join(out, s["log"])).read()[-3000:]))
            self.assertTrue(os.path.getsize(os.path.join(out, s["log"])) > 0, name)
        self.assertGreaterEqual(stages["ops"]["passed"], 20)
        self.assertEqual(stages["ops"]["failed"], [])
        for name in ("train", "faults"):
            self.assertGreater(stages[name]["passed"], 0)
            self.assertEqual(stages[name]["failed"], [])
        runs = stages["sanitizer"]["runs"]
        self.assertEqual([(r["tool"], r["target"]) for r in runs],
                         [(t, "train") for t in ("memcheck", "racecheck", "synccheck", "initcheck")])
        self.assertTrue(all(r["errors"] == 0 and r["exit"] == 0 for r in runs), runs)
        calls = open(os.path.join(tools, "calls")).read().splitlines()
        self.assertEqual(len(calls), 4)
        self.assertIn("--tool memcheck --leak-check full", calls[0])
        self.assertIn("train.cuda_graph=on", calls[0])
        self.assertGreater(stages["startup"]["first_step_s"], 0)
        rows = [r for r in stages["bench"]["tables"] if not r.startswith("|---") and not r.startswith("| case")]
        self.assertEqual(len(rows), 3, stages["bench"]["tables"])  # the MLP, 2 GPT rows
        self.assertTrue(rows[0].startswith("| MLP") and rows[2].startswith("| GPT"), rows)
        self.assertGreater(stages["fmnist"]["val_acc"], 0.2)  # 12 steps from 10 classes' chance of 0.1
        self.assertEqual(stages["fmnist"]["steps"], 12)
        # the GPT row's kernels, the fused attention's on tensor cores (bf16) among them (the stand-in's CPU
        # time: plumbing only)
        kernels = [r.split(" | ")[0].strip("| ") for r in stages["profile"]["kernels"]]
        self.assertIn("attn_fwd_tc_kernel<bf16x2>", kernels)  # bfloat16 heads (heads16), 2 column groups
        self.assertRegex(stages["profile"]["kernels"][0], r"^\| \S+ \| \d+ \| [\d.]+ \| [\d.]+% \| [\d.]+ \|$")
        md = open(os.path.join(out, "summary.md")).read()
        self.assertIn("| stage | status | seconds | details |", md)
        self.assertIn("| sanitizer | passed |", md)
        self.assertIn("memcheck train: 0 errors", md)
        self.assertIn("## Benchmarks", md)
        self.assertIn("CPU stand-in", summary["env"]["mode"])

    def test_the_window_plan_runs_every_stage_in_its_parts(self):
        """scripts/gpu_window.sh: build and data, four parallel parts, the timings; every stage passes in
        some part, every sanitizer tool runs once (over the op tests), and summary.md joins the parts."""
        tools = tempfile.mkdtemp(prefix="sanitizer_")
        tool = os.path.join(tools, "compute-sanitizer")
        with open(tool, "w") as f:
            f.write(FAKE_SANITIZER)
        os.chmod(tool, 0o755)
        out = tempfile.mkdtemp(prefix="gpu_window_")
        self.addCleanup(shutil.rmtree, out, True)
        self.addCleanup(shutil.rmtree, tools, True)
        # the tools over the op tests only: the test above runs them over training; the op tests run
        # under memcheck only (the others' command lines are checked, not run: 25 s each here)
        p = subprocess.run(["bash", "scripts/gpu_window.sh", "--standin", out], capture_output=True, text=True,
                           cwd=ROOT, timeout=900, env=dict(ENV, GPU_CHECK_SANITIZER=tool, BENCH_ONLY="launch",
                                                           GPU_CHECK_SANITIZER_TARGETS="ops",
                                                           FAKE_SANITIZER_RUNS="memcheck"))
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        ran = {}
        for part in ("1-prepare", "2-ops-training", "3-precision-newer-faults", "4-sanitizer", "5-racecheck",
                     "6-timing"):
            with open(os.path.join(out, part, "summary.json")) as f:
                for s in json.load(f)["stages"]:
                    if "not asked for" not in s["why"]:
                        self.assertEqual(s["status"], "passed", (part, s))
                        ran.setdefault(s["stage"], []).append(part)
        self.assertEqual(sorted(ran), sorted(["build", "data", "ops", "train", "faults", "sanitizer", "startup",
                                              "bench", "fmnist", "profile"]))
        self.assertEqual(ran["train"], ["2-ops-training", "3-precision-newer-faults"])
        with open(os.path.join(tools, "calls")) as f:
            calls = sorted(" ".join(c.split()[:2]) + (" train" if "configs/model.yaml" in c else " ops") for c in f)
        self.assertEqual(calls, sorted(f"--tool {t} ops" for t in ("memcheck", "racecheck", "synccheck", "initcheck")))
        with open(os.path.join(out, "summary.md")) as f:
            md = f.read()
        for part in ("## 2-ops-training", "## 5-racecheck", "| fmnist | passed |", "launch to end of first step"):
            self.assertIn(part, md)
        self.assertNotIn("not asked for", md)

    def test_a_stage_that_fails_or_runs_out_of_time_does_not_stop_the_others(self):
        p, out, summary = check(["--stages", "data,train,startup,fmnist"],
                                {"GPU_CHECK_TRAIN_TESTS": "test_gpu_train.GpuTraining.test_no_such_test",
                                 "GPU_CHECK_LIMIT_STARTUP": "1"})
        self.addCleanup(shutil.rmtree, out, True)
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        got = {s["stage"]: (s["status"], s["why"]) for s in summary["stages"]}
        self.assertEqual(got["data"], ("passed", ""))
        self.assertEqual(got["train"], ("failed", "exit 1"))
        self.assertEqual(got["startup"], ("timed out", "past its limit of 1 s"))
        self.assertEqual(got["fmnist"][0], "passed")
        self.assertEqual(got["build"], ("skipped", "not asked for (--stages data,train,startup,fmnist)"))
        # a budget too small for any stage: each is skipped, saying why
        p, out, summary = check(["--stages", "ops,faults"], {"GPU_CHECK_BUDGET_S": "10"})
        self.addCleanup(shutil.rmtree, out, True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        got = {s["stage"]: (s["status"], s["why"]) for s in summary["stages"]}
        self.assertEqual(got["ops"], ("skipped", "no time left in the budget of 10 s"))
        self.assertEqual(got["faults"], ("skipped", "no time left in the budget of 10 s"))

    def test_a_test_that_ends_test_gpu_costs_only_its_own_result(self):
        """A GPU fault in one op test (the stand-in faults gather_kernel, which only cuda_op_gather runs)
        ends test_gpu's process there: the tests it did not report run again one a process, so the tests
        after it still pass, the faulting one is "not ok" with its exit status, the coverage test (which
        means something only over the whole run) skips, and the stage fails."""
        p, out, summary = check(["--stages", "ops"], {"GPUSIM_KERNEL_FAULT": "gather_kernel"})
        self.addCleanup(shutil.rmtree, out, True)
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        ops = next(s for s in summary["stages"] if s["stage"] == "ops")
        self.assertEqual((ops["status"], ops["failed"]), ("failed", ["cuda_op_gather"]), ops)
        names = subprocess.run([os.path.join(ROOT, "build/sim/tests/test_gpu"), "--list"], capture_output=True,
                               text=True, check=True).stdout.split()
        self.assertEqual(ops["passed"], len(names) - 2, ops)  # all but the gather test and the coverage test
        log = open(os.path.join(out, ops["log"])).read()
        self.assertIn("# test_gpu ended early (exit 70): each test it did not report, in a process of its own", log)
        self.assertIn("not ok 0 - cuda_op_gather # its process ended (exit 70) before reporting it", log)
        self.assertRegex(log, r"(?m)^ok 1 - cuda_upload_download_copy$")
        self.assertIn("not ok 1 # SKIP cuda_op_every_op_tested", log)

    def test_two_checks_can_make_the_same_data_file_at_once(self):
        """The data stage writes data/ in the checkout, and make test runs two whole-plan checks at once on
        a fresh clone: each writer must use a name of its own until its rename (one shared NAME.tmp failed
        here with h5py's "unable to lock file")."""
        d = tempfile.mkdtemp(prefix="data_")
        self.addCleanup(shutil.rmtree, d, True)
        out = os.path.join(d, "synthetic.h5")
        runs = [subprocess.Popen(["/usr/bin/python3", "scripts/make_synthetic.py", out, "512", "64"], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(3)]
        for p in runs:
            self.assertEqual(p.wait(timeout=120), 0, p.stdout.read())
        with h5py.File(out, "r") as f:
            self.assertEqual(f["train/images"].shape, (512, 3, 32, 32))
            self.assertEqual(f["test/labels"].shape, (64,))
        self.assertEqual(os.listdir(d), ["synthetic.h5"])

    def test_bad_usage_is_exit_2(self):
        for args, why in ((["--stages", "nope", "/tmp/x"], "unknown stage nope"),
                          (["--bogus", "/tmp/x"], "unknown option --bogus"), ([], "usage: scripts/gpu_check.sh")):
            p = subprocess.run(["bash", "scripts/gpu_check.sh"] + args, capture_output=True, text=True, cwd=ROOT)
            self.assertEqual(p.returncode, 2, args)
            self.assertIn(why, p.stderr)


if __name__ == "__main__":
    unittest.main()


# compute-sanitizer's report of one of NCCL's probes at init, as an H100 printed it (NCCL 2.28)
PROBE = """========= Program hit cudaErrorNoKernelImageForDevice (error 209) due to "no kernel image is available for \
execution on the device" on CUDA API call to cudaFuncGetAttributes.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame:  [0x4cb045] in libcuda.so.1
=========         Host Frame:  [0x1babc0] in libnccl.so.2
=========         Host Frame:  [0x71065] in libnccl.so.2
=========         Host Frame:  [0x9cb83] in libc.so.6
========= 
"""


class SanitizerReport(unittest.TestCase):
    """scripts/sanitizer_report.py: what counts as an error in compute-sanitizer's output."""

    def report(self, text):
        p = subprocess.run([sys.executable, "scripts/sanitizer_report.py"], input=text, capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
        return p.returncode, p.stdout.strip()

    def test_nccls_probes_are_not_errors_and_everything_else_is(self):
        self.assertEqual(self.report(PROBE * 4 + "========= ERROR SUMMARY: 4 errors\n"),
                         (0, "sanitizer: 0 errors (error summary: 4 reported, 4 of them NCCL's probes of kernels "
                             "built for other GPUs)"))
        ours = PROBE.replace("libnccl.so.2", "libddp_train_cuda.so")  # the same call from our code counts
        other = PROBE.replace("cudaFuncGetAttributes", "cudaLaunchKernel")  # another call from NCCL counts
        leak = "========= Leaked 1024 bytes at 0x7f0000000000\n=========     Saved host backtrace\n"
        for extra in (ours, other, leak):
            rc, line = self.report(PROBE * 2 + extra + "========= ERROR SUMMARY: 3 errors\n")
            self.assertEqual((rc, line.split(" (")[0]), (1, "sanitizer: 1 errors"), extra)

    def test_racechecks_summary_and_a_run_with_none(self):
        self.assertEqual(self.report("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")[0], 0)
        rc, line = self.report("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n")
        self.assertEqual((rc, line.split(" (")[0]), (1, "sanitizer: 1 errors"))
        self.assertEqual(self.report("step 1/20 epoch 1 loss 2.3\n"),
                         (2, "sanitizer: no summary (the run was cut off or did not start)"))
