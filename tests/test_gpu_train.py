"""The CUDA path in training, against the CPU backend: 50 steps of configs/model.yaml, N-rank
equivalence over NCCL (a GPU per rank) and over MPI (ranks sharing one GPU), a rank with no rows
in the last batch, checkpoints moving between --device cuda and --device cpu, and each rank
touching only its own GPU. In `make test` the GPU is the CPU stand-in (tests/gpusim, the binary
build/sim/ddp_train); `make test-gpu` runs the same tests on real GPUs. Skipped without a GPU."""
import glob
import os
import re
import shutil
import subprocess
import sys
import unittest
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

from helpers import BINARY, ENV, GPU_BINARY, ROOT, Workdir, errors, gpu_setup, params, run

ENV2, VISIBLE2, SIM = gpu_setup(2)
ENV1, VISIBLE1, _ = gpu_setup(1)

# A small CNN with everything the CUDA backend runs: convolution, synchronised batchnorm, pooling,
# dropout, linear layers; input normalised with data.mean and data.std.
GPU_CNN = """\
model:
  input: [1, 6, 6]
  layers:
    - conv2d: {{out: 4, kernel: 3, pad: 1, bias: false}}
    - batchnorm: {{sync: true}}
    - relu
    - maxpool: {{kernel: 2}}
    - flatten
    - linear: {{out: 8}}
    - {dropout}
    - linear: {{out: 3}}
data:
  path: {dir}/data.h5
  scale: 0.00392156862745098
  mean: [0.45]
  std: [0.25]
train: {{epochs: 2, global_batch_size: 8, seed: 3}}
optim: {{name: sgd, lr: 0.1, momentum: 0.9, nesterov: true}}
log: {{dir: {dir}/log, every_steps: 1}}
checkpoint: {{dir: {dir}/ckpt}}
"""


def assert_params_equal(test, got, want, what):
    test.assertEqual(sorted(got), sorted(want))
    for k in want:
        test.assertTrue(np.array_equal(got[k], want[k]), f"{what}: {k} differs")


def assert_params_close(test, got, want, rtol, what):
    test.assertEqual(sorted(got), sorted(want))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=rtol * 0.1, err_msg=f"{what}: {k}")


# model.layers' lines: a CNN's stem (a convolution without a bias, its batchnorm and relu) of 8 channels, and a
# ResNet basic block of `out` channels and its relu (a 1x1 projection shortcut where asked)
STEM = """\
    - conv2d: {out: 8, kernel: 3, pad: 1, bias: false}
    - batchnorm: {}
    - relu
"""


def basic_block(out, stride=1, projection=False):
    lines = f"""\
    - residual:
        body: [{{conv2d: {{out: {out}, kernel: 3, stride: {stride}, pad: 1, bias: false}}}}, {{batchnorm: {{}}}}, relu,
               {{conv2d: {{out: {out}, kernel: 3, pad: 1, bias: false}}}}, {{batchnorm: {{}}}}]
"""
    if projection:
        lines += f"""\
        shortcut: [{{conv2d: {{out: {out}, kernel: 1, stride: {stride}, bias: false}}}}, {{batchnorm: {{}}}}]
"""
    return lines + "    - relu\n"


def params_distance(got, want):
    """||got - want|| / ||want|| over all parameters."""
    return np.sqrt(sum(((got[k] - want[k]) ** 2).sum() for k in want) / sum((want[k] ** 2).sum() for k in want))


def gpu_run(args, np_, env, timeout=300, mpmd=None):
    return run(args, np_=np_, timeout=timeout, binary=GPU_BINARY, env=env, mpmd=mpmd)


# An MLP whose relus follow a linear with a bias and one without (images_config's layers).
MLP_RELUS = """\
    - flatten
    - linear: {out: 32}
    - relu
    - linear: {out: 24, bias: false}
    - relu
    - linear: {out: 3}
"""


class GpuCase(unittest.TestCase):
    """A work directory per test, and the losses a run logged."""

    def setUp(self):
        self.w = Workdir()

    def tearDown(self):
        self.w.cleanup()

    def losses(self, sub):
        return [r["loss"] for r in self.w.metrics(sub) if "loss" in r]

    def precision_runs(self, args, env=None, timeout=600):
        """args on one rank in fp32 on the CPU ("cpu") and in tf32, bf16 and fp16 on the GPU, each logging
        to the work directory's folder of its name; {name: (exit code, stdout, stderr)}. Two at a time, each
        free to use every core (mpirun binds a 1-rank job to core 0, every job to the same one): the
        stand-in runs a GPU's kernels on one core."""
        free = dict(env or {}, OMPI_MCA_hwloc_base_binding_policy="none")

        def one(name):
            if name == "cpu":
                return run(args + ["--device", "cpu", "--set", f"log.dir={self.w.file('cpu')}"], timeout=timeout,
                           env=free)
            return gpu_run(args + ["--device", "cuda", "--set", f"train.precision={name}", "--set",
                                   f"log.dir={self.w.file(name)}"], 1, dict(ENV1, **free), timeout)

        names = ("cpu", "tf32", "bf16", "fp16")
        with ThreadPoolExecutor(2) as pool:
            return dict(zip(names, pool.map(one, names)))


    def images_config(self, name, layers):
        """A config over 48 random (2, 8, 8) images: the given layers (model.layers' lines), 4 SGD steps of 12
        rows with no CUDA graphs, a loss logged each step. Returns its path."""
        self.w.dataset(n=48, shape=(2, 8, 8))
        cfg = self.w.file(name)
        with open(cfg, "w") as f:
            f.write("model:\n  input: [2, 8, 8]\n  layers:\n" + layers + f"""\
data: {{path: {self.w.file("data.h5")}, scale: 0.00392156862745098, val: {{x: ""}}}}
train: {{max_steps: 4, global_batch_size: 12, seed: 5, cuda_graph: off}}
optim: {{name: sgd, lr: 0.1, momentum: 0.9}}
log: {{every_steps: 1}}
""")
        return cfg


