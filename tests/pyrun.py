"""Runs the Python integration tests with unittest and prints one TAP line per test
("ok - name (12.3 s)", "not ok - name (12.3 s)", "ok - name # SKIP reason") for tests/run.sh to count;
the seconds each test took say where make test's time goes."""
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class TapResult(unittest.TestResult):
    def startTest(self, test):
        super().startTest(test)
        self.started = time.monotonic()

    def took(self):  # an error in setUpClass comes before any startTest
        started = getattr(self, "started", None)
        return f"({time.monotonic() - started:.1f} s)" if started is not None else ""

    def addSuccess(self, test):
        super().addSuccess(test)
        print(f"ok - {test.id()} {self.took()}", flush=True)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        print(f"not ok - {test.id()} {self.took()}\n" + self._exc_info_to_string(err, test), flush=True)

    def addError(self, test, err):
        super().addError(test, err)
        print(f"not ok - {test.id()} {self.took()}\n" + self._exc_info_to_string(err, test), flush=True)

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:  # a passing subtest says nothing; the test's own line follows when all pass
            print(f"not ok - {subtest.id()}\n" + self._exc_info_to_string(err, test), flush=True)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        print(f"ok - {test.id()} # SKIP {reason}", flush=True)


def main():
    names = sys.argv[1:]
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromName(n) for n in names)
    result = TapResult()
    suite.run(result)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
