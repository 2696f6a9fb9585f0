"""Runs the Python integration tests with unittest and prints one TAP line per test
("ok - name (12.3 s)", "not ok - name (12.3 s)", "ok - name # SKIP reason") for tests/run.sh to count;
the seconds each test took say where make test's time goes.

  pyrun.py [-j N] NAME...   -j N: N worker processes take the tests from one queue in the order they are
                            listed, for suites whose tests check memory or results, never time, and
                            mostly keep one core busy (tests/run.sh: test_gpu_train, test_memory, test_gpu_check)"""
import contextlib
import multiprocessing
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class TapResult(unittest.TestResult):
    lock = None  # with workers: each line (a failure's traceback included) is printed whole under it

    def emit(self, text):
        with self.lock or contextlib.nullcontext():
            print(text, flush=True)

    def startTest(self, test):
        super().startTest(test)
        self.started = time.monotonic()

    def took(self):  # an error in setUpClass comes before any startTest
        started = getattr(self, "started", None)
        return f"({time.monotonic() - started:.1f} s)" if started is not None else ""

    def addSuccess(self, test):
        super().addSuccess(test)
        self.emit(f"ok - {test.id()} {self.took()}")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.emit(f"not ok - {test.id()} {self.took()}\n" + self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self.emit(f"not ok - {test.id()} {self.took()}\n" + self._exc_info_to_string(err, test))

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:  # a passing subtest says nothing; the test's own line follows when all pass
            self.emit(f"not ok - {subtest.id()}\n" + self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.emit(f"ok - {test.id()} # SKIP {reason}")


def flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from flatten(t)
        else:
            yield t


def worker(tests, queue, lock, failed):
    """Runs tests[i] for each i taken from queue until None, each in a suite of its own (class fixtures
    included); a TAP line is printed whole, under lock."""
    for i in iter(queue.get, None):
        result = TapResult()  # a fresh one: unittest keeps the last test's class on it, for its fixtures
        result.lock = lock
        unittest.TestSuite([tests[i]]).run(result)
        if not result.wasSuccessful():
            failed.value = 1


def main():
    args = sys.argv[1:]
    jobs = 1
    if args[:1] == ["-j"]:
        jobs, args = int(args[1]), args[2:]
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromName(n) for n in args)
    if jobs <= 1:
        result = TapResult()
        suite.run(result)
        return 0 if result.wasSuccessful() else 1
    tests = list(flatten(suite))
    ctx = multiprocessing.get_context("fork")  # the workers share the loaded modules
    queue, lock, failed = ctx.Queue(), ctx.Lock(), ctx.Value("i", 0)
    for i in range(len(tests)):
        queue.put(i)
    for _ in range(jobs):
        queue.put(None)
    workers = [ctx.Process(target=worker, args=(tests, queue, lock, failed)) for _ in range(jobs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
        if w.exitcode != 0:
            print(f"not ok - a pyrun worker exited {w.exitcode}", flush=True)
            failed.value = 1
    return failed.value


if __name__ == "__main__":
    sys.exit(main())