@unittest.skipUnless(VISIBLE1, "no GPU visible (ddp_train --info)")
class GpuTraining(GpuCase):
    def test_50_steps_of_the_default_cnn_match_the_cpu(self):
        """The first 50 steps of `make run` (configs/model.yaml on 2 ranks, a GPU each where there are
        two) against the CPU backend. SIGUSR1 at step 50 stops the runs, so the learning-rate schedule
        is the full run's. Rounding differs between backends and SGD amplifies it (about x1.15 per
        step here, CPU against the stand-in): the first 10 losses agree to 1e-4, all 50 to 5e-2."""
        common = ["configs/model.yaml", "--set", "data.shuffle=false", "--set", "log.every_steps=1", "--set",
                  "data.val.x=", "--set", "checkpoint.dir="]
        stop = {"DDP_TRAIN_FAULT": "signal@0:50"}
        rc, out, err = run(common + ["--device", "cpu", "--set", f"log.dir={self.w.file('cpu')}"], np_=2, timeout=600,
                           env=stop)
        self.assertEqual(rc, 75, out + err)
        rc, out, err = gpu_run(common + ["--device", "cuda", "--set", f"log.dir={self.w.file('gpu')}"], 2,
                               dict(ENV2, **stop), timeout=600)  # 220 s here beside another test (pyrun -j 2)
        self.assertEqual(rc, 75, out + err)
        self.assertIn("cuda backend", out)
        cpu, gpu = self.losses("cpu"), self.losses("gpu")
        self.assertEqual(len(gpu), 50)
        np.testing.assert_allclose(gpu[:10], cpu[:10], rtol=1e-4)
        np.testing.assert_allclose(gpu, cpu, rtol=5e-2)
        self.assertLess(gpu[-1], 0.5 * gpu[0])  # and it learns
        readings = [r for r in self.w.metrics("gpu") if "loss" in r][-1]["gpu"]  # NVML, one per rank
        self.assertEqual([r["rank"] for r in readings], [0, 1])
        for r in readings:
            self.assertGreater(r["mem_peak_mib"], 0)
            for key in ("mem_used_mib", "util_pct", "power_w", "temp_c"):
                self.assertIn(key, r)

    def equivalence(self, np_, env, extra):
        """Final parameters of np_ ranks on the GPU against one rank, to 1e-5."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")  # no dropout: its masks depend on the rank
        base = [cfg, "--device", "cuda", "--set", "data.shuffle=false"] + extra
        rc, out, err = gpu_run(base + ["--set", f"checkpoint.dir={self.w.file('one')}"], 1, env)
        self.assertEqual(rc, 0, out + err)
        rc, out, err = gpu_run(base + ["--set", f"checkpoint.dir={self.w.file('many')}"], np_, env)
        self.assertEqual(rc, 0, out + err)
        assert_params_close(self, params(self.w.latest("many")), params(self.w.latest("one")), 1e-5,
                            f"{np_} ranks against 1")
        return out

    @unittest.skipUnless(VISIBLE2 >= 2, "fewer than 2 GPUs visible")
    def test_two_ranks_over_nccl_equal_one_rank(self):
        out = self.equivalence(2, ENV2, ["--set", "dist.comm=nccl"])
        self.assertIn("gradients: NCCL", out)
        self.assertIn("GPU 1:", out)  # rank 1 on its own GPU

    @unittest.skipUnless(SIM, "needs the stand-in's fault injection (GPUSIM_NCCL_FAULT)")
    def test_one_rank_makes_no_nccl_communicator_unless_it_rounds_to_bf16(self):
        """One rank has nothing to sum: an NCCL set-up that would fail is never reached, whatever dist.comm
        says; under dist.grad_dtype bf16 it is (NCCL's bf16 sum rounds the gradients as N ranks' are)."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        env = dict(ENV1, GPUSIM_NCCL_FAULT="init@0")
        for comm in ("auto", "nccl"):
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"dist.comm={comm}", "--set",
                                    "train.max_steps=2"], 1, env)
            self.assertEqual(rc, 0, out + err)
            self.assertIn("gradients: one rank, nothing to sum (no NCCL communicator)", out)
        rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", "dist.grad_dtype=bf16", "--set", "train.max_steps=2"],
                               1, env)
        self.assertEqual(rc, 3, out + err)
        self.assertIn("NCCL initialisation failed", errors(err)[0])

    def test_two_ranks_sharing_one_gpu_over_mpi_equal_one_rank(self):
        out = self.equivalence(2, ENV1, ["--set", "dist.comm=mpi"])
        self.assertIn("gradients: MPI through host memory (dist.comm mpi)", out)

    def test_device_auto_takes_a_gpu_of_its_own_else_the_cpu(self):
        """--device auto (the default): the GPU when every rank has one of its own, the same training as
        --device cuda bit for bit; the CPU, saying why, when two ranks would share one or a GPU has no
        code in this build; nothing said where there is no GPU at all."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        steps = ["--set", "train.max_steps=3"]
        rc, out, err = gpu_run([cfg, "--device", "auto"] + steps, 1, ENV1)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("device: cuda (--device auto: every rank has a GPU of its own)", out)
        self.assertRegex(out, r"(?m)^training: .* cuda backend")
        rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"checkpoint.dir={self.w.file('cuda')}"] + steps,
                               1, ENV1)
        self.assertEqual(rc, 0, out + err)
        auto, cuda = params(self.w.latest("ckpt")), params(self.w.latest("cuda"))
        for k in cuda:
            self.assertTrue(np.array_equal(auto[k], cuda[k]), k)
        rc, out, err = gpu_run([cfg, "--device", "auto", "--set", f"checkpoint.dir={self.w.file('two')}"] + steps,
                               2, ENV1)
        self.assertEqual(rc, 0, out + err)
        self.assertRegex(out, r"(?m)^device: cpu \(--device auto: ranks 0 and 1 use the same GPU \(PCI \S+ on \S+\) "
                              r"\(--device cuda shares them over MPI\)\)$")
        self.assertRegex(out, r"(?m)^training: .* cpu backend")
        if SIM:  # a GPU older than the build's code
            rc, out, err = gpu_run([cfg, "--device", "auto", "--set", f"checkpoint.dir={self.w.file('old')}"] + steps,
                                   1, dict(ENV1, GPUSIM_CC="6.1"))
            self.assertEqual(rc, 0, out + err)
            self.assertRegex(out, r"(?m)^device: cpu \(--device auto: rank 0: GPU 0 of rank 0 \(\S+\) has compute "
                                  r"capability 6\.1, which this build has no code for\)$")
        if "GPUs: none" in subprocess.run([BINARY, "--info"], capture_output=True, text=True, env=ENV).stdout:
            rc, out, err = run([cfg, "--device", "auto", "--set", f"checkpoint.dir={self.w.file('none')}"] + steps)
            self.assertEqual(rc, 0, out + err)
            self.assertNotIn("device:", out)
            self.assertRegex(out, r"(?m)^training: .* cpu backend")

    def gpt_config(self):
        """A GPT (embedding with positions, pre-LN blocks with causal attention and attention dropout, tied
        head, padding left out by ignore_index) on 26 rows of 9 tokens (18 for training): its config's path."""
        rng = np.random.default_rng(0)
        rows = rng.integers(1, 20, (26, 9)).astype(np.int32)
        for r in rows:  # padding of varying length: each step averages over a different count
            r[rng.integers(3, 9):] = 0
        with h5py.File(self.w.file("tokens.h5"), "w") as f:
            f["train/tokens"] = rows[:18]
            f["val/tokens"] = rows[18:]
        cfg = self.w.config("""\
            model:
              input: [8]
              layers:
                - embedding: {{vocab: 20, dim: 24}}
                - repeat:
                    times: 2
                    layers:
                      - residual: {{body: [layernorm: {{}}, attention: {{heads: 3, dropout: 0.1}}]}}
                      - residual: {{body: [layernorm: {{}}, linear: {{out: 48}}, gelu: {{approximate: tanh}},
                                          linear: {{out: 24}}, dropout: {{p: 0.1}}]}}
                - layernorm: {{}}
                - linear: {{out: 20, bias: false, tie: "0"}}
              loss: {{cross_entropy: {{ignore_index: 0}}}}
            data: {{path: {dir}/tokens.h5, train: {{x: /train/tokens}}, val: {{x: /val/tokens}}}}
            train: {{epochs: 3, global_batch_size: 8, seed: 2, clip_grad_norm: 1.0}}
            optim: {{name: adamw, lr: 0.003, weight_decay: 0.1, no_decay: [bias, norm, embedding]}}
            log: {{dir: {dir}/log, every_steps: 1}}
            """)
        return cfg

    def test_transformer_matches_the_cpu(self):
        """The GPT on 2 ranks: CUDA against the CPU, steps captured as graphs after the first and replayed
        although each step's count of real targets differs (the loss weight is read on the device). The last
        global batch has 2 rows: a rank runs one. AdamW steps the runs optim.no_decay cuts the parameters
        into (with and without decay in turn) in one launch a step (the stand-in's profile)."""
        cfg = self.gpt_config()
        rc, out, err = run([cfg, "--device", "cpu", "--set", f"checkpoint.dir={self.w.file('cpu')}",
                            "--set", f"log.dir={self.w.file('cpu')}"], np_=2)
        self.assertEqual(rc, 0, out + err)
        rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"checkpoint.dir={self.w.file('gpu')}",
                                "--set", f"log.dir={self.w.file('gpu')}"], 2,
                               dict(ENV2 if VISIBLE2 >= 2 else ENV1, GPUSIM_PROFILE="1"))
        self.assertEqual(rc, 0, out + err)
        self.assertIn("cuda backend", out)
        if SIM:
            self.assertEqual(re.findall(r"^\s*adamw_kernel\s+(\d+)\s", err, re.M), ["9", "9"])
        if VISIBLE2 >= 2:  # NCCL: the step is captured
            self.assertRegex(out, r"cuda graph: \d+ steps? captured, [3-9] replayed")  # every full step after 2
        cpu, gpu = self.losses("cpu"), self.losses("gpu")
        self.assertEqual(len(gpu), 9)
        np.testing.assert_allclose(gpu, cpu, rtol=1e-5)
        val = [[r["val_loss"] for r in self.w.metrics(d) if "val_loss" in r] for d in ("cpu", "gpu")]
        np.testing.assert_allclose(val[1], val[0], rtol=1e-5)
        got, want = params(self.w.latest("gpu")), params(self.w.latest("cpu"))
        # each attention's key bias has a zero gradient up to rounding (softmax ignores a score added to
        # every key of a query), which AdamW scales up to steps of lr: rounding's, not the backends'
        # (on an H100 its CUDA and CPU values differed by 3e-4 after 9 steps; both layers' biases)
        for bias in [k for k in want if k.endswith(".qkv.bias")]:
            got[bias], want[bias] = np.delete(got[bias], np.s_[24:48]), np.delete(want[bias], np.s_[24:48])
        # the key weights' gradient is sum_j dk_j x_j with sum_j dk_j = 0 (the same invariance): a sum that
        # cancels its mean part, whose rounding AdamW scales up like the bias's. CUDA runs the fused attention
        # (model.attention auto) and the CPU the materialised one, which round differently: after 9 steps
        # one key weight differed by 3e-6 (1e-3 lr); the keys' rows are held to 1e-5 absolute (3e-3 lr)
        for weight in [k for k in want if k.endswith(".qkv.weight")]:
            np.testing.assert_allclose(got[weight][24:48], want[weight][24:48], rtol=0, atol=1e-5, err_msg=weight)
            got[weight], want[weight] = np.delete(got[weight], np.s_[24:48], 0), np.delete(want[weight], np.s_[24:48], 0)
        assert_params_close(self, got, want, 1e-5, "CUDA against CPU")

    def test_a_layernorm_opening_a_residual_adds_its_shortcut_gradient(self):
        """model.fuse: the layernorm opening each pre-LN block's residual adds the identity shortcut's gradient
        into its input gradient as it writes it, where the residual added it in a pass of its own. The GPT's 9
        steps on the CPU end bit for bit where model.fuse false does, as does a pre-activation residual whose
        body opens with a batchnorm (which adds nothing); on CUDA the stand-in counts one add a residual and
        step fewer (the backward's; the forward's sums and validation's remain)."""
        cfg = self.gpt_config()
        for fuse in ("true", "false"):
            rc, out, err = run([cfg, "--device", "cpu", "--set", f"model.fuse={fuse}", "--set",
                                f"checkpoint.dir={self.w.file('cpu' + fuse)}", "--set", "log.dir="], np_=2)
            self.assertEqual(rc, 0, out + err)
        assert_params_equal(self, params(self.w.latest("cputrue")), params(self.w.latest("cpufalse")), "cpu")
        # a batchnorm opening a pre-activation residual's body adds nothing: the residual adds the shortcut's
        # gradient itself (it once gave the batchnorm the layernorm's role, and the shortcut's gradient was lost)
        preact = self.images_config("preact.yaml", """\
    - conv2d: {out: 4, kernel: 3, pad: 1}
    - residual: {body: [batchnorm: {}, relu: {}, conv2d: {out: 4, kernel: 3, pad: 1}]}
    - flatten
    - linear: {out: 3}
""")
        for fuse in ("true", "false"):
            rc, out, err = run([preact, "--device", "cpu", "--set", f"model.fuse={fuse}", "--set",
                                f"checkpoint.dir={self.w.file('preact' + fuse)}"])
            self.assertEqual(rc, 0, out + err)
        assert_params_equal(self, params(self.w.latest("preacttrue")), params(self.w.latest("preactfalse")), "preact")
        if not SIM:
            return
        adds = {}
        for fuse in ("true", "false"):
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"model.fuse={fuse}", "--set",
                                    f"checkpoint.dir={self.w.file('gpu' + fuse)}", "--set", "log.dir="], 1,
                                   dict(ENV1, GPUSIM_PROFILE="1"))
            self.assertEqual(rc, 0, out + err)
            adds[fuse] = int(re.search(r"^\s*add_kernel\s+(\d+)\s", err, re.M).group(1))
        self.assertEqual(adds["false"] - adds["true"], 4 * 9, adds)  # 4 residuals, 9 steps

    def test_a_rank_with_no_rows_matches_the_cpu(self):
        """42 rows, a global batch of 8 on 3 ranks: the last batch has 2 rows, so rank 2 gets none."""
        self.w.dataset(n=42)
        cfg = self.w.config(GPU_CNN, dropout="dropout: {p: 0.2}")
        base = [cfg, "--set", "train.epochs=1", "--set", "dist.comm=mpi"]
        rc, out, err = run(base + ["--device", "cpu", "--set", f"checkpoint.dir={self.w.file('cpu')}"], np_=3)
        self.assertEqual(rc, 0, out + err)
        rc, out, err = gpu_run(base + ["--device", "cuda", "--set", f"checkpoint.dir={self.w.file('gpu')}"], 3, ENV1)
        self.assertEqual(rc, 0, out + err)
        assert_params_close(self, params(self.w.latest("gpu")), params(self.w.latest("cpu")), 1e-5, "CUDA against CPU")

    def test_checkpoints_move_between_cuda_and_cpu(self):
        """4 steps on one device, 4 more resumed on the other: the same as 8 on the CPU."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="dropout: {p: 0.2}")
        base = [cfg, "--set", "checkpoint.every_steps=4"]
        rc, out, err = run(base + ["--device", "cpu", "--set", "train.max_steps=8", "--set",
                                   f"checkpoint.dir={self.w.file('cpu8')}"], np_=2)
        self.assertEqual(rc, 0, out + err)
        want = params(self.w.latest("cpu8"))
        for first, second in (("cuda", "cpu"), ("cpu", "cuda")):
            sub = f"{first}_{second}"
            args = base + ["--set", f"checkpoint.dir={self.w.file(sub)}", "--set", f"log.dir={self.w.file(sub)}"]
            runner = {"cpu": lambda a: run(a, np_=2), "cuda": lambda a: gpu_run(a, 2, ENV1)}
            rc, out, err = runner[first](args + ["--device", first, "--set", "train.max_steps=4"])
            self.assertEqual(rc, 0, out + err)
            rc, out, err = runner[second](args + ["--device", second, "--set", "train.max_steps=8", "--resume", "auto"])
            self.assertEqual(rc, 0, out + err)
            self.assertIn("resuming at step 4", out)
            assert_params_close(self, params(self.w.latest(sub)), want, 1e-5, f"{first} then {second}")

    def test_each_rank_touches_only_its_own_gpu(self):
        """--info, --dry-run and a short run on 2 ranks with 2 GPUs: no rank makes a CUDA context on
        another rank's GPU (the stand-in stops a process that does)."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        for args in (["--info"], [cfg, "--device", "cuda", "--dry-run"],
                     [cfg, "--device", "cuda", "--set", "train.max_steps=2"]):
            rc, out, err = gpu_run(args, 2, ENV2)
            self.assertEqual(rc, 0, out + err)
            self.assertNotIn("gpusim: error", err)
        if VISIBLE2 >= 2:
            self.assertIn("GPU 1:", out)

    def test_a_tensor_too_large_for_the_kernels_is_refused(self):
        """The kernels and cuDNN index tensors with 32 bits: a batch whose largest tensor reaches 2^31
        values is an exit-2 error naming the limit, before anything is allocated."""
        cfg = self.w.config("""\
            model:
              input: [1, 4096, 4096]
              layers: [{{conv2d: {{out: 64, kernel: 3, pad: 1}}}}, flatten, {{linear: {{out: 2}}}}]
            data: {{path: {dir}/none.h5}}
            train: {{batch_size: 2}}
            """)
        rc, out, err = gpu_run([cfg, "--device", "cuda"], 1, ENV1)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("the largest tensor holds 3221225472 values per rank (3 rows x 1073741824)", errors(err)[0])
        # attention's (B, H, T, T) scores count too: 4 heads of a context of 8192 is 2^28 values a sample
        cfg = self.w.config("""\
            model:
              input: [8192]
              layers:
                - embedding: {{vocab: 256, dim: 64}}
                - attention: {{heads: 4, causal: true}}
                - linear: {{out: 256}}
              loss: cross_entropy
            data: {{path: {dir}/none.h5, train: {{x: /train/tokens}}}}
            train: {{batch_size: 7}}
            """)
        rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", "model.attention=materialized"], 1, ENV1)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("the largest tensor holds 2147483648 values per rank (8 rows x 268435456)", errors(err)[0])
        # fused (model.attention auto, on CUDA), no (B, H, T, T) tensor exists: the check passes and the
        # run goes on to the data, which is missing
        rc, out, err = gpu_run([cfg, "--device", "cuda"], 1, ENV1)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("none.h5: data.path: cannot open", errors(err)[0])

    @unittest.skipUnless(SIM, "needs the stand-in's GPUSIM_SEED")
    def test_results_do_not_depend_on_the_order_threads_run(self):
        """The stand-in runs blocks and threads in an order GPUSIM_SEED decides, as a GPU's scheduler
        would: two seeds must give the same bits, which a race in any kernel (a missing barrier, an
        order of atomic additions that reaches the parameters) would break. With gradient clipping,
        so that the sum of squares reaches them too. The second and third run also run ready streams
        in a seeded order (the copy stream's uploads, NCCL's stream), the third eagerly (no graphs):
        a missing event between streams would change the bits, and the hazard checker stops it."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="dropout: {p: 0.2}")
        runs = ((1, "lazy", "auto"), (2, "seeded", "auto"), (3, "seeded", "off"))
        for seed, order, graphs in runs:
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", "train.clip_grad_norm=0.05", "--set",
                                    f"train.cuda_graph={graphs}", "--set", f"checkpoint.dir={self.w.file(f'seed{seed}')}"],
                                   2, dict(ENV2, GPUSIM_SEED=str(seed), GPUSIM_STREAM_ORDER=order))
            self.assertEqual(rc, 0, out + err)
        a = params(self.w.latest("seed1"))
        for seed in (2, 3):
            b = params(self.w.latest(f"seed{seed}"))
            for k in a:
                self.assertTrue(np.array_equal(a[k], b[k]), (seed, k))

    @unittest.skipUnless(SIM, "needs the stand-in: one rank shown 2 GPUs and the other 1")
    def test_nodes_with_different_gpu_counts_agree_on_mpi(self):
        """dist.comm auto with one rank seeing 2 GPUs and the other 1, both on the GPU at the first bus
        id: both must use MPI (before, the first chose NCCL and the second MPI, and the job hung until
        dist.timeout_s)."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        args = [cfg, "--device", "cuda", "--set", "train.max_steps=3", "--set", "dist.timeout_s=20"]
        rc, out, err = gpu_run(None, 2, {}, timeout=120,
                               mpmd=[({"GPUSIM_DEVICES": 2}, args), ({"GPUSIM_DEVICES": 1}, args)])
        self.assertEqual(rc, 0, out + err)
        self.assertIn("gradients: MPI through host memory (dist.comm auto: ranks 0 and 1 use the same GPU (PCI "
                      "0000:18:00.0 on ", out)

    @unittest.skipUnless(SIM, "needs the stand-in's GPUSIM_DEVICES per rank")
    def test_a_gpu_bound_to_each_task_is_told_apart_by_bus_id(self):
        """srun --gpus-per-task=1 binds one GPU to each rank through CUDA_VISIBLE_DEVICES: every rank
        sees one device, device 0, yet each has a GPU of its own, and dist.comm auto must choose NCCL
        (before, it counted visible devices and chose MPI). The same binding onto one GPU shares it:
        MPI, and dist.comm nccl is refused."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        args = [cfg, "--device", "cuda", "--set", "train.max_steps=3", "--set", "dist.timeout_s=20"]
        own = [({"GPUSIM_DEVICES": 2, "CUDA_VISIBLE_DEVICES": r}, args) for r in (0, 1)]
        rc, out, err = gpu_run(None, 2, {}, timeout=120, mpmd=own)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("gradients: NCCL", out)
        rc, out, err = gpu_run(None, 2, {}, timeout=120, mpmd=[(dict(e, **{"CUDA_VISIBLE_DEVICES": 1}), a)
                                                                  for e, a in own])
        self.assertEqual(rc, 0, out + err)
        self.assertIn("gradients: MPI through host memory (dist.comm auto: ranks 0 and 1 use the same GPU (PCI "
                      "0000:2a:00.0 on ", out)
        rc, out, err = gpu_run(None, 2, {}, timeout=120,
                               mpmd=[(dict(e, **{"CUDA_VISIBLE_DEVICES": 1}), a + ["--set", "dist.comm=nccl"])
                                     for e, a in own])
        self.assertEqual(rc, 2, out + err)
        self.assertIn("dist.comm nccl: ranks 0 and 1 use the same GPU (PCI 0000:2a:00.0", errors(err)[0])

    def test_device_cache_equals_memory_cache(self):
        """data.cache device gathers each batch on the device from the cached rows: the same bits as
        data.cache memory, on the CPU backend and on CUDA (2 ranks, global and contiguous sharding,
        graphs on), and a NaN injected into a gathered batch still exits 4."""
        self.w.dataset(n=52)
        cfg = self.w.config(GPU_CNN, dropout="dropout: {p: 0.2}")
        cases = [("cpu", ["--device", "cpu"], ENV, []),
                 ("cuda", ["--device", "cuda"], ENV2, []),
                 ("cuda_contiguous", ["--device", "cuda"], ENV2, ["--set", "data.sharding=contiguous"])]
        for name, device, env, extra in cases:
            got = {}
            for cache in ("memory", "device"):
                sub = f"{name}_{cache}"
                rc, out, err = gpu_run([cfg, "--set", f"data.cache={cache}", "--set", f"checkpoint.dir={self.w.file(sub)}"]
                                       + device + extra, 2, env)
                self.assertEqual(rc, 0, out + err)
                self.assertEqual("data.cache device: " in out, cache == "device", out)
                got[cache] = params(self.w.latest(sub))
            for k in got["memory"]:
                self.assertTrue(np.array_equal(got["memory"][k], got["device"][k]), f"{name}: {k}")
        rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", "data.cache=device", "--set",
                                f"checkpoint.dir={self.w.file('nan')}"], 2, dict(ENV2, DDP_TRAIN_FAULT="nan@1:2"))
        self.assertEqual(rc, 4, out + err)  # synchronised batchnorm spreads the NaN: every rank sees it
        self.assertIn("the loss became NaN at step 2", errors(err)[0])

    def graph_runs(self, np_, env, extra):
        """21 steps of GPU_CNN (20 full global batches of 8, then 4 rows) with train.cuda_graph on and
        off, on with train.queue_ahead false ("in_turn"), and on again with the stand-in running work as
        soon as it is queued ("eager": where the lazy default runs a step queued ahead only when the host
        waits for it, so that a host slot it overwrites still holds the step before's results, as a GPU
        that is ahead of the host would not); validation after steps 10, 20 and 21, a checkpoint after
        every third step (all kept). Returns each run's last checkpoint, stdout, stderr, every
        checkpoint, and each step's loss and validation line."""
        self.w.dataset(n=164)
        cfg = self.w.config(GPU_CNN, dropout="dropout: {p: 0.2}")
        base = [cfg, "--device", "cuda", "--set", "train.epochs=1", "--set", "train.eval_every_steps=10", "--set",
                "train.ema.decay=0.9", "--set", "train.clip_grad_norm=0.5", "--set", "optim.name=adamw", "--set",
                "optim.lr=0.01", "--set", "checkpoint.every_steps=3", "--set", "checkpoint.keep=100"] + extra
        got = {}
        for mode in ("on", "off", "in_turn", "eager") if SIM else ("on", "off", "in_turn"):
            order = "eager" if mode == "eager" else "lazy"
            rc, out, err = gpu_run(base + ["--set", f"train.cuda_graph={'off' if mode == 'off' else 'on'}",
                                           "--set", f"train.queue_ahead={mode != 'in_turn'}".lower(), "--set",
                                           f"checkpoint.dir={self.w.file(mode)}", "--set",
                                           f"log.dir={self.w.file(mode + '_log')}"], np_,
                                   dict(env, GPUSIM_PROFILE="1", GPUSIM_STREAM_ORDER=order))
            self.assertEqual(rc, 0, out + err)
            every = sorted(glob.glob(os.path.join(self.w.file(mode), "step-*.h5")))
            got[mode] = (self.w.latest(mode), out, err, every,
                         re.findall(r"(?m)^eval step .*$|^step \d+/\d+ epoch \d+ loss \S+", out))
        return got

    def assert_same_bits(self, path_a, path_b):
        """Every dataset of two checkpoints, EMA and optimizer state included, equal to the bit."""
        with h5py.File(path_a, "r") as a, h5py.File(path_b, "r") as b:
            names = []
            a.visit(lambda n: names.append(n) if isinstance(a[n], h5py.Dataset) else None)
            self.assertTrue(any(n.startswith("ema/") for n in names) and any(n.startswith("optim") for n in names),
                            names)
            for n in names:
                self.assertTrue(np.array_equal(a[n][...], b[n][...]), f"{path_a}: {n}")

    def assert_graphs_replayed_bit_for_bit(self, got, np_):
        """Every full step after the first ran as a graph (19: each captured step is replayed once, then
        each graph again), by ddp_train's count and, on the stand-in, by its own count of launches per
        rank; none with cuda_graph off; and every tensor of the checkpoints, EMA and optimizer state
        included, equal to the bit."""
        counts = re.findall(r"^cuda graph: (\d+) steps? captured, (\d+) replayed$", got["on"][1], re.M)
        self.assertEqual(len(counts), 1, got["on"][1][-3000:])
        captures, replays = map(int, counts[0])
        self.assertEqual(captures + replays, 19, counts)
        self.assertGreaterEqual(captures, 2)  # one per input buffer, again after a workspace moved
        self.assertNotRegex(got["off"][1], r"^cuda graph: \d+ steps? captured")
        if SIM:
            on_launches = [(int(i), int(n)) for i, n in
                           re.findall(r"gpusim graphs \(pid \d+\): (\d+) instantiated, (\d+) launches", got["on"][2])]
            self.assertEqual(len(on_launches), np_, got["on"][2][-3000:])
            for instantiated, launches in on_launches:
                self.assertEqual(launches, 19)
                self.assertGreaterEqual(instantiated, 2)
            self.assertNotRegex(got["off"][2], r"gpusim graphs \(pid \d+\): \d+ instantiated, [1-9]")
        self.assertIn("cuda graph: on", got["on"][1])
        self.assertIn("cuda graph: off (train.cuda_graph off)", got["off"][1])
        # Replayed steps are queued before the step before them is read back, but never behind a step
        # that validation or a checkpoint follows (3, 6, ..., 21 and 10, 20), which must read that
        # step's parameters: each checkpoint and validation equals the eager run's.
        queued = re.findall(r"(?m)^queued ahead: (\d+) of 21 steps were queued while the step before ran$",
                            got["on"][1])
        self.assertEqual(len(queued), 1, got["on"][1][-3000:])
        # steps 2 and 3 captured, 4-20 replayed (21 has 4 rows: eager): all but 4, 7, 10, 11, 13, 16 and 19
        if captures == 2:
            self.assertEqual(int(queued[0]), replays - 7)
        self.assertGreaterEqual(int(queued[0]), 6)
        self.assertNotIn("queued ahead:", got["off"][1] + got["in_turn"][1])
        self.assertEqual(re.findall(r"(?m)^cuda graph: .* replayed$", got["in_turn"][1]), [f"cuda graph: {captures} "
                         f"steps captured, {replays} replayed"])
        if SIM:  # queued ahead as often when the device is ahead of the host
            self.assertEqual(re.findall(r"(?m)^queued ahead: .*$", got["eager"][1]),
                             [f"queued ahead: {queued[0]} of 21 steps were queued while the step before ran"])
        for mode in ("off", "in_turn", "eager") if SIM else ("off", "in_turn"):
            self.assertEqual([os.path.basename(p) for p in got[mode][3]], [f"step-{i:08d}.h5" for i in range(3, 22, 3)])
            for a, b in zip(got["on"][3], got[mode][3]):
                self.assert_same_bits(a, b)
            self.assertEqual(len(got[mode][4]), 21 + 3, got[mode][1])  # each step's loss, as read back, and 3 evaluations
            self.assertEqual(got["on"][4], got[mode][4])

    def test_cuda_graph_replay_equals_eager_on_one_rank(self):
        """With bf16 gradient sums, so that one rank still makes an NCCL communicator and its graphs hold
        NCCL's all-reduce (one GPU is all a lent machine has)."""
        got = self.graph_runs(1, ENV1, ["--set", "dist.grad_dtype=bf16"])
        self.assertIn("gradients: NCCL", got["on"][1])
        self.assert_graphs_replayed_bit_for_bit(got, 1)

    @unittest.skipUnless(VISIBLE2 >= 2, "fewer than 2 GPUs visible")
    def test_cuda_graph_replay_equals_eager_over_nccl(self):
        """The graph holds the bucketed NCCL all-reduce and the synchronised batchnorm sums: buckets of 52
        values, so that the later layers' buckets are sent before batchnorm's backward sums its
        statistics, and every rank's graph must still run the collectives in one order."""
        got = self.graph_runs(2, ENV2, ["--set", "dist.comm=nccl", "--set", "dist.bucket_mb=0.0002"])
        self.assert_graphs_replayed_bit_for_bit(got, 2)

    def test_cuda_graph_on_is_refused_where_a_step_cannot_be_captured(self):
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        cases = [(["--device", "cpu"], 1, ENV, "it runs on the CPU backend"),
                 (["--device", "cuda", "--set", "train.grad_accum=2"], 1, ENV1, "train.grad_accum is above 1"),
                 (["--device", "cuda", "--set", "dist.comm=mpi"], 2, ENV1, "its gradients are summed over MPI")]
        for extra, np_, env, why in cases:
            rc, out, err = gpu_run([cfg, "--set", "train.cuda_graph=on"] + extra, np_, env)
            self.assertEqual(rc, 2, out + err)
            self.assertIn(f"train.cuda_graph is on, but this run cannot capture its step: {why}", errors(err)[0])
            rc, out, err = gpu_run([cfg, "--set", "train.cuda_graph=auto", "--set", "train.max_steps=2"] + extra,
                                   np_, env)
            self.assertEqual(rc, 0, out + err)  # auto runs eagerly instead

    @unittest.skipIf(SIM, "compute-sanitizer needs a real GPU (on the stand-in its checks are built in)")
    @unittest.skipUnless(shutil.which("compute-sanitizer") or os.path.exists("/usr/local/cuda/bin/compute-sanitizer"),
                         "compute-sanitizer not found")
    def test_compute_sanitizer_memcheck_is_clean(self):
        tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        p = subprocess.run([tool, "--tool", "memcheck", GPU_BINARY, "configs/model.yaml",
                            "--device", "cuda", "--set", "train.max_steps=3", "--set", f"log.dir={self.w.file('log')}",
                            "--set", "checkpoint.dir=", "--set", "data.val.x="], capture_output=True, text=True,
                           env=ENV, cwd=ROOT, timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        # every report is an error, except NCCL's probes at init of kernels built for other GPUs
        r = subprocess.run([sys.executable, "scripts/sanitizer_report.py"], input=p.stdout + p.stderr,
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        self.assertEqual(r.returncode, 0, r.stdout + p.stdout[-3000:] + p.stderr[-3000:])


def meta(path):
    with h5py.File(path, "r") as f:
        return dict(f["meta"].attrs)


@unittest.skipUnless(VISIBLE1, "no GPU visible (ddp_train --info)")
class GpuPrecision(GpuCase):
    """train.precision: tf32, bf16 and fp16 against fp32 on the CPU, fp16's loss scaling (an
    overflow skips the step and halves the scale; resume restores the scale), and the refusals."""

    def test_each_precision_trains_the_default_cnn_near_fp32_on_the_cpu(self):
        """25 steps of configs/model.yaml (a global batch of 64, one rank) in each precision against
        fp32 on the CPU. Tolerances (README): the first 5 losses within 2e-3 relative and the mean of
        the last 10 within 2% (measured: at most 4.0e-4 and 0.10%; over 50 steps 5.7e-4 and 0.15%),
        each run learns (the last 10 at 0.48 of the first), and each differs
        from fp32 in its first 10 losses (fp32 on the stand-in equals the CPU there: the reduced
        precision really rounds)."""
        common = ["configs/model.yaml", "--set", "data.shuffle=false", "--set", "log.every_steps=1", "--set",
                  "data.val.x=", "--set", "checkpoint.dir=", "--set", "train.global_batch_size=64"]
        stop = {"DDP_TRAIN_FAULT": "signal@0:25"}

        runs = self.precision_runs(common, stop)
        rc, out, err = runs["cpu"]
        self.assertEqual(rc, 75, out + err)
        cpu = np.array(self.losses("cpu"))
        self.assertEqual(len(cpu), 25)
        for prec in ("tf32", "bf16", "fp16"):
            rc, out, err = runs[prec]
            self.assertEqual(rc, 75, out + err)
            got = np.array(self.losses(prec))
            self.assertEqual(len(got), 25, prec)
            np.testing.assert_allclose(got[:5], cpu[:5], rtol=2e-3, err_msg=prec)
            self.assertLess(abs(got[-10:].mean() - cpu[-10:].mean()) / cpu[-10:].mean(), 0.02, (prec, got, cpu))
            self.assertGreater(np.abs(got[:10] - cpu[:10]).max(), 0, prec)
            print(f"# {prec}: first 5 within {np.max(np.abs(got[:5] / cpu[:5] - 1)):.2e}, last 10 within "
                  f"{abs(got[-10:].mean() / cpu[-10:].mean() - 1):.2e}, last 10 / first {got[-10:].mean() / got[0]:.2f}")
            self.assertLess(got[-10:].mean(), 0.6 * got[0], prec)  # and it learns
            self.assertNotIn("overflowed", out, prec)  # fp16's scale needs no backoff on this model

    def small_gpt(self):
        """A 1-block GPT over 64 rows of 9 tokens (heads of 8 values); returns its config's path."""
        rng = np.random.default_rng(3)
        rows = [[int(rng.integers(20))] for _ in range(64)]
        for r in rows:
            for _ in range(8):
                r.append((3 * r[-1] + 1) % 20 if rng.random() < 0.9 else int(rng.integers(20)))
        with h5py.File(self.w.file("tokens.h5"), "w") as f:
            f["train/tokens"] = np.array(rows, np.int32)
        cfg = self.w.config("""\
            model:
              input: [8]
              layers:
                - embedding: {{vocab: 20, dim: 32}}
                - residual: {{body: [layernorm: {{}}, attention: {{heads: 4}}]}}
                - residual: {{body: [layernorm: {{}}, linear: {{out: 64}}, gelu: {{approximate: tanh}}, linear: {{out: 32}}]}}
                - layernorm: {{}}
                - linear: {{out: 20, bias: false, tie: "0"}}
            data: {{path: {dir}/tokens.h5, train: {{x: /train/tokens}}, val: {{x: ""}}, shuffle: false}}
            train: {{epochs: 4, global_batch_size: 8, seed: 1}}
            optim: {{name: adamw, lr: 0.01}}
            log: {{every_steps: 1}}
            checkpoint: {{dir: ""}}
            """)
        return cfg

    def test_each_precision_trains_a_gpt_near_fp32_on_the_cpu(self):
        """A small GPT (its fused attention's products on tensor cores in bf16, FP32 in tf32 and fp16; the
        rest as the precision says) for 30 steps on one rank in tf32, bf16 and fp16 against fp32 on the
        CPU: the first 3 losses within 1e-2 relative, the mean of the last 5 within 2%, and each learns."""
        runs = self.precision_runs([self.small_gpt()])
        rc, out, err = runs["cpu"]
        self.assertEqual(rc, 0, out + err)
        cpu = np.array(self.losses("cpu"))
        self.assertEqual(len(cpu), 32)
        for prec in ("tf32", "bf16", "fp16"):
            rc, out, err = runs[prec]
            self.assertEqual(rc, 0, out + err)
            got = np.array(self.losses(prec))
            np.testing.assert_allclose(got[:3], cpu[:3], rtol=1e-2, err_msg=prec)
            self.assertLess(abs(got[-5:].mean() - cpu[-5:].mean()) / cpu[-5:].mean(), 0.02, (prec, got, cpu))
            self.assertLess(got[-5:].mean(), 0.7 * got[0], prec)
            self.assertGreater(np.abs(got - cpu).max(), 0, prec)  # the reduced precision really rounds

    def fuse_pair(self, cfg, prec, extra=(), tag=""):
        """cfg on one GPU in precision prec with model.fuse true and false, the stand-in's profile on:
        {fuse: (the last checkpoint's parameters, kernel launches, the logged losses)}; tag names their
        directories apart from another pair's."""
        got = {}
        for fuse in ("true", "false"):
            sub = f"{prec}_{fuse}{tag}"
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"train.precision={prec}", "--set",
                                    f"model.fuse={fuse}", "--set", f"checkpoint.dir={self.w.file(sub)}", "--set",
                                    f"log.dir={self.w.file(sub)}", *extra], 1, dict(ENV1, GPUSIM_PROFILE="1"))
            self.assertEqual(rc, 0, out + err)
            launches = {k: int(n) for k, n in re.findall(r"^\s*(\w+_kernel)\s+(\d+)\s", err, re.M)}
            losses = [r["loss"] for r in self.w.metrics(sub) if "loss" in r and "step" in r]
            got[fuse] = (params(self.w.latest(sub)), launches, losses)
        return got

    def test_16bit_convolutions_hand_their_batchnorm_nhwc_values(self):
        """Under bf16 and fp16 a convolution without a bias that a batchnorm follows (model.fuse) leaves its
        output, and takes its gradient, in the 16-bit NHWC cuDNN computes in; the batchnorm reads and writes
        them there, with no copies to and from FP32 NCHW, and hands its own output (after its fused relu) to
        a convolution right after it so too. The same values cross where the copies were, so 4 steps of a
        residual CNN (stem, a block with a projection: 4 convolution-batchnorm pairs, 1 batchnorm-convolution
        pair; the residual's sum, which a flatten reads, stays FP32) end with the parameters of model.fuse
        false, which keeps the copies; on the stand-in bit for bit, and its profile shows the batchnorm's 16-bit kernels and, per pair and step, a copy of y to FP32 and
        one of dy to 16 bits fewer (of x to 16 bits and dx to FP32 for the second kind). The filters are copied
        to 16 bits once a forward, all in one launch (weights16_kernel), where each convolution copied its own
        for its forward and its input gradient; evaluation's forwards copy the weights they are given, the EMA's
        for its metrics, which equal model.fuse false's too. A batchnorm's statistics are one launch (the
        last block to finish adds the chunks' sums), both ways and with either layout. The input op writes the
        input as the stem's convolution reads it, 16-bit NHWC, where the convolution copied it. The filters'
        16-bit gradients are added into the FP32 ones all in one launch (grads16_kernel), where each
        convolution widened its own."""
        cfg = self.images_config("res.yaml", STEM + basic_block(40, 2, True) + "    - flatten\n    - linear: {out: 3}\n")
        pairs, bn_conv, convs, steps = 4, 1, 4, 4
        evaluate = ("--set", "data.val.x=/train/images", "--set", "data.val.y=/train/labels", "--set",
                    "train.eval_every_steps=2", "--set", "train.ema.decay=0.5")
        for prec in ("bf16", "fp16"):
            got = self.fuse_pair(cfg, prec)
            assert_params_close(self, got["true"][0], got["false"][0], 1e-5, prec)
            if SIM:
                assert_params_equal(self, got["true"][0], got["false"][0], prec)
                on, off = got["true"][1], got["false"][1]
                # bn16_sums_kernel: the forward's sums, and the backward's where dy is 16-bit too
                want = {"bn16_sums_kernel": (pairs + bn_conv) * steps, "bn16_bwd_stats_kernel": (pairs - bn_conv) * steps,
                        "bn16_apply_kernel": pairs * steps, "bn16_bwd_apply_kernel": pairs * steps}
                self.assertEqual({k: on.get(k, 0) for k in want}, want, prec)
                self.assertFalse([k for k in off if k.startswith("bn16_")], prec)
                # a batchnorm's statistics, forward and backward, are one launch each (their last block adds
                # the chunks), 16-bit or not: with its apply, 4 launches a step
                for f in got:
                    self.assertEqual(sum(n for k, n in got[f][1].items() if k.startswith("bn")), 4 * pairs * steps,
                                     (prec, f, got[f][1]))
                packs = {f: sum(n for k, n in got[f][1].items() if k.startswith("pack16")) for f in got}
                weights = 2 * convs - 1  # each filter for its forward and input gradient, but the first's
                # and the input, which the input op writes as the stem's convolution reads it (input16_kernel)
                self.assertEqual(packs["false"] - packs["true"], (pairs + bn_conv + weights + 1) * steps, (prec, on, off))
                self.assertEqual((on.get("input16_kernel"), off.get("input16_kernel")), (steps, None), prec)
                # and each filter's gradient back to FP32, where all of them are added in one launch a step
                unpacks = {f: sum(n for k, n in got[f][1].items() if k.startswith("unpack16")) for f in got}
                self.assertEqual(unpacks["false"] - unpacks["true"], (pairs + bn_conv + convs) * steps, (prec, on, off))
                self.assertEqual((on.get("grads16_kernel"), off.get("grads16_kernel")), (steps, None), prec)
                self.assertEqual((on.get("weights16_kernel"), off.get("weights16_kernel")), (steps, None), prec)
        if SIM:
            got = self.fuse_pair(cfg, "bf16", evaluate, tag="_eval")
            evals = {f: [(r["val_loss"], r["ema_val_loss"]) for r in self.w.metrics(f"bf16_{f}_eval") if "ema_val_loss" in r]
                     for f in ("true", "false")}
            self.assertEqual(len(evals["true"]), 2, evals)
            self.assertEqual(evals["true"], evals["false"])
            self.assertGreater(got["true"][1]["weights16_kernel"], steps)  # and each evaluation chunk's forward

    def test_a_linear_applies_the_relu_after_it_in_its_gemm(self):
        """model.fuse: a relu right after a linear is applied by the linear's GEMM (cuBLASLt's RELU_BIAS or RELU
        epilogue), which writes the relu's output; the linear's backward masks the gradient in place where that
        output is not positive (with a bias and FP32 operands, in the pass that sums the bias gradient). 4 steps
        of an MLP (with and without a bias) end where model.fuse false does (two kernels apart): on the stand-in
        bit for bit in fp32 and bf16, with no act_fwd_kernel. cuBLASLt's max(x, 0)
        may make a NaN 0 (the stand-in's does), where the relu's kernel passes it: a NaN in the data still fails
        the step (exit 4), through the gradient it leaves in the first layer's weights. fp16, whose activations
        overflow (an inf - inf in a hidden layer would leave no such trace), keeps its relus apart."""
        cfg = self.images_config("mlp.yaml", MLP_RELUS)
        relus, steps = 2, 4
        for prec in ("fp32", "bf16"):
            got = self.fuse_pair(cfg, prec)
            assert_params_close(self, got["true"][0], got["false"][0], 1e-5 if prec == "fp32" else 1e-2, prec)
            if SIM:
                assert_params_equal(self, got["true"][0], got["false"][0], prec)
                on, off = got["true"][1], got["false"][1]
                self.assertEqual((on.get("act_fwd_kernel", 0), off.get("act_fwd_kernel", 0)), (0, relus * steps), prec)
                # backward: the first linear (with a bias) masks its dy as it sums the bias gradient, one pass a
                # step (the second has no bias, so its mask stays a kernel of its own); FP32 products in bf16 too,
                # whose copies need 16 rows or more (12 here)
                self.assertEqual((on.get("act_bwd_kernel"), on.get("relu_bias_grad_rows_kernel", 0)),
                                 (off.get("act_bwd_kernel") - steps, steps), prec)
                self.assertEqual(on.get("bias_grad_rows_kernel", 0), off.get("bias_grad_rows_kernel", 0) - steps, prec)
        if SIM:  # fp16, whose activations overflow, keeps the relus apart: an inf - inf must reach the loss
            self.assertEqual(self.fuse_pair(cfg, "fp16")["true"][1].get("act_fwd_kernel"), relus * steps)
        rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"checkpoint.dir={self.w.file('nan')}", "--set",
                                f"log.dir={self.w.file('nan')}"], 1, dict(ENV1, DDP_TRAIN_FAULT="nan@0:2"))
        self.assertEqual(rc, 4, out + err)
        # the stand-in's relu made it 0, so the loss stayed finite; a GPU's may pass it to the loss
        self.assertRegex(err, "non-finite gradient values" if SIM else "non-finite gradient values|loss became NaN")

    @unittest.skipUnless(SIM, "needs the stand-in's relu, which makes a NaN 0 (a GPU's may pass it to the loss)")
    def test_a_rank_alone_counts_non_finite_gradients_as_it_updates(self):
        """A rank alone sends no gradient buckets, so its non-finite gradient values are counted by the
        optimizer (or, with train.clip_grad_norm, by clipping's sum of squares) rather than by a pass of
        their own before each bucket is sent. A NaN in the first input value leaves the first linear's 32
        weights of that input NaN (the relu made its outputs 0 on their way to the loss, so the loss stays
        finite): one rank counts the 32 that two ranks' bucket checks count, with SGD and AdamW, clipped or
        not, and launches no sum of squares of its own."""
        cfg = self.images_config("mlp.yaml", MLP_RELUS)
        for optim in ("sgd", "adamw"):
            for clip in ("0", "1.0"):
                for np_ in (1, 2):
                    case = (optim, clip, np_)
                    rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"optim.name={optim}", "--set",
                                            f"train.clip_grad_norm={clip}", "--set", "checkpoint.dir="], np_,
                                           dict(ENV2, DDP_TRAIN_FAULT="nan@0:2", GPUSIM_PROFILE="1"))
                    self.assertEqual(rc, 4, (case, out + err))
                    self.assertIn("32 non-finite gradient values at step 2 (epoch 1)", errors(err)[0], case)
                    if np_ == 1:  # two steps, and clipping's sums alone (two ranks may not live to print theirs)
                        sums = re.findall(r"^\s*sumsq_kernel\s+(\d+)\s", err, re.M)
                        self.assertEqual(sums, ["2"] if clip != "0" else [], case)

    def test_a_nan_in_a_replayed_steps_data_is_counted_in_the_update_and_its_row_named(self):
        """The count above inside a replayed CUDA graph, and over accumulated micro-batches, from a NaN in the
        data rather than an injected one (which makes its step eager): in file order, row 51 of 96 is read by
        step 5, the fourth step after the first and the third replayed from a graph (with train.grad_accum
        2, by step 3's second micro-batch). Its relu turns the NaN's activations into 0, so the loss stays
        finite: the optimizer's count of the first linear's 32 non-finite weight gradients finds it, and the
        row is named."""
        self.w.dataset(n=96, shape=(2, 8, 8), dtype=np.float32)
        with h5py.File(self.w.file("data.h5"), "r+") as f:
            row = f["train/images"][51]
            row[0, 0, 0] = np.nan
            f["train/images"][51] = row
        cfg = self.w.file("mlp.yaml")
        with open(cfg, "w") as f:
            f.write("model:\n  input: [2, 8, 8]\n  layers:\n" + MLP_RELUS + f"""\
data: {{path: {self.w.file("data.h5")}, val: {{x: ""}}, shuffle: false}}
train: {{max_steps: 8, global_batch_size: 12, seed: 5}}
optim: {{name: sgd, lr: 0.1, momentum: 0.9}}
log: {{every_steps: 1}}
checkpoint: {{dir: ""}}
""")
        for accum, step in ((1, 5), (2, 3)):
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"train.grad_accum={accum}"], 1,
                                   dict(ENV1, GPUSIM_PROFILE="1"))
            self.assertEqual(rc, 4, out + err)
            self.assertIn(f"32 non-finite gradient values at step {step} (epoch 1), and this rank's inputs of the "
                          f"step are not finite: {self.w.file('data.h5')}: '/train/images'[51] holds a NaN",
                          errors(err)[0])
            self.assertRegex(out, rf"(?m)^step {step - 1}/")
            if accum == 1:
                self.assertIn("cuda graph: on", out)
                if SIM:  # steps 2 to 5 ran as graphs: the two captured (one for each host slot), then replays
                    launches = re.search(r"gpusim graphs \(pid \d+\): 2 instantiated, (\d+) launches", err)
                    self.assertIsNotNone(launches, err)
                    self.assertGreaterEqual(int(launches[1]), 4, err)
            else:
                self.assertIn("cuda graph: off (train.grad_accum > 1)", out)

    def test_16bit_residual_sums_stay_nhwc(self):
        """Under bf16 and fp16 (model.fuse) a ResNet's trunk stays 16-bit NHWC from its stem's batchnorm to its
        global average pool: each residual adds its branches' 16-bit outputs (the batchnorms ending them) and
        its input, applies its relu and hands the sum on as it is, to the convolutions of the next block and
        its shortcut, and takes its gradient so; the pool averages the last sums into FP32. The sums round to
        16 bits where model.fuse false keeps them in FP32, so 4 steps end near its parameters, not on them.
        The stand-in's profile shows the 16-bit sums, relu backward and pooling kernels and no FP32 ones, and
        of the 16-bit copies only the weights' (all of them once a forward, in one launch, and their gradients
        back into FP32 once a backward, in one launch; the input op writes the input as the stem reads it): no
        activation is copied. train.recompute blocks gives the same bits."""
        cfg = self.images_config("trunk.yaml", STEM + basic_block(8) + basic_block(16, 2, True) +
                                 "    - global_avgpool\n    - linear: {out: 3}\n")
        residuals, steps = 2, 4
        fp32, trained = self.fuse_pair(cfg, "fp32")["true"][0], {}
        for prec in ("bf16", "fp16"):
            got = self.fuse_pair(cfg, prec)
            trained[prec] = got["true"][0]
            # norm-wise: 5e-3 (bf16) and 1.4e-3 (fp16) apart, and 1.09x and 1.06x model.fuse false's distance
            # from FP32 on the stand-in
            self.assertLess(params_distance(got["true"][0], got["false"][0]), 2e-2, prec)
            self.assertLess(params_distance(got["true"][0], fp32), 1.5 * params_distance(got["false"][0], fp32), prec)
            np.testing.assert_allclose(got["true"][2], got["false"][2], rtol=1e-2, err_msg=prec)  # 3.4e-3
            if SIM:
                on = got["true"][1]
                want = {"add16_kernel": 2 * residuals * steps, "relu_bwd16_kernel": residuals * steps,
                        "gap16_fwd_kernel": steps, "gap16_bwd_kernel": steps}
                self.assertEqual({k: on.get(k, 0) for k in want}, want, prec)
                self.assertFalse([k for k in ("add_kernel", "act_bwd_kernel", "act_fwd_kernel") if k in on], prec)
                copies = {d: sum(n for k, n in on.items() if k.startswith(d + "16")) for d in ("pack", "unpack")}
                self.assertEqual(copies, {"pack": 0, "unpack": 0}, (prec, on))
                self.assertEqual(on.get("input16_kernel"), steps, (prec, on))
                self.assertEqual((on.get("weights16_kernel"), on.get("grads16_kernel")), (steps, steps), (prec, on))
        rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", "train.precision=bf16", "--set",
                                "train.recompute=blocks", "--set", f"checkpoint.dir={self.w.file('rec')}", "--set",
                                f"log.dir={self.w.file('rec')}"], 1, ENV1)
        self.assertEqual(rc, 0, out + err)
        assert_params_equal(self, params(self.w.latest("rec")), trained["bf16"], "recompute")

    @unittest.skipUnless(VISIBLE2 >= 2, "fewer than 2 GPUs visible")
    def test_16bit_filter_gradients_reach_every_bucket_over_nccl(self):
        """Under bf16 and fp16 (model.fuse) the convolutions leave their filter gradients in 16 bits, as cuDNN
        computes them, and one op adds the ones a bucket covers into the FP32 gradients before it is sent
        (ddp's settle hook, model_add_grads16), where each convolution added its own. Two ranks over NCCL with
        buckets of 64 values, several of them started during backward, end on the bits of one rank that adds
        the same two halves of each step as micro-batches (train.grad_accum 2: its 16-bit gradients added
        once, as each backward ends); the batchnorms' statistics are each half's in both (their running
        statistics, updated once a micro-batch, differ). The stand-in's profile shows one grads16_kernel a
        micro-batch on one rank, and 6 a step on two (without the hook the stand-in reports NCCL reading
        gradients the op writes)."""
        cfg = self.images_config("buckets.yaml", STEM + basic_block(8) + basic_block(16, 2, True) +
                                 "    - global_avgpool\n    - linear: {out: 3}\n")
        steps = 4
        for prec in ("bf16", "fp16"):
            runs = {}
            for name, np_, env, extra in (("one", 1, ENV1, ["train.grad_accum=2", "train.global_batch_size=6"]),
                                          ("two", 2, ENV2, ["dist.comm=nccl", "dist.bucket_mb=0.000244140625"])):
                sub = f"{prec}_{name}"
                rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"train.precision={prec}", "--set",
                                        "data.shuffle=false", "--set", f"checkpoint.dir={self.w.file(sub)}",
                                        *[a for e in extra for a in ("--set", e)]], np_,
                                       dict(env, GPUSIM_PROFILE="1"))
                self.assertEqual(rc, 0, out + err)
                trained = {k: v for k, v in params(self.w.latest(sub)).items() if "running_" not in k}
                runs[name] = (trained, re.findall(r"^\s*grads16_kernel\s+(\d+)\s", err, re.M))
            self.assertEqual(len(runs["one"][0]), 20)  # 6 filters, 6 batchnorms' two, the linear's two
            assert_params_equal(self, runs["two"][0], runs["one"][0], f"{prec}: 2 ranks against 2 micro-batches")
            if SIM:
                self.assertEqual(runs["one"][1], [str(2 * steps)], prec)
                self.assertEqual(runs["two"][1], [str(6 * steps)] * 2, prec)  # each rank's profile

    def test_16bit_residual_sums_reach_a_convolution_or_stay_fp32_whole(self):
        """The 16-bit trunk's other ends (model.c's pick_trunk16): a convolution right after a residual reads its
        16-bit sum as it is and writes its input gradient into the residual's gradient so (no activation copy,
        4 steps near model.fuse false in bf16); and a chain of residuals one of which cannot
        add 16-bit values (a convolution with a bias begins its branch: no batchnorm takes its output in 16
        bits) stays FP32 whole, the residual before it too: no 16-bit sums at all, and on the stand-in the
        parameters of model.fuse false bit for bit."""
        into_conv = self.images_config("into_conv.yaml", STEM + basic_block(16, 2, True) + """\
    - {conv2d: {out: 6, kernel: 3, pad: 1, bias: false}}
    - {batchnorm: {}}
    - flatten
    - linear: {out: 3}
""")
        steps = 4
        got = self.fuse_pair(into_conv, "bf16")
        self.assertLess(params_distance(got["true"][0], got["false"][0]), 2e-2)
        if SIM:
            on = got["true"][1]
            self.assertEqual((on.get("add16_kernel"), on.get("relu_bwd16_kernel")), (2 * steps, steps), on)
            copies = {d: sum(n for k, n in on.items() if k.startswith(d + "16")) for d in ("pack", "unpack")}
            self.assertEqual(copies, {"pack": 0, "unpack": 0}, on)  # the weights' and their gradients' together
            self.assertEqual((on.get("weights16_kernel"), on.get("grads16_kernel")), (steps, steps), on)
        broken = self.images_config("broken.yaml", STEM + """\
    - residual:
        body: [{conv2d: {out: 8, kernel: 3, pad: 1, bias: false}}, {batchnorm: {}}]
    - relu
    - residual:
        body: [{conv2d: {out: 8, kernel: 3, pad: 1}}, {batchnorm: {}}]
    - relu
    - global_avgpool
    - linear: {out: 3}
""")
        got = self.fuse_pair(broken, "bf16")
        if SIM:
            assert_params_equal(self, got["true"][0], got["false"][0], "FP32 residuals")
            self.assertFalse([k for k in ("add16_kernel", "relu_bwd16_kernel", "gap16_fwd_kernel") if k in got["true"][1]],
                             got["true"][1])

    def test_16bit_max_pooling_between_batchnorm_and_convolution_stays_nhwc(self):
        """Under bf16 and fp16 a maxpool between a batchnorm (after its convolution, with its fused relu) and a
        convolution pools the batchnorm's 16-bit NHWC output as it is and hands its own, and takes its gradient,
        so (the default CNN's first pool): the convolution after it reads and writes them with no copies. A
        maximum is one of its inputs, so the forward's values are those of model.fuse false; a tie that rounding
        makes (two inputs of one window equal in 16 bits) routes the gradient to the first, not the larger, as
        under PyTorch's autocast: 4 steps end within 5e-2 of model.fuse false. The stand-in's profile shows
        the 16-bit pooling kernels, and a copy of x to 16 bits and one of dx to FP32 a step fewer, for that
        convolution, than the two convolution-batchnorm pairs save; the pool before the flatten stays FP32. On
        the stand-in the first step's loss is the same bits, and in fp16 (no such tie in this data) so are the
        parameters after 4 steps. (The filters' copies, all made once a forward, and their gradients' back to
        FP32, all once a backward, are fewer too, and the input op writes the input as the first convolution
        reads it.)"""
        cfg = self.images_config("pool.yaml", """\
    - conv2d: {out: 8, kernel: 3, pad: 1, bias: false}
    - batchnorm: {}
    - relu
    - maxpool: {kernel: 2}
    - conv2d: {out: 12, kernel: 3, pad: 1, bias: false}
    - batchnorm: {}
    - relu
    - maxpool: {kernel: 2}
    - flatten
    - linear: {out: 3}
""")
        pairs, pools, convs, steps = 2, 1, 2, 4
        for prec in ("bf16", "fp16"):
            got = self.fuse_pair(cfg, prec)
            assert_params_close(self, got["true"][0], got["false"][0], 5e-2, prec)
            if SIM:
                self.assertEqual(got["true"][2][0], got["false"][2][0], prec)
                if prec == "fp16":
                    assert_params_equal(self, got["true"][0], got["false"][0], prec)
                on, off = got["true"][1], got["false"][1]
                self.assertEqual((on.get("pool16_fwd_kernel"), on.get("pool16_bwd_kernel")), (pools * steps,) * 2, prec)
                self.assertEqual((on.get("pool_fwd_kernel"), on.get("pool_bwd_kernel")), (steps, steps), prec)
                self.assertFalse([k for k in off if k.startswith("pool16")], prec)
                packs = {f: sum(n for k, n in got[f][1].items() if k.startswith("pack16")) for f in got}
                self.assertEqual(packs["false"] - packs["true"], (pairs + pools + 2 * convs - 1 + 1) * steps,
                                 (prec, on, off))
                unpacks = {f: sum(n for k, n in got[f][1].items() if k.startswith("unpack16")) for f in got}
                self.assertEqual(unpacks["false"] - unpacks["true"], (pairs + pools + convs) * steps, (prec, on, off))
                self.assertEqual(on.get("grads16_kernel"), steps, prec)

    def test_bf16_classifier_keeps_its_logits_in_bfloat16(self):
        """Under bf16 (model.fuse) the last layer, a linear without a bias, writes the logits in bfloat16 as its
        GEMM computes them; the loss reads them and writes dlogits so, and the two gradient GEMMs read those as
        they are (PyTorch's autocast, too, gives cross_entropy bfloat16 logits). The small GPT (20 classes:
        rows padded to 24) trains 16 steps as with model.fuse false, which keeps FP32 logits: each loss within
        5e-3 relative, not the same bits (the next test counts the copies it saves). --predict and --sample read the bfloat16 logits back: the predicted logits within 2e-2 of the
        FP32 ones, from the same checkpoint."""
        cfg = self.small_gpt()
        steps = 16
        got = self.fuse_pair(cfg, "bf16", ("--set", f"train.max_steps={steps}", "--set", "train.cuda_graph=off"))
        losses = {fuse: np.array(got[fuse][2]) for fuse in got}
        self.assertEqual(len(losses["true"]), steps)
        np.testing.assert_allclose(losses["true"], losses["false"], rtol=5e-3)  # 7e-4 on the stand-in
        self.assertFalse(np.array_equal(losses["true"], losses["false"]))  # the logits really round
        # the same checkpoint's validation logits, read back from bfloat16 rows and from FP32
        ckpt = self.w.latest("bf16_true")
        pred = {}
        for fuse in ("true", "false"):
            path = self.w.file(f"pred_{fuse}.h5")
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", "train.precision=bf16", "--set",
                                    f"model.fuse={fuse}", "--set", "data.val.x=/train/tokens", "--resume", ckpt,
                                    "--predict", path], 1, ENV1)
            self.assertEqual(rc, 0, out + err)
            with h5py.File(path) as f:
                pred[fuse] = f["logits"][...]
        self.assertEqual(pred["true"].shape, pred["false"].shape)
        self.assertEqual(pred["true"].shape[-1], 8 * 20)  # each row's (T, V)
        np.testing.assert_allclose(pred["true"], pred["false"], rtol=2e-2, atol=2e-2 * np.abs(pred["false"]).max())
        rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", "train.precision=bf16", "--resume", ckpt,
                                "--sample", "12", "--prompt", "3 10", "--top-k", "1"], 1, ENV1)
        self.assertEqual(rc, 0, out + err)

    def test_bf16_transformer_keeps_its_activations_between_norms_and_products_in_bfloat16(self):
        """Under bf16 (model.fuse) a transformer keeps in bfloat16 rows what autocast would: besides the logits
        (the test above), each layernorm's output that a linear or attention layer reads, and its gradient; an
        MLP's hidden activations (linear -> tanh gelu -> linear): the first linear's GEMM writes the gelu's
        input and output so (its epilogue, the bias rounded to bfloat16), the second reads them with no copy, and
        its input gradient is written so through the gelu's derivative, from which the first takes its weight
        and bias gradients; and the attention's q, k, v, merged heads and their gradients (heads16), which its
        projections and the fused ops write and read so. The small GPT trains 16 steps, with CUDA graphs and
        with train.recompute blocks, as with model.fuse false: the first 8 losses within 5e-3 relative, all
        within 2e-2, not the same bits; recompute gives the same losses. On the stand-in, its profile shows the
        bias gradients of the MLP's first linear and of the qkv projection summed from their 16-bit dy
        (bf16_rows_sums_kernel), no gelu kernels, and 9 bfloat16 copies a step fewer than model.fuse false
        from the second step on (the first grows the copies' buffer, which costs a held copy): dlogits', two a
        layernorm (x of its reader's forward and weight gradient, 3 layernorms), the MLP's second linear's x
        twice and the merged heads twice (the output projection's x), less the bias copies of the MLP's first
        linear and the qkv projection; and 10 more, as each of the 5 weights (the attention's two projections, the
        MLP's two linears, the tied classifier's) is copied once a step for both its GEMMs, all in one launch
        (weights16_kernel), not by each."""
        cfg = self.small_gpt()
        steps = 16
        got = self.fuse_pair(cfg, "bf16", ("--set", f"train.max_steps={steps}"))
        losses = {fuse: np.array(got[fuse][2]) for fuse in got}
        self.assertEqual(len(losses["true"]), steps)
        np.testing.assert_allclose(losses["true"][:8], losses["false"][:8], rtol=5e-3)  # 2e-3 on the stand-in
        np.testing.assert_allclose(losses["true"], losses["false"], rtol=2e-2)  # 7e-3: lr 0.01 drifts apart
        self.assertFalse(np.array_equal(losses["true"], losses["false"]))  # the activations really round
        if SIM:
            on, off = got["true"][1], got["false"][1]
            self.assertEqual(on.get("bf16_rows_sums_kernel"), 2 * steps, on)
            self.assertFalse([k for k in ("act_fwd_kernel", "act_bwd_kernel", "bias_gelu_bf16_rows_kernel",
                                          "dgelu_tanh_bf16_rows_kernel") if k in on], on)
            first = self.fuse_pair(cfg, "bf16", ("--set", "train.max_steps=1"), tag="_first")
            saved = [got[f][1]["pack_bf16_rows_kernel"] - first[f][1]["pack_bf16_rows_kernel"] for f in ("false", "true")]
            self.assertEqual(saved[0] - saved[1], (9 + 2 * 5) * (steps - 1), (on, off))
            self.assertEqual(on.get("weights16_kernel"), steps, on)
        rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", "train.precision=bf16", "--set",
                                f"train.max_steps={steps}", "--set", "train.recompute=blocks", "--set",
                                f"log.dir={self.w.file('recompute')}"], 1, ENV1)
        self.assertEqual(rc, 0, out + err)
        recomputed = [r["loss"] for r in self.w.metrics("recompute") if "loss" in r and "step" in r]
        np.testing.assert_allclose(recomputed, losses["true"], rtol=1e-6)

    @unittest.skipUnless(SIM, "reads the stand-in's GPUSIM_PROFILE (on a GPU, gpu_check.sh's profile names the kernels)")
    def test_bf16_attention_uses_tensor_cores_only_where_the_build_has_them(self):
        """bf16 runs the fused attention's tensor-core kernels on a GPU of 8.0 or later; where the build's
        code for it comes from older PTX (GPUSIM_PTX=7.5 on a 9.0 GPU), those kernels would trap, and
        the FP32 ones run instead. fp16 keeps the FP32 ones. Two steps each, kernels from the stand-in's
        profile."""
        cfg = self.small_gpt()
        for prec, ptx, tc in (("bf16", "", True), ("bf16", "7.5", False), ("fp16", "", False)):
            env = dict(ENV1, GPUSIM_PROFILE="1", **({"GPUSIM_PTX": ptx} if ptx else {}))
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"train.precision={prec}", "--set",
                                    "train.max_steps=2", "--set", f"log.dir={self.w.file('tc' + prec + ptx)}"], 1, env)
            self.assertEqual(rc, 0, out + err)
            kernels = set(re.findall(r"^\s*(attn_\w+_kernel)<", err, re.M)) - {"attn_delta_kernel"}  # either way
            want = {"attn_fwd_tc_kernel", "attn_bwd_kv_tc_kernel", "attn_bwd_q_tc_kernel"} if tc else \
                {"attn_fwd_kernel", "attn_bwd_kv_kernel", "attn_bwd_q_kernel"}
            self.assertEqual(kernels, want, (prec, ptx, err[-2000:]))

    def fp16_run(self, sub, steps, np_=1, env=ENV1, fault=None, extra=(), resume=False):
        cfg = self.w.config(GPU_CNN, dropout="dropout: {p: 0.2}")
        args = [cfg, "--device", "cuda", "--set", "train.precision=fp16", "--set", f"train.max_steps={steps}",
                "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep=20", "--set",
                f"checkpoint.dir={self.w.file(sub)}", "--set", f"log.dir={self.w.file(sub)}"] + list(extra)
        if resume:
            args += ["--resume", "auto"]
        rc, out, err = gpu_run(args, np_, dict(env, **({"DDP_TRAIN_FAULT": fault} if fault else {})))
        self.assertEqual(rc, 0, out + err)
        return out

    def test_fp16_overflow_skips_the_step_halves_the_scale_and_recovers(self):
        """An infinite gradient on rank 1 of 2 (NCCL where there are 2 GPUs, else MPI) at step 3:
        every rank skips that update (the parameters and momentum stay those of step 2; batchnorm's
        running statistics move, as in PyTorch, since the forward pass ran), the scale goes from
        65536 to 32768, and the following steps update again."""
        self.w.dataset(n=48)
        env, extra = (ENV2, ["--set", "dist.comm=nccl"]) if VISIBLE2 >= 2 else (ENV1, ["--set", "dist.comm=mpi"])
        out = self.fp16_run("ck", 6, np_=2, env=env, fault="overflow@1:3", extra=extra)
        self.assertIn("step 3: ", out)
        self.assertIn("gradient values overflowed in fp16: update skipped, loss scale 65536 -> 32768", out)
        self.assertEqual(out.count("overflowed"), 1, out)
        ck = {s: self.w.file(f"ck/step-{s:08d}.h5") for s in range(1, 7)}
        p2, p3, p4 = params(ck[2]), params(ck[3]), params(ck[4])
        with h5py.File(ck[2], "r") as a, h5py.File(ck[3], "r") as b:
            for group in ("model", "optim/momentum_buffer"):
                for k in (k for k in a[group] if "running" not in k):
                    self.assertTrue(np.array_equal(a[group][k][...], b[group][k][...]), f"{group}/{k}")
        self.assertFalse(all(np.array_equal(p3[k], p4[k]) for k in p3))  # step 4 updates again
        self.assertFalse(all(np.array_equal(p2[k], params(ck[1])[k]) for k in p2))
        self.assertEqual((meta(ck[2])["loss_scale"], meta(ck[2])["loss_scale_growth"]), (65536.0, 2.0))
        self.assertEqual((meta(ck[3])["loss_scale"], meta(ck[3])["loss_scale_growth"]), (32768.0, 0.0))
        self.assertEqual((meta(ck[6])["loss_scale"], meta(ck[6])["loss_scale_growth"]), (32768.0, 3.0))

    def test_fp16_resume_restores_the_loss_scale_bit_exactly(self):
        """AdamW, 8 steps with an overflow at step 3, against 5 steps resumed to 8: the same bits in
        every tensor, the same loss scale (32768, not the initial 65536) and growth count, and the
        optimizer's own step count (7 updates: AdamW's bias corrections depend on it)."""
        self.w.dataset(n=48)
        adamw = ["--set", "optim.name=adamw", "--set", "optim.lr=0.01"]
        self.fp16_run("straight", 8, fault="overflow@0:3", extra=adamw)
        self.fp16_run("resumed", 5, fault="overflow@0:3", extra=adamw)
        out = self.fp16_run("resumed", 8, resume=True, extra=adamw)
        self.assertIn("resuming at step 5", out)
        a, b = self.w.latest("straight"), self.w.latest("resumed")
        self.assertEqual((meta(a)["loss_scale"], meta(a)["loss_scale_growth"]), (32768.0, 5.0))
        self.assertEqual((meta(b)["loss_scale"], meta(b)["loss_scale_growth"]), (32768.0, 5.0))
        self.assertEqual((meta(a)["optimizer_step"], meta(b)["optimizer_step"], meta(b)["step"]), (7, 7, 8))
        with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
            names = []
            fa.visit(lambda n: names.append(n) if isinstance(fa[n], h5py.Dataset) else None)
            for n in names:
                self.assertTrue(np.array_equal(fa[n][...], fb[n][...]), n)

    @unittest.skipUnless(SIM, "needs the stand-in's GPUSIM_CC")
    def test_a_precision_the_gpu_lacks_is_refused(self):
        """tf32 and bf16 need compute capability 8.0, fp16 7.0: exit 2 naming the key and the GPU; and
        below 7.5 the build has no code: exit 2 naming what it has."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        for cc, prec, ok in (("7.5", "tf32", False), ("7.5", "bf16", False), ("7.5", "fp16", True),
                             ("8.0", "bf16", True)):
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"train.precision={prec}", "--set",
                                    "train.max_steps=1", "--set", f"checkpoint.dir={self.w.file('ck' + cc + prec)}"],
                                   1, dict(ENV1, GPUSIM_CC=cc))
            if ok:
                self.assertEqual(rc, 0, out + err)
            else:
                self.assertEqual(rc, 2, out + err)
                need = "7.0" if prec == "fp16" else "8.0"
                self.assertIn(f"train.precision {prec} needs tensor cores of compute capability {need} or later, "
                              f"but GPU 0 of rank 0", errors(err)[0])
                self.assertIn(f"has {cc}", errors(err)[0])
        # CUDA 13 builds nothing older than 7.5: a Volta or Pascal GPU is refused for any precision,
        # naming what the build has (before, 7.0 passed the checks and failed at the first kernel)
        for cc in ("7.0", "6.1"):
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", "train.max_steps=1"], 1, dict(ENV1, GPUSIM_CC=cc))
            self.assertEqual(rc, 2, out + err)
            self.assertIn(f"GPU 0 of rank 0 (", errors(err)[0])
            self.assertIn(f"has compute capability {cc}, and this build has no code for it (sm_75, ", errors(err)[0])

    @unittest.skipUnless(VISIBLE2 >= 2, "fewer than 2 GPUs visible")
    def test_bf16_gradient_sums_stay_near_fp32(self):
        """dist.grad_dtype bf16 on 2 ranks over NCCL (graphs on), 12 steps: every parameter within 2%
        of the fp32 sums' (relative to the tensor's largest value; bf16 keeps 8 bits), but not equal:
        the buckets really travel in bf16."""
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        got = {}
        for np_, env, dtype in ((2, ENV2, "fp32"), (2, ENV2, "bf16")):
            sub = f"{dtype}_{np_}"
            rc, out, err = gpu_run([cfg, "--device", "cuda", "--set", f"dist.grad_dtype={dtype}", "--set",
                                    "data.shuffle=false", "--set", f"checkpoint.dir={self.w.file(sub)}"], np_, env)
            self.assertEqual(rc, 0, out + err)
            got[sub] = params(self.w.latest(sub))
        a, b = got["fp32_2"], got["bf16_2"]
        self.assertFalse(all(np.array_equal(a[k], b[k]) for k in a))
        for k in a:
            scale = max(float(np.abs(a[k]).max()), 1e-6)
            self.assertLess(float(np.abs(a[k] - b[k]).max()) / scale, 0.02, k)

    def test_bf16_gradient_sums_over_mpi_are_refused(self):
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        for args, env in (([cfg, "--device", "cpu"], ENV), ([cfg, "--device", "cuda", "--set", "dist.comm=mpi"], ENV1)):
            rc, out, err = gpu_run(args + ["--set", "dist.grad_dtype=bf16"], 2, env)
            self.assertEqual(rc, 2, out + err)
            self.assertIn("dist.grad_dtype bf16: gradients are summed in bf16 only over NCCL", errors(err)[0])

    def test_the_cpu_backend_refuses_reduced_precision(self):
        self.w.dataset(n=48)
        cfg = self.w.config(GPU_CNN, dropout="relu")
        for prec in ("tf32", "bf16", "fp16"):
            rc, out, err = run([cfg, "--device", "cpu", "--set", f"train.precision={prec}"], np_=2)
            self.assertEqual(rc, 2, out + err)
            self.assertEqual(len(errors(err)), 1, err)
            self.assertIn(f"train.precision {prec}: the CPU backend computes in fp32 only", errors(err)[0])


if __name__ == "__main__":
    unittest.main()
