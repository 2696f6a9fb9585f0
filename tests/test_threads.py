"""The threads of a training run: the batch prefetch thread (data cached in memory) and the signal
flag set by a handler, on a short 2-rank run stopped by SIGUSR1 on one rank, then resumed.
`make test-tsan` runs this suite with ddp_train built with ThreadSanitizer, where any race between
the threads is a report that fails the run; in `make test` it checks the same run without it."""
import unittest

from helpers import TINY_CNN, Workdir, run


class Threads(unittest.TestCase):
    def test_prefetch_thread_and_signal_flag(self):
        w = Workdir()
        try:
            w.dataset(n=64)
            cfg = w.config(TINY_CNN.replace("scale:", "cache: memory\n  scale:"))
            args = [cfg, "--set", "train.epochs=3", "--set", "dist.threads=1"]
            rc, out, err = run(args, np_=2, env={"DDP_TRAIN_FAULT": "signal@1:5"})
            self.assertEqual(rc, 75, out + err)
            self.assertIn("stopped by SIGUSR1 at step 5", err)
            rc, out, err = run(args + ["--resume", "auto"], np_=2)
            self.assertEqual(rc, 0, out + err)
            self.assertIn("resuming at step 5", out)
            self.assertIn("done: 24 steps", out)
        finally:
            w.cleanup()


if __name__ == "__main__":
    unittest.main()
