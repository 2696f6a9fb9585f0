"""The CLI and start-up validation: --help/--version/--dry-run, and every bad input of the
config and the data exiting 2 on all ranks with one message that names the problem."""
import os
import shutil
import subprocess
import tempfile
import unittest

import h5py
import numpy as np

from helpers import BINARY, ENV, ROOT, TINY_CNN, Workdir, errors, run


class DryRunAndInfo(unittest.TestCase):
    def test_dry_run_on_three_ranks_prints_summary_once(self):
        rc, out, err = run(["--dry-run", "configs/model.yaml"], np_=3)
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.count("total parameters: 870,826"), 1)
        self.assertIn("conv2d", out)
        self.assertIn("(64, 7, 7)", out)
        self.assertIn("forward FLOPs per sample:", out)
        self.assertIn("3 ranks", out)

    def test_dry_run_resnet18_and_mlp(self):
        rc, out, err = run(["--dry-run", "configs/resnet18_cifar.yaml"])
        self.assertEqual(rc, 0, err)
        self.assertIn("total parameters: 11,173,962", out)  # torchvision-style CIFAR ResNet-18, 10 classes
        self.assertIn("(512, 4, 4)", out)
        rc, out, err = run(["--dry-run", "configs/mlp.yaml"])
        self.assertEqual(rc, 0, err)
        self.assertIn("total parameters: 1,863,690", out)

    def test_info_reports_each_node(self):
        rc, out, err = run(["--info"], np_=2)
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.count("node "), 1)  # one node, two ranks
        self.assertIn("2 ranks", out)
        self.assertIn("HDF5 ", out)
        self.assertRegex(out, r"GPUs: none|GPU 0: ")
        self.assertIn("communicator for dist.comm auto:", out)

    def test_dry_run_memory_estimate(self):
        rc, out, err = run(["--dry-run", "configs/model.yaml"], np_=2)
        self.assertEqual(rc, 0, err)
        self.assertRegex(out, r"memory per rank at 128 rows: [0-9.]+ MiB = parameters 3.3 \+ gradients 3.3 \+ "
                              r"optimizer 3.3 .* activations [0-9.]+ .*MiB (free on this rank's GPU|of available host)")
        # by hand: 60,000 rows of 784 uint8 and an int32 label (every rank holds them all with global
        # sharding) = 45.09 MiB; one 25 MiB bucket is more than the 870,826 parameters: 2 bytes each = 1.66 MiB
        rc, out, err = run(["--dry-run", "configs/model.yaml", "--set", "data.cache=device", "--set",
                            "dist.grad_dtype=bf16"], np_=2)
        self.assertEqual(rc, 0, err)
        self.assertRegex(out, r"workspace [0-9.]+ \+ data.cache device 45.1 \+ bf16 bucket 1.7; ")
        rc, out, err = run(["--dry-run", "configs/resnet18_cifar.yaml", "--set", "train.global_batch_size=2000000"])
        self.assertEqual(rc, 2, out + err)
        self.assertIn("the batch does not fit: a rank needs", errors(err)[0])
        # the rows are the largest share of the global batch: 8 on one rank (it said 9), 3 of 8 on three
        w = Workdir()
        try:
            w.dataset()
            cfg = w.config(TINY_CNN)
            for np_, rows in ((1, 8), (3, 3)):
                rc, out, err = run(["--dry-run", cfg], np_=np_)
                self.assertEqual(rc, 0, out + err)
                self.assertIn(f"memory per rank at {rows} rows:", out)
        finally:
            w.cleanup()

    def test_a_batch_that_does_not_fit_is_exit_2_in_a_real_run_too(self):
        # --dry-run's memory check ran in the dry run only: a real run went on to allocate and died of
        # it (exit 70). Both run the same check now, before anything is allocated.
        w = Workdir()
        try:
            w.dataset()
            cfg = w.config(TINY_CNN)
            for G, needle in ((10**12, "the batch does not fit: a rank's 1000000000000 rows of up to 144 values"),
                              (10**9, "the batch does not fit: a rank needs")):
                for extra in ([], ["--dry-run"]):
                    rc, out, err = run(extra + [cfg, "--set", f"train.global_batch_size={G}"])
                    self.assertEqual(rc, 2, f"{extra} {G}: {out}{err}")
                    self.assertIn(needle, errors(err)[0])
        finally:
            w.cleanup()

    def test_make_install_with_man_page(self):
        with tempfile.TemporaryDirectory() as prefix:
            p = subprocess.run(["make", "-s", "install", f"PREFIX={prefix}"], cwd=ROOT, capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            for f in ("bin/ddp_train", "share/man/man1/ddp_train.1", "share/ddp_train/scripts/export_torch.py",
                      "share/ddp_train/scripts/slurm/ddp_train.sbatch", "share/ddp_train/configs/model.yaml"):
                self.assertTrue(os.path.exists(os.path.join(prefix, f)), f)
            with open(os.path.join(prefix, "share/man/man1/ddp_train.1")) as f:
                man = f.read()
            self.assertIn("\\-\\-resume", man)  # generated from the --help text
            self.assertIn("exit codes", man)
            rc = subprocess.run([os.path.join(prefix, "bin/ddp_train"), "--version"], capture_output=True, env=ENV)
            self.assertEqual(rc.returncode, 0)

    def test_help_and_version(self):
        rc, out, _ = run(["--help"])
        self.assertEqual(rc, 0)
        self.assertIn("usage: ddp_train", out)
        self.assertIn("exit codes:", out)
        rc, out, _ = run(["--version"])
        self.assertEqual(rc, 0)
        for lib in ("MPI:", "HDF5:", "libyaml:", "OpenBLAS:"):
            self.assertIn(lib, out)

    def test_help_version_and_keys_start_no_mpi(self):
        # An MPI transport that does not exist makes MPI_Init fail: --help, --version and
        # --config-keys still answer (they never start MPI), alone and on 2 ranks (printed once),
        # while a run that needs MPI fails.
        bad = dict(ENV, OMPI_MCA_pml="no_such_pml")
        binary = BINARY
        for args in (["--help"], ["--version"], ["--config-keys"]):
            p = subprocess.run([binary] + args, capture_output=True, text=True, env=bad, timeout=60)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertTrue(p.stdout)
        rc, out, err = run(["--version"], np_=2, env={"OMPI_MCA_pml": "no_such_pml"})
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.count("ddp_train "), 1)
        p = subprocess.run([binary, "--dry-run", "configs/model.yaml"], capture_output=True, text=True, env=bad,
                           timeout=60, cwd=ROOT)
        self.assertNotEqual(p.returncode, 0, "MPI_Init should have failed: the check above proves nothing")

    def test_config_keys_table_matches_docs(self):
        rc, out, _ = run(["--config-keys"])
        self.assertEqual(rc, 0)
        with open(os.path.join(ROOT, "docs", "config-keys.md")) as f:
            self.assertEqual(out, f.read(), "docs/config-keys.md is stale: run `make docs`")


