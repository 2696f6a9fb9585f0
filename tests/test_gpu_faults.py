"""Failures on the CUDA path, over NCCL: a NaN exits 4, a hung rank exits 3 at the deadline,
SIGUSR1 exits 75 after a checkpoint and the resumed run is bit-identical to an uninterrupted one,
and an NCCL initialisation failure on one rank ends the job at once; the first three again with two
ranks sharing one GPU over MPI, which a machine of one GPU can run. In `make test` on the CPU
stand-in (tests/gpusim); `make test-gpu` runs them on real GPUs (NCCL needs two)."""
import time
import unittest

import numpy as np

from helpers import GPU_BINARY, Workdir, errors, gpu_setup, params, run

ENV2, VISIBLE2, SIM = gpu_setup(2)
ENV1, VISIBLE1, _ = gpu_setup(1)

GPU_CNN = """\
model:
  input: [1, 6, 6]
  layers:
    - conv2d: {{out: 4, kernel: 3, pad: 1, bias: false}}
    - batchnorm: {{}}
    - relu
    - maxpool: {{kernel: 2}}
    - flatten
    - linear: {{out: 8}}
    - dropout: {{p: 0.2}}
    - linear: {{out: 3}}
data:
  path: {dir}/data.h5
  scale: 0.00392156862745098
train: {{epochs: 3, global_batch_size: 8, seed: 3}}
optim: {{name: sgd, lr: 0.1, momentum: 0.9}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt}}
dist: {{comm: nccl}}
"""


class FaultCases:
    """The cases, for a TestCase that sets COMM (NCCL, GPU_CNN's dist.comm, or MPI) and ENV."""

    def setUp(self):
        self.w = Workdir()
        self.w.dataset(n=64)
        self.args = [self.w.config(GPU_CNN), "--device", "cuda"]
        if self.COMM == "MPI":
            self.args += ["--set", "dist.comm=mpi"]

    def tearDown(self):
        self.w.cleanup()

    def run_gpu(self, extra, fault=None, env=None, timeout=120):
        e = dict(self.ENV, **(env or {}))
        if fault:
            e["DDP_TRAIN_FAULT"] = fault
        t0 = time.monotonic()
        rc, out, err = run(self.args + extra, np_=2, timeout=timeout, binary=GPU_BINARY, env=e)
        return rc, out, err, time.monotonic() - t0

    def test_nan_exits_4_naming_the_rank_and_keeps_the_last_checkpoint(self):
        rc, out, err, _ = self.run_gpu(["--set", "checkpoint.every_steps=2"], fault="nan@1:3")
        self.assertEqual(rc, 4, out + err)
        self.assertIn("on rank 1", errors(err)[0])
        self.assertTrue(self.w.latest().endswith("step-00000002.h5"))

    def test_a_hung_rank_exits_3_at_the_deadline(self):
        """Without graphs the other rank waits in the step's NCCL all-reduce, polled on the host; with
        them (train.cuda_graph auto, NCCL on 2 ranks) it first waits in the ranks' collective choice of
        how the step runs, over MPI, which names the missing rank."""
        rc, out, err, took = self.run_gpu(["--set", "dist.timeout_s=4", "--set", "train.cuda_graph=off"],
                                          fault="hang@1:3")
        self.assertEqual(rc, 3, out + err)
        self.assertIn(f"gradients: {self.COMM}", out)
        if self.COMM == "NCCL":
            self.assertIn("the training step (forward, backward, NCCL gradient allreduce) at step 3", err)
        else:
            self.assertIn("gradient allreduce at step 3 did not complete within dist.timeout_s = 4 s: rank(s) 1 never "
                          "arrived", err)
        self.assertIn("dist.timeout_s = 4 s", err)
        self.assertLess(took, 30)
        rc, out, err, took = self.run_gpu(["--set", "dist.timeout_s=4"], fault="hang@1:3")
        self.assertEqual(rc, 3, out + err)
        if "gradients: NCCL" in out:
            self.assertIn("the CUDA graph choice at step 3 did not complete within dist.timeout_s = 4 s: rank(s) 1 "
                          "never arrived", err)
        self.assertLess(took, 30)

    def test_sigusr1_checkpoints_exits_75_and_resume_is_bit_exact(self):
        rc, out, err, _ = self.run_gpu([])
        self.assertEqual(rc, 0, out + err)
        full = params(self.w.latest())
        self.w.cleanup()
        self.setUp()
        rc, out, err, _ = self.run_gpu([], fault="signal@1:5")
        self.assertEqual(rc, 75, out + err)
        self.assertIn("stopped by SIGUSR1 at step 5 after saving a checkpoint", err)
        self.assertTrue(self.w.latest().endswith("step-00000005.h5"))
        rc, out, err, _ = self.run_gpu(["--resume", "auto"])
        self.assertEqual(rc, 0, out + err)
        self.assertIn("resuming at step 5", out)
        resumed = params(self.w.latest())
        for k in full:
            self.assertTrue(np.array_equal(full[k], resumed[k]), k)


    def test_a_signal_at_the_last_step_still_validates_it(self):
        """With NCCL, step 24 is queued behind step 23 when the signal comes: the stop is held until step
        24 is done, and that last step's validation still runs. On the stand-in also with work run as soon
        as it is queued (GPUSIM_STREAM_ORDER=eager), as a GPU ahead of the host runs step 24."""
        for order in ("lazy", "eager") if SIM else ("lazy",):
            rc, out, err, _ = self.run_gpu([], fault="signal@1:24", env={"GPUSIM_STREAM_ORDER": order})
            self.assertEqual(rc, 75, (order, out + err))
            self.assertIn("stopped by SIGUSR1 at step 24 after saving a checkpoint", err, order)
            self.assertRegex(out, r"(?m)^eval step 24 epoch 3: val_loss", order)