class UsageErrors(unittest.TestCase):
    def check(self, args, needle, np_=1):
        rc, out, err = run(args, np_=np_)
        self.assertEqual(rc, 2, out + err)
        lines = errors(err)
        self.assertEqual(len(lines), 1, err)
        self.assertIn(needle, lines[0])

    def test_no_config(self):
        self.check([], "no config given")

    def test_unknown_option(self):
        self.check(["--frobnicate", "configs/model.yaml"], "unknown option '--frobnicate'")

    def test_bad_device(self):
        self.check(["--device", "tpu", "configs/model.yaml"], "--device tpu: expected auto, cpu or cuda")

    def test_device_cuda_without_a_gpu(self):
        rc, out, err = run(["--device", "cuda", "--dry-run", "configs/model.yaml"], np_=2)
        if "GPU 0:" in run(["--info"])[1]:
            self.skipTest("a GPU is visible here")
        self.assertEqual(rc, 2, out + err)
        lines = errors(err)
        self.assertEqual(len(lines), 1, err)
        self.assertRegex(lines[0], r"--device cuda: .*(cudaGetDeviceCount|built without CUDA|no CUDA device).*use --device cpu")

    def test_config_typo_names_nearest_key(self):
        self.check(["--dry-run", "configs/model.yaml", "--set", "optim.learning_rate=0.1"],
                   "unknown key 'optim.learning_rate'; did you mean 'optim.lr'?", np_=2)

    def test_config_file_typo_has_location(self):
        w = Workdir()
        try:
            w.dataset()
            cfg = w.config(TINY_CNN.replace("  seed: 3", "  sede: 3"))
            self.check(["--dry-run", cfg], f"{cfg}:15:3: unknown key 'train.sede'; did you mean 'train.seed'?")
        finally:
            w.cleanup()

    def test_deep_nesting_is_refused_with_its_place(self):
        # 30,000 levels in a file crashed or hung the parser (its recursion overflowed the stack), and
        # a 60,000-level --set value hung the job for ever: refused past 256 levels, naming the place
        w = Workdir()
        try:
            deep = w.config("model:\n  input: [4]\n  layers: " + "[" * 30000 + "]" * 30000 + "\n", name="deep.yaml")
            self.check(["--dry-run", deep], f"{deep}:3:265: YAML nested more than 256 levels deep", np_=2)
            maps = w.config("model: " + "{{a: " * 30000 + "1" + "}}" * 30000 + "\n", name="maps.yaml")
            self.check(["--dry-run", maps], f"{maps}:1:1028: YAML nested more than 256 levels deep", np_=1)
            self.check(["--dry-run", "configs/mlp.yaml", "--set", "model.layers=" + "[" * 60000 + "]" * 60000],
                       "--set model.layers:1:257: YAML nested more than 256 levels deep", np_=2)
            # 256 levels are YAML enough: what fails is the layer list
            rc, out, err = run(["--dry-run", "configs/mlp.yaml", "--set", "model.layers=" + "[" * 255 + "]" * 255])
            self.assertEqual(rc, 2, out + err)
            self.assertNotIn("nested", err)
        finally:
            w.cleanup()


class BadData(unittest.TestCase):
    """Each bad input of the data exits 2 naming the file, the dataset and the index."""

    def setUp(self):
        self.w = Workdir()
        self.data = self.w.dataset()
        self.cfg = self.w.config(TINY_CNN)

    def tearDown(self):
        self.w.cleanup()

    def check(self, needle, extra=(), np_=2):
        rc, out, err = run(["--dry-run", self.cfg] + list(extra), np_=np_)
        self.assertEqual(rc, 2, out + err)
        lines = errors(err)
        self.assertEqual(len(lines), 1, err)
        self.assertIn(needle, lines[0])
        return lines[0]

    def rewrite(self, fn):
        with h5py.File(self.data, "a") as f:
            fn(f)

    def test_missing_file(self):
        self.check("/nonexistent.h5: data.path: cannot open: No such file or directory",
                   ["--set", "data.path=/nonexistent.h5"])

    def test_missing_dataset(self):
        self.check(f"{self.data}: dataset '/train/pictures' (data.train.x) not found",
                   ["--set", "data.train.x=/train/pictures"])

    def test_length_mismatch(self):
        def shrink(f):
            y = f["train/labels"][:30]
            del f["train/labels"]
            f["train/labels"] = y
        self.rewrite(shrink)
        self.check("'/train/images' has 40 rows but '/train/labels' has shape (30,): x and y lengths differ")

    def test_shape_mismatch(self):
        self.check("has shape (40, 1, 6, 6), which does not match model.input (1, 8, 8)",
                   ["--set", "model.input=[1, 8, 8]"])

    def test_label_out_of_range_names_index(self):
        def bad(f):
            f["train/labels"][17] = 7
        self.rewrite(bad)
        self.check(f"{self.data}: '/train/labels'[17] = 7: label outside [0, 3)")

    def test_corrupt_file(self):
        with open(self.data, "r+b") as f:
            f.seek(0)
            f.write(b"\0" * 64)
        self.check(f"{self.data}: data.path: not a readable HDF5 file")

    def test_file_that_crashes_hdf5(self):
        # found by tests/fuzz/fuzz_data: a corrupt local heap makes HDF5 1.10 itself crash
        shutil.copy(os.path.join(ROOT, "tests/fuzz/regressions/data/hdf5-crash-local-heap.h5"), self.data)
        self.check(f"{self.data}: data.path: HDF5 crashed (signal 11, Segmentation fault) reading the file's structure")

    def test_truncated_file(self):
        size = os.path.getsize(self.data)
        with open(self.data, "r+b") as f:
            f.truncate(size // 3)
        line = self.check(self.data)
        self.assertRegex(line, "not a readable HDF5 file|cannot open HDF5 file|cannot read")
        self.assertNotIn("locked", line)  # HDF5's "truncated file: ... sblock->base_addr" is no lock

    def test_locked_file_says_so(self):
        holder = subprocess.Popen(["/usr/bin/python3", "-c", "import h5py, sys, time\n"
                                   f"f = h5py.File({self.data!r}, 'a')\nprint('open', flush=True)\ntime.sleep(60)"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            self.assertEqual(holder.stdout.readline().strip(), "open")
            line = self.check(f"{self.data}: cannot open HDF5 file: ", np_=1)
            self.assertIn("unable to lock the file", line)
            self.assertIn("(the file is locked; on shared filesystems set HDF5_USE_FILE_LOCKING=FALSE)", line)
            # the checkpoint reader too (model.init_from, --resume)
            free = self.w.file("free.h5")
            shutil.copy(self.data, free)
            rc, out, err = run([self.cfg, "--set", f"data.path={free}", "--set", f"model.init_from={self.data}"])
            self.assertEqual(rc, 2, out + err)
            self.assertIn(f"{self.data}: model.init_from: the file is locked", errors(err)[0])
        finally:
            holder.kill()
            holder.wait()

    def test_wrong_element_type(self):
        def ints(f):
            x = f["train/images"][...].astype(np.int32)
            del f["train/images"]
            f["train/images"] = x
        self.rewrite(ints)
        self.check("element type must be uint8, float32 or float64")

    def test_float_labels_for_cross_entropy(self):
        def floats(f):
            y = f["train/labels"][...].astype(np.float32)
            del f["train/labels"]
            f["train/labels"] = y
        self.rewrite(floats)
        self.check("cross_entropy needs integer class labels shaped (N,)")

    def test_bad_input_on_one_rank_only_exits_2_everywhere(self):
        """Contiguous sharding: only the last rank reads the bad label; all three exit 2, no hang."""
        def bad(f):
            f["train/labels"][39] = -1
        self.rewrite(bad)
        line = self.check("'/train/labels'[39] = -1: label outside [0, 3)",
                          ["--set", "data.sharding=contiguous"], np_=3)
        self.assertIn("on rank 2 (1 of 3 ranks failed)", line)

    def test_config_differs_between_ranks(self):
        rc, out, err = run([], mpmd=[["--dry-run", self.cfg, "--set", "train.seed=1"],
                                     ["--dry-run", self.cfg, "--set", "train.seed=2"]])
        self.assertEqual(rc, 2, out + err)
        lines = errors(err)
        self.assertEqual(len(lines), 1, err)
        self.assertIn("the effective config differs between ranks: rank(s) 1 do not match rank 0", lines[0])


if __name__ == "__main__":
    unittest.main()