@unittest.skipUnless(VISIBLE2 >= 2, "fewer than 2 GPUs visible (NCCL needs one per rank)")
class GpuFaults(FaultCases, unittest.TestCase):
    COMM = "NCCL"
    ENV = ENV2

    @unittest.skipUnless(SIM, "needs the stand-in's fault injection (GPUSIM_NCCL_FAULT)")
    def test_an_nccl_init_failure_on_one_rank_ends_the_job_at_once(self):
        rc, out, err, took = self.run_gpu(["--set", "dist.timeout_s=60"], env={"GPUSIM_NCCL_FAULT": "init@1"})
        self.assertEqual(rc, 3, out + err)
        self.assertIn("on rank 1 (1 of 2 ranks failed): NCCL initialisation failed", errors(err)[0])
        self.assertLess(took, 30)  # not the 60 s deadline

    @unittest.skipUnless(SIM, "needs the stand-in's fault injection (GPUSIM_KERNEL_FAULT)")
    def test_a_gpu_fault_on_one_rank_ends_the_job_at_once_naming_it(self):
        """Rank 1's first kernel of step 4 (a replayed graph) faults as a GPU's illegal address would: the
        error surfaces at the host's next call, whose file and line are not the cause, so rank 1 names it a
        GPU fault and where to look rather than a bug at that line; the job ends at once with 70 (rank 0,
        waiting in step 4's all-reduce, with it) and step 2's checkpoint stays the latest. Rerun as the
        message advises, the fault names its op."""
        for order in ("lazy", "eager"):  # eagerly step 4 runs, and faults, before the host has read step 3
            self.w.cleanup()
            self.setUp()
            rc, out, err, took = self.run_gpu(["--set", "checkpoint.every_steps=2", "--set", "dist.timeout_s=60"],
                                              env={"GPUSIM_KERNEL_FAULT": "input_kernel:4@1",
                                                   "GPUSIM_STREAM_ORDER": order})
            self.assertEqual(rc, 70, out + err)
            self.assertIn("cuda graph: on", out)
            self.assertRegex(out, r"(?m)^step 2/")
            if order == "lazy":
                self.assertRegex(out, r"(?m)^step 3/")
            self.assertNotRegex(out, r"(?m)^step 4/")
            self.assertEqual(len(errors(err)), 1, err)
            self.assertRegex(errors(err)[0], r"^ddp_train: error: rank 1: the GPU faulted: an illegal memory access "
                             r"was encountered \(cudaErrorIllegalAddress\), reported by .+ at src/cuda/\S+:\d+\. ")
            self.assertIn("rerun with CUDA_LAUNCH_BLOCKING=1 and --set train.cuda_graph=off (each op then reports "
                          "its own fault), or under compute-sanitizer", errors(err)[0])
            self.assertNotIn("ddp_train: bug:", err)
            self.assertTrue(self.w.latest().endswith("step-00000002.h5"))
            self.assertLess(took, 30)  # not the 60 s deadline
        # the advice taken: each launch returns when its kernel has run (the stand-in runs eagerly, its order
        # left to CUDA_LAUNCH_BLOCKING), so the check after the op names it
        blocking = {"CUDA_LAUNCH_BLOCKING": "1", "GPUSIM_STREAM_ORDER": ""}
        self.w.cleanup()
        self.setUp()
        rc, out, err, _ = self.run_gpu(["--set", "train.cuda_graph=off"],
                                       env=dict(blocking, GPUSIM_KERNEL_FAULT="input_kernel:4@1"))
        self.assertEqual(rc, 70, out + err)
        self.assertEqual(len(errors(err)), 1, err)
        self.assertIn("ddp_train: error: rank 1: the GPU faulted: an illegal memory access was encountered "
                      "(cudaErrorIllegalAddress), reported by cudaGetLastError() after the input op at src/cuda/",
                      errors(err)[0])
        # a library that meets the fault first (cuDNN, whose convolution follows the 16-bit copy that faulted
        # within one op: the input's, which model.fuse true leaves to the input op) fails with its own status:
        # the context's fault is what is named
        self.w.cleanup()
        self.setUp()
        rc, out, err, _ = self.run_gpu(["--set", "train.cuda_graph=off", "--set", "train.precision=bf16", "--set",
                                        "model.fuse=false"],
                                       env=dict(blocking, GPUSIM_KERNEL_FAULT="pack16_kernel:1@1"))
        self.assertEqual(rc, 70, out + err)
        self.assertEqual(len(errors(err)), 1, err)
        self.assertRegex(errors(err)[0], r"^ddp_train: error: rank 1: the GPU faulted: an illegal memory access was "
                         r"encountered \(cudaErrorIllegalAddress\), reported by cudnn\w+\(.*\) at src/cuda/conv\.c:\d+\. ")


@unittest.skipUnless(VISIBLE1 >= 1, "no GPU visible")
class GpuFaultsSharedGpu(FaultCases, unittest.TestCase):
    """Two ranks on one GPU, gradients over MPI through host memory (no CUDA graphs)."""
    COMM = "MPI"
    ENV = ENV1


if __name__ == "__main__":
    unittest.main()
