"""monitor.listen: rank 0's HTTP endpoint during real 2-rank training runs. /metrics parses with
prometheus_client and equals metrics.jsonl; /status and /history; /health turns 503 when a rank
hangs, before the job exits 3; POST /stop exits 75 with a checkpoint that resumes bit-exactly;
POST /checkpoint; the bearer token (missing, wrong, a readable token file); addresses refused at
start-up (not loopback without a token, in use, bad); malformed, oversized and slow requests; 100
connections trickling their headers from 100 addresses; a bounded load of 4 clients during training; the NVML series on the GPU stand-in.

Every wait polls with a deadline: the runs share two cores with everything else."""
import http.client
import json
import os
import re
import socket
import subprocess
import threading
import time
import unittest

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from helpers import BINARY, ENV, GPU_BINARY, ROOT, Workdir, errors, gpu_setup, params, run

# about 1-2 ms a step on one core: steps are real work, and a run of a few thousand lasts seconds
MONITOR_CNN = """\
model:
  input: [3, 16, 16]
  layers:
    - conv2d: {{out: 16, kernel: 3, pad: 1}}
    - relu
    - maxpool: {{kernel: 2}}
    - conv2d: {{out: 16, kernel: 3, pad: 1}}
    - relu
    - maxpool: {{kernel: 2}}
    - flatten
    - linear: {{out: 4}}
data:
  path: {dir}/data.h5
  scale: 0.00392156862745098
train: {{epochs: 100000, max_steps: {steps}, batch_size: auto, global_batch_size: 32, seed: 3, eval_every_steps: 25}}
optim: {{name: sgd, lr: 0.02, momentum: 0.9}}
log: {{dir: {dir}/log, every_steps: {log_every}}}
checkpoint: {{dir: {dir}/ckpt, every_epochs: 0}}
dist: {{timeout_s: 60}}
monitor: {{listen: "127.0.0.1:0"}}
"""

FOREVER = 10 ** 9  # max_steps of a run that a test stops itself
TOKEN = "7f3a-monitor-test-token"


def make_workdir(steps, log_every=1, extra=""):
    w = Workdir()
    w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)
    cfg = w.config(MONITOR_CNN + extra, steps=steps, log_every=log_every)
    return w, cfg


def write_token(w, mode=0o600, name="token"):
    path = w.file(name)
    with open(path, "w") as f:
        f.write(TOKEN + "\n")
    os.chmod(path, mode)
    return path


_step_s = []


def steps_for(seconds):
    """Steps of MONITOR_CNN that last about `seconds` on this machine (measured once), at least 200."""
    if not _step_s:
        w, cfg = make_workdir(300)
        try:
            rc, out, err = run([cfg, "--set", "monitor.listen=", "--set", "train.eval_every_steps=0"], np_=2,
                               timeout=300)
            assert rc == 0, out + err
            ms = [r["step_ms"] for r in w.metrics() if "loss" in r and r["step"] > 100]
            _step_s.append(max(sum(ms) / len(ms) / 1e3, 1e-5))
        finally:
            w.cleanup()
    return max(200, int(seconds / _step_s[0]))


class Job:
    """ddp_train under mpirun in the background, its output drained by threads (a full pipe would
    stall rank 0)."""

    def __init__(self, args, np_=2, env=None, binary=BINARY):
        self.p = subprocess.Popen(["mpirun", "--oversubscribe", "-np", str(np_), binary] + args,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env=dict(ENV, **(env or {})))
        self.lines = {"out": [], "err": []}
        self.drains = [threading.Thread(target=self._drain, args=(f, self.lines[k]), daemon=True)
                       for f, k in ((self.p.stdout, "out"), (self.p.stderr, "err"))]
        for t in self.drains:
            t.start()

    @staticmethod
    def _drain(f, into):
        for line in f:
            into.append(line)

    @property
    def out(self):
        return "".join(self.lines["out"])

    @property
    def err(self):
        return "".join(self.lines["err"])

    def address(self, timeout=180):
        """HOST:PORT from the start-up line `monitor: listening on http://HOST:PORT ...`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines["out"]):
                m = re.match(r"monitor: listening on http://(\S+) ", line)
                if m:
                    return m.group(1)
            if self.p.poll() is not None:
                self.wait()
                raise AssertionError(f"exited {self.p.returncode} before listening:\n{self.out}{self.err}")
            time.sleep(0.05)
        raise AssertionError(f"no monitor line within {timeout} s:\n{self.out}{self.err}")

    def wait(self, timeout=300):
        rc = self.p.wait(timeout=timeout)
        for t in self.drains:
            t.join(timeout=30)
        return rc

    def running(self):
        return self.p.poll() is None

    def stop(self):
        """Ends the job if it still runs (mpirun forwards SIGTERM to the ranks)."""
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self.wait(timeout=60)


def request(addr, path, method="GET", token=None, headers=None, timeout=20):
    """(status, headers, body text)."""
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = "Bearer " + token
        c.request(method, path, headers=h)
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        c.close()


def wait_for_step(test, addr, step, job, timeout=180):
    """Polls /health until the run has finished `step` steps; returns the body."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        test.assertTrue(job.running(), f"the job ended:\n{job.out}{job.err}")
        status, _, body = request(addr, "/health")
        h = json.loads(body)
        if status == 200 and h["status"] == "ok" and h["step"] >= step:
            return h
        time.sleep(0.05)
    test.fail(f"step {step} not reached in {timeout} s")


def samples(text):
    """{sample name: [(labels, value)]} and the families of a /metrics text."""
    fams = list(text_string_to_metric_families(text))
    out = {}
    for f in fams:
        for s in f.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out, fams


def value(smp, name):
    (labels, v), = smp[name]
    return v


def raw_exchange(addr, data, chunk=65536, timeout=20):
    """Sends bytes on a fresh connection, reading as it goes (the server may answer and close
    before all is sent); returns (what came back, seconds until the server closed)."""
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=timeout)
    got = b""
    t0 = time.monotonic()
    try:
        for i in range(0, len(data), chunk):
            try:
                s.sendall(data[i:i + chunk])
            except OSError:
                break
            s.setblocking(False)
            try:
                d = s.recv(65536)
                got += d
                if d == b"":
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            finally:
                s.settimeout(timeout)
        while True:
            try:
                d = s.recv(65536)
            except OSError:
                break
            if not d:
                break
            got += d
    finally:
        s.close()
    return got, time.monotonic() - t0


def status_of(reply):
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", reply)
    return int(m.group(1)) if m else None


class MetricsAndStatus(unittest.TestCase):
    def setUp(self):
        self.steps = steps_for(12)
        self.w, self.cfg = make_workdir(self.steps)
        self.job = None

    def tearDown(self):
        if self.job:
            self.job.stop()
        self.w.cleanup()

    def check_scrape(self, text, records):
        smp, fams = samples(text)
        typed = re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
        helped = re.findall(r"^# HELP (\S+) \S", text, re.M)
        self.assertEqual([n for n, _ in typed], helped)  # every family has its # HELP and # TYPE
        self.assertEqual(len(typed), len(fams))
        for f in fams:
            self.assertIn(f.type, ("gauge", "counter"), f.name)
            self.assertTrue(f.documentation, f.name)
        counters = [f.name for f in fams if f.type == "counter"]
        self.assertEqual(counters, ["ddp_train_steps"])
        step = int(value(smp, "ddp_train_metrics_step"))
        self.assertEqual(value(smp, "ddp_train_step"), step)  # log.every_steps 1: the newest step is logged
        rec = [r for r in records if r["step"] == step and "loss" in r][-1]
        self.assertEqual(value(smp, "ddp_train_epoch"), rec["epoch"])
        # the same numbers, as metrics.jsonl prints them (%.9g, %.1f; times in ms with %.3f)
        self.assertEqual(float(f"{value(smp, 'ddp_train_loss'):.9g}"), rec["loss"])
        self.assertEqual(float(f"{value(smp, 'ddp_train_learning_rate'):.9g}"), rec["lr"])
        self.assertEqual(float(f"{value(smp, 'ddp_train_samples_per_second'):.1f}"), rec["samples_per_s"])
        for name, key in (("step", "step_ms"), ("compute", "compute_ms"), ("data", "data_ms"), ("comm", "comm_ms")):
            self.assertAlmostEqual(value(smp, f"ddp_train_{name}_seconds") * 1e3, rec[key], delta=6e-4, msg=name)
        ranks = {int(l["rank"]): v * 1e3 for l, v in smp["ddp_train_rank_compute_seconds"]}
        self.assertEqual(sorted(ranks), [0, 1])
        self.assertAlmostEqual(min(ranks.values()), rec["compute_ms_min"], delta=6e-4)
        self.assertAlmostEqual(max(ranks.values()), rec["compute_ms_max"], delta=6e-4)
        self.assertAlmostEqual(ranks[0], rec["compute_ms"], delta=6e-4)
        self.assertTrue(all(l["host"] for l, _ in smp["ddp_train_rank_compute_seconds"]))
        self.assertEqual(value(smp, "ddp_train_straggler_rank"), rec["straggler_rank"])
        self.assertEqual(value(smp, "ddp_train_steps_total"), step)
        self.assertEqual(value(smp, "ddp_train_planned_steps"), self.steps)
        if "ddp_train_val_step" in smp:
            vstep = int(value(smp, "ddp_train_val_step"))
            ev = [r for r in records if r["step"] == vstep and "val_loss" in r][-1]
            for name, key in (("val_loss", "val_loss"), ("val_accuracy", "val_acc"),
                              ("ema_val_loss", "ema_val_loss"), ("ema_val_accuracy", "ema_val_acc")):
                self.assertEqual(float(f"{value(smp, f'ddp_train_{name}'):.9g}"), ev[key], name)
        return smp

    def test_metrics_equal_metrics_jsonl_and_status_history_agree(self):
        self.job = Job([self.cfg, "--set", "train.ema.decay=0.9", "--set", "checkpoint.every_steps=40", "--set",
                        "checkpoint.keep=100000", "--set", "dist.zero=1"])
        addr = self.job.address()
        status, headers, body = request(addr, "/metrics")  # before or at the first step: answers too
        self.assertEqual(status, 200)
        self.assertTrue(headers["content-type"].startswith("text/plain; version=0.0.4"))
        wait_for_step(self, addr, 60, self.job)
        checked = with_val = with_ckpt = 0
        deadline = time.monotonic() + 120
        while (checked < 5 or not with_val or not with_ckpt) and time.monotonic() < deadline:
            status, headers, text = request(addr, "/metrics")
            self.assertEqual(status, 200)
            smp = self.check_scrape(text, self.w.metrics())
            checked += 1
            with_val += "ddp_train_ema_val_accuracy" in smp
            if "ddp_train_checkpoint_step" in smp:
                ck = int(value(smp, "ddp_train_checkpoint_step"))
                self.assertEqual(ck % 40, 0)
                self.assertTrue(os.path.exists(self.w.file(f"ckpt/step-{ck:08d}.h5")))
                self.assertGreaterEqual(value(smp, "ddp_train_checkpoint_age_seconds"), 0)
                with_ckpt += 1
            time.sleep(0.2)
        self.assertGreaterEqual(checked, 5)
        self.assertTrue(with_val and with_ckpt)
        self.assertIn("# HELP ddp_train_loss ", text)
        self.assertIn("# TYPE ddp_train_loss gauge", text)
        self.assertIn("# TYPE ddp_train_steps_total counter", text)
        info, = smp["ddp_train_info"]
        # /status: the same run
        status, headers, body = request(addr, "/status")
        self.assertEqual(status, 200)
        self.assertEqual(headers["content-type"], "application/json")
        st = json.loads(body)
        self.assertEqual(st["config_hash"], info[0]["config_hash"])
        self.assertEqual(st["world_size"], 2)
        self.assertEqual([r["rank"] for r in st["ranks"]], [0, 1])
        self.assertEqual([r["device"] for r in st["ranks"]], ["cpu", "cpu"])
        self.assertEqual(st["progress"]["total_steps"], self.steps)
        self.assertGreater(st["progress"]["step"], 0)
        self.assertGreaterEqual(st["eta_s"], 0)
        self.assertEqual(st["state"], "training")
        self.assertEqual(st["global_batch"], 32)
        # train.batch_size auto: the whole step fits one micro-batch of this small model
        self.assertEqual((st["batch"]["rank_rows"], st["batch"]["grad_accum"]), (16, 1))
        self.assertRegex(st["batch"]["auto"], r"^train\.batch_size auto: 16 rows per rank, train\.grad_accum 1 \(32 "
                                              r"rows a step on 2 ranks\); a rank needs [\d.]+ MiB of the [\d.]+ MiB")
        # dist.zero 1: rank 0 keeps SGD's momentum for 1,898 of the 3,796 parameters
        self.assertEqual(st["optimizer"], {"name": "sgd", "zero": 1, "state_bytes_per_rank": 1898 * 4})
        self.assertIsNone(st["distill"])  # no distill section
        # /history: metrics.jsonl from a step on, whole records only
        since = st["progress"]["step"] - 30
        status, headers, body = request(addr, f"/history?since={since}")
        self.assertEqual(status, 200)
        hist = json.loads(body)
        later = [r for r in self.w.metrics() if r["step"] >= since]
        self.assertGreaterEqual(len(hist), 30)
        self.assertEqual(hist, later[:len(hist)])
        status, headers, body = request(addr, "/history?since=0&limit=3")
        self.assertEqual(json.loads(body), self.w.metrics()[:3])
        self.assertEqual(int(headers["x-next-from"]), 3)  # the index of the next record
        self.assertNotIn("x-next-since", headers)
        for bad in ("since=-1", "since=x", "since=1&limit=0", "limit=10001", "from=-1", "from=x"):
            self.assertEqual(request(addr, f"/history?{bad}")[0], 400, bad)
        self.assertEqual(self.job.wait(), 0, self.job.out + self.job.err)
        self.assertIn("done:", self.job.out)

    def resume_from_step_100(self):
        """A run of 300 steps, then one resumed from its checkpoint at step 100, serving: its
        metrics.jsonl holds steps 101-300 twice, and evaluation records (every 25 steps) that share
        their step with a training record. Returns the address once step 420 is done."""
        rc, out, err = run([self.cfg, "--set", "monitor.listen=", "--set", "train.max_steps=300", "--set",
                            "checkpoint.every_steps=100", "--set", "checkpoint.keep=10"], np_=2, timeout=600)
        self.assertEqual(rc, 0, out + err)
        token = write_token(self.w)
        self.job = Job([self.cfg, "--resume", self.w.file("ckpt/step-00000100.h5"), "--set",
                        f"monitor.token_file={token}", "--set", f"train.max_steps={FOREVER}"])
        addr = self.job.address()
        wait_for_step(self, addr, 420, self.job)
        return addr

    def whole_records(self):
        """metrics.jsonl's records so far, without a line the run is still writing."""
        with open(self.w.file("log/metrics.jsonl")) as f:
            return [json.loads(l) for l in f.read().split("\n")[:-1]]

    def test_history_in_file_order_after_a_resume_from_an_older_checkpoint(self):
        # /history returns every record at or after `since`, in file order, however the file's
        # index skips ahead
        addr = self.resume_from_step_100()
        for since in (0, 1, 63, 64, 65, 99, 100, 101, 150, 299, 300, 301, 400):
            status, headers, body = request(addr, f"/history?since={since}&limit=2000")
            self.assertEqual(status, 200)
            hist = json.loads(body)
            want = [r for r in self.w.metrics() if r["step"] >= since]
            self.assertGreater(len(hist), 0)
            self.assertEqual(hist, want[:len(hist)], since)
        self.assertEqual(request(addr, "/stop", "POST", token=TOKEN)[0], 202)
        self.assertEqual(self.job.wait(), 75, self.job.out + self.job.err)

    def test_history_walked_page_by_page_is_metrics_jsonl(self):
        # the cursor is a record's index, so pages neither repeat nor skip a record, even where
        # records share a step (an evaluation) or steps come twice (the resume)
        addr = self.resume_from_step_100()
        records = self.whole_records()
        steps = [r["step"] for r in records]
        self.assertGreater(len(steps), len(set(steps)) + 200)  # steps 101-300 twice, evaluations
        walked, cursor = [], 0
        while len(walked) < len(records):
            status, headers, body = request(addr, f"/history?from={cursor}&limit=1")
            self.assertEqual(status, 200, body)
            page = json.loads(body)
            self.assertEqual(len(page), 1, cursor)
            walked += page
            if len(walked) < len(records):  # the run goes on: there is always a next one
                self.assertEqual(int(headers["x-next-from"]), cursor + 1)
                cursor += 1
        self.assertEqual(walked, records)
        # since filters by step, from and X-Next-From page through what it keeps
        want = [r for r in records if r["step"] >= 150]
        got, cursor = [], 0
        while len(got) < len(want):
            status, headers, body = request(addr, f"/history?since=150&limit=7&from={cursor}")
            self.assertEqual(status, 200, body)
            got += json.loads(body)
            if len(got) < len(want):
                cursor = int(headers["x-next-from"])
        self.assertEqual(got[:len(want)], want)
        # an answer holds at most 256 KiB of records (the file is larger): the rest is the next page's
        self.assertGreater(os.path.getsize(self.w.file("log/metrics.jsonl")), 300 * 1024)
        got, cursor, pages = [], 0, 0
        while len(got) < len(records):
            status, headers, body = request(addr, f"/history?from={cursor}")
            self.assertEqual(status, 200, body)
            self.assertLess(len(body), 256 * 1024 + 16)
            got += json.loads(body)
            pages += 1
            if len(got) < len(records):
                cursor = int(headers["x-next-from"])
        self.assertEqual(got[:len(records)], records)
        self.assertGreater(pages, 1)
        self.assertEqual(request(addr, "/stop", "POST", token=TOKEN)[0], 202)
        self.assertEqual(self.job.wait(), 75, self.job.out + self.job.err)


    def test_a_fifo_in_place_of_metrics_jsonl_is_500_and_the_server_goes_on(self):
        # the server has one thread: opening a FIFO for /history must not wait for a writer
        self.job = Job([self.cfg, "--set", f"train.max_steps={FOREVER}"])
        addr = self.job.address()
        wait_for_step(self, addr, 5, self.job)
        path = self.w.file("log/metrics.jsonl")
        os.rename(path, path + ".old")  # the run goes on writing the renamed file
        os.mkfifo(path, 0o600)
        try:
            status, _, body = request(addr, "/history?since=0", timeout=10)
            self.assertEqual(status, 500, body)
            self.assertIn(f"{path} is a FIFO, not a regular file", json.loads(body)["error"])
            self.assertEqual(request(addr, "/health", timeout=10)[0], 200)
        finally:  # a server thread stuck in open() is let go
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        self.job.stop()


class Health(unittest.TestCase):
    def test_health_turns_503_naming_the_missing_rank_before_the_job_exits_3(self):
        w, cfg = make_workdir(FOREVER, log_every=50)
        job = Job([cfg, "--set", "dist.timeout_s=20", "--set", "monitor.stall_s=2s"], env={"DDP_TRAIN_FAULT": "hang@1:40"})
        try:
            addr = job.address()
            first_503 = stalled = None
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and job.running():
                try:
                    status, _, body = request(addr, "/health", timeout=5)
                except OSError:  # the job was aborted under us
                    break
                h = json.loads(body)
                if status == 503 and first_503 is None:
                    first_503 = h
                    _, _, text = request(addr, "/metrics")
                    self.assertEqual(value(samples(text)[0], "ddp_train_stalled"), 1)
                if status == 503 and "missing_ranks" in h:
                    stalled = h
                    break
                self.assertEqual(status, 200 if first_503 is None else 503, body)
                time.sleep(0.1)
            self.assertIsNotNone(stalled, f"no 503 naming the missing rank while the job ran:\n{job.out}{job.err}")
            self.assertTrue(job.running())
            self.assertEqual(first_503["status"], "stalled")
            self.assertEqual(stalled["step"], 39)
            self.assertGreaterEqual(stalled["seconds_since_step"], 2)
            self.assertEqual(stalled["waiting_in"], "gradient allreduce")
            self.assertEqual(stalled["waiting_at_step"], 40)
            self.assertEqual(stalled["missing_ranks"], [1])
            rc = job.wait(timeout=120)
            self.assertEqual(rc, 3, job.out + job.err)
            self.assertIn("rank(s) 1 never arrived", job.err)
        finally:
            job.stop()
            w.cleanup()


class StopAndCheckpoint(unittest.TestCase):
    def setUp(self):
        self.steps = steps_for(8)
        self.w, self.cfg = make_workdir(self.steps, log_every=10)
        self.token = write_token(self.w)
        self.args = [self.cfg, "--set", f"monitor.token_file={self.token}"]

    def tearDown(self):
        self.w.cleanup()

    def test_post_stop_exits_75_with_a_checkpoint_and_resumes_bit_exactly(self):
        rc, out, err = run([self.cfg, "--set", "monitor.listen="], np_=2, timeout=600)
        self.assertEqual(rc, 0, out + err)
        full = params(self.w.latest())
        self.assertTrue(self.w.latest().endswith(f"step-{self.steps:08d}.h5"))
        os.rename(self.w.file("ckpt"), self.w.file("ckpt_full"))
        os.rename(self.w.file("log"), self.w.file("log_full"))
        job = Job(self.args)
        try:
            addr = job.address()
            wait_for_step(self, addr, 20, job)
            status, _, body = request(addr, "/stop", "POST", token=TOKEN)
            self.assertEqual(status, 202, body)
            self.assertEqual(json.loads(body)["accepted"], "stop")
            rc = job.wait()
        finally:
            job.stop()
        self.assertEqual(rc, 75, job.out + job.err)
        m = re.search(r"stopped by POST /stop at step (\d+) after saving a checkpoint", job.err)
        self.assertTrue(m, job.err)
        stop = int(m.group(1))
        self.assertLess(stop, self.steps)
        self.assertTrue(self.w.latest().endswith(f"step-{stop:08d}.h5"))
        rc, out, err = run(self.args + ["--resume", "auto"], np_=2, timeout=600)
        self.assertEqual(rc, 0, out + err)
        self.assertIn(f"resuming at step {stop}", out)
        resumed = params(self.w.latest())
        for k in full:
            self.assertTrue(np.array_equal(full[k], resumed[k]), k)

    def test_post_checkpoint_writes_one_at_the_next_step_and_training_goes_on(self):
        job = Job(self.args)
        try:
            addr = job.address()
            wait_for_step(self, addr, 10, job)
            status, _, body = request(addr, "/checkpoint", "POST", token=TOKEN)
            self.assertEqual(status, 202, body)
            rc = job.wait()
        finally:
            job.stop()
        self.assertEqual(rc, 0, job.out + job.err)
        m = re.search(r"step (\d+): a checkpoint was asked for \(POST /checkpoint\)", job.out)
        self.assertTrue(m, job.out)
        asked = int(m.group(1))
        self.assertLess(asked, self.steps)
        self.assertEqual(sorted(os.listdir(self.w.file("ckpt"))),
                         sorted(["latest", f"step-{asked:08d}.h5", f"step-{self.steps:08d}.h5"]))
        self.assertEqual(max(r["step"] for r in self.w.metrics()), self.steps)


class Token(unittest.TestCase):
    def setUp(self):
        self.w = Workdir()
        self.w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)

    def tearDown(self):
        self.w.cleanup()

    def test_missing_or_wrong_token_gets_401_and_training_finishes(self):
        steps = steps_for(6)
        cfg = self.w.config(MONITOR_CNN, steps=steps, log_every=10)
        token = write_token(self.w)
        job = Job([cfg, "--set", f"monitor.token_file={token}"])
        try:
            addr = job.address()
            wait_for_step(self, addr, 5, job)
            for path in ("/stop", "/checkpoint"):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"},
                                {"Authorization": f"Bearer {TOKEN[:-1]}"}, {"Authorization": f"Basic {TOKEN}"},
                                {"Authorization": "Bearer "}):
                    status, h, body = request(addr, path, "POST", headers=headers)
                    self.assertEqual(status, 401, (path, headers, body))
                    self.assertEqual(h["www-authenticate"], 'Bearer realm="ddp_train"')
            self.assertEqual(request(addr, "/health")[0], 200)  # GET is open on loopback
            self.assertEqual(request(addr, "/stop")[0], 405)
            self.assertEqual(request(addr, "/health", "POST", token=TOKEN)[0], 405)
            rc = job.wait()
        finally:
            job.stop()
        self.assertEqual(rc, 0, job.out + job.err)
        self.assertNotIn("a checkpoint was asked for", job.out)
        self.assertEqual(max(r["step"] for r in self.w.metrics()), steps)
        self.assertEqual(sorted(os.listdir(self.w.file("ckpt"))), ["latest", f"step-{steps:08d}.h5"])

    def test_a_token_file_others_can_read_is_exit_2_naming_it(self):
        cfg = self.w.config(MONITOR_CNN, steps=5, log_every=1)
        for mode in (0o644, 0o640, 0o604):
            token = write_token(self.w, mode, name=f"token{mode:o}")
            rc, out, err = run([cfg, "--set", f"monitor.token_file={token}"], np_=2)
            self.assertEqual(rc, 2, out + err)
            line = errors(err)[0]
            self.assertIn(f"monitor.token_file {token} is readable by", line)
            self.assertIn("chmod 600", line)
            self.assertFalse(os.path.exists(self.w.file("log/metrics.jsonl")))  # before any step
        for content, why in (("", "it is empty"), ("two words\n", "without spaces")):
            path = self.w.file("bad_token")
            with open(path, "w") as f:
                f.write(content)
            os.chmod(path, 0o600)
            rc, out, err = run([cfg, "--set", f"monitor.token_file={path}"], np_=2)
            self.assertEqual(rc, 2, out + err)
            self.assertIn(why, errors(err)[0])

    def test_a_token_file_others_can_change_is_exit_2_naming_it(self):
        # as ssh checks its keys: a token that another user can rewrite is not a secret of yours
        cfg = self.w.config(MONITOR_CNN, steps=5, log_every=1)
        for mode, why in ((0o620, "is writable by its group"), (0o602, "is writable by others"),
                          (0o622, "is writable by its group and others"),
                          (0o660, "is readable by its group and writable by its group")):
            token = write_token(self.w, mode, name=f"token{mode:o}")
            for dry in ([], ["--dry-run"]):  # the same check in --dry-run
                rc, out, err = run([cfg, "--set", f"monitor.token_file={token}"] + dry, np_=2)
                self.assertEqual(rc, 2, out + err)
                line = errors(err)[0]
                self.assertIn(f"monitor.token_file {token} {why} (mode 0{mode:o})", line)
                self.assertIn("chmod 600", line)
            self.assertFalse(os.path.exists(self.w.file("log/metrics.jsonl")))  # before any step
        if os.geteuid() != 0:
            return  # only root can give a file away
        token = write_token(self.w, name="token_theirs")
        os.chown(token, 4242, 4242)
        rc, out, err = run([cfg, "--set", f"monitor.token_file={token}"], np_=2)
        self.assertEqual(rc, 2, out + err)
        self.assertIn(f"monitor.token_file {token} is owned by uid 4242, not by you (uid 0) or root", errors(err)[0])

    def test_a_fifo_as_token_file_is_exit_2_at_once(self):
        # open() of a FIFO waits for a writer: the file is opened without blocking and checked first
        cfg = self.w.config(MONITOR_CNN, steps=5, log_every=1)
        fifo = self.w.file("token_fifo")
        os.mkfifo(fifo, 0o600)
        t0 = time.monotonic()
        try:
            rc, out, err = run([cfg, "--set", f"monitor.token_file={fifo}"], np_=2, timeout=60)
        finally:  # a rank stuck in open() is let go
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        self.assertEqual(rc, 2, out + err)
        self.assertIn(f"monitor.token_file {fifo} is a FIFO, not a regular file", errors(err)[0])
        self.assertLess(time.monotonic() - t0, 30)

    def test_not_loopback_needs_a_token_file_and_then_every_request_the_token(self):
        cfg = self.w.config(MONITOR_CNN, steps=FOREVER, log_every=50)
        rc, out, err = run([cfg, "--set", "monitor.listen=0.0.0.0:0"], np_=2)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("monitor.listen 0.0.0.0:0 is not a loopback address", errors(err)[0])
        self.assertIn("monitor.token_file", errors(err)[0])
        token = write_token(self.w)
        job = Job([cfg, "--set", "monitor.listen=0.0.0.0:0", "--set", f"monitor.token_file={token}"])
        try:
            addr = job.address()
            self.assertTrue(addr.startswith("0.0.0.0:"), addr)
            self.assertIn("is not loopback: every request needs the bearer token", job.out)
            local = "127.0.0.1:" + addr.rsplit(":", 1)[1]
            self.assertEqual(request(local, "/metrics")[0], 401)
            self.assertEqual(request(local, "/metrics", token="wrong")[0], 401)
            self.assertEqual(request(local, "/metrics", token=TOKEN)[0], 200)
            self.assertEqual(request(local, "/stop", "POST", token=TOKEN)[0], 202)
            self.assertEqual(job.wait(), 75, job.out + job.err)
        finally:
            job.stop()

    def test_ipv6_loopback(self):
        try:
            socket.socket(socket.AF_INET6).bind(("::1", 0))
        except OSError:
            self.skipTest("no IPv6 loopback here")
        cfg = self.w.config(MONITOR_CNN, steps=FOREVER, log_every=50)
        token = write_token(self.w)
        job = Job([cfg, "--set", 'monitor.listen="[::1]:0"', "--set", f"monitor.token_file={token}"])
        try:
            addr = job.address()
            self.assertTrue(addr.startswith("[::1]:"), addr)
            self.assertEqual(request(addr, "/health")[0], 200)  # loopback: GET is open
            self.assertEqual(request(addr, "/stop", "POST", token=TOKEN)[0], 202)
            self.assertEqual(job.wait(), 75, job.out + job.err)
        finally:
            job.stop()

    def test_an_address_in_use_or_malformed_is_exit_2_naming_it(self):
        cfg = self.w.config(MONITOR_CNN, steps=5, log_every=1)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", 0))
            s.listen()
            taken = f"127.0.0.1:{s.getsockname()[1]}"
            rc, out, err = run([cfg, "--set", f"monitor.listen={taken}"], np_=2)
            self.assertEqual(rc, 2, out + err)
            self.assertIn(f"monitor.listen {taken}: the address is already in use", errors(err)[0])
        finally:
            s.close()
        for bad in ("127.0.0.1", "127.0.0.1:99999", "::1:80", ":9400", "127.0.0.1:x"):
            rc, out, err = run([cfg, "--set", f"monitor.listen={bad}"], np_=2)
            self.assertEqual(rc, 2, out + err)
            self.assertIn(f"monitor.listen '{bad}': expected HOST:PORT", errors(err)[0])
        rc, out, err = run([cfg, "--set", "monitor.listen=no-such-host.invalid:80"], np_=2)
        self.assertEqual(rc, 2, out + err)
        self.assertIn("monitor.listen no-such-host.invalid:80: cannot resolve", errors(err)[0])
        # --dry-run checks the address and the token file without binding
        rc, out, err = run([cfg, "--dry-run", "--set", "monitor.listen=0.0.0.0:9400"], np_=1)
        self.assertEqual(rc, 2, out + err)
        rc, out, err = run([cfg, "--dry-run", "--set", "monitor.listen=127.0.0.1:9400"], np_=1)
        self.assertEqual(rc, 0, out + err)
        # addresses that resolve but that no socket here can listen on: refused by the same check
        # in --dry-run and in a run
        for bad, why in (("[::ffff:127.0.0.1]:0", "an IPv4-mapped IPv6 address"),
                         ("224.0.0.1:0", "a multicast address"), ("[ff02::1]:0", "a multicast address"),
                         ("[fe80::1]:0", "a link-local IPv6 address needs its interface")):
            for dry in (["--dry-run"], []):
                rc, out, err = run([cfg, "--set", f'monitor.listen="{bad}"'] + dry, np_=1)
                self.assertEqual(rc, 2, out + err)
                self.assertIn(f"monitor.listen {bad}: {why}", errors(err)[0])


class BadRequests(unittest.TestCase):
    """One run that the tests hit with bad requests; it must keep training and answering."""

    @classmethod
    def setUpClass(cls):
        cls.w, cls.cfg = make_workdir(FOREVER, log_every=100)
        cls.token = write_token(cls.w)
        cls.job = Job([cls.cfg, "--set", f"monitor.token_file={cls.token}"])
        cls.addr = cls.job.address()

    @classmethod
    def tearDownClass(cls):
        try:
            if cls.job.running():
                request(cls.addr, "/stop", "POST", token=TOKEN)
                cls.rc = cls.job.wait()
        finally:
            cls.job.stop()
            cls.w.cleanup()

    def assert_still_training(self):
        h1 = wait_for_step(self, self.addr, 1, self.job)
        wait_for_step(self, self.addr, h1["step"] + 1, self.job)

    def test_garbage_bytes(self):
        # Binary noise: a 4xx, or, when its first line has no space at all (no request target),
        # the connection closed at once without a status line (libmicrohttpd 0.9.75's answer).
        rng = np.random.default_rng(5)
        blobs = [rng.integers(0, 256, 300, dtype=np.uint8).tobytes() + b"\r\n\r\n" for _ in range(40)]
        replies = {}

        def send(i):
            replies[i] = raw_exchange(self.addr, blobs[i])

        for first in range(0, len(blobs), 8):  # 8 at a time: each may wait for the idle timeout
            threads = [threading.Thread(target=send, args=(i,)) for i in range(first, first + 8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        codes = [status_of(replies[i][0]) for i in range(len(blobs))]
        for i, code in enumerate(codes):
            first_line = blobs[i].split(b"\n")[0]
            self.assertTrue(code is None and b" " not in first_line or code and 400 <= code < 500, (code, blobs[i]))
            self.assertLess(replies[i][1], 15)
        self.assertGreaterEqual(codes.count(400), 5)
        for data in (b"GET /health\r\n\r\n", b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n",
                     b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n"):
            reply, _ = raw_exchange(self.addr, data)
            self.assertEqual(status_of(reply), 400, (data, reply[:200]))
        # a request line with no target at all: libmicrohttpd 0.9.75 hangs up without a status line
        for data in (b"garbage\r\n\r\n", b"GET\r\n\r\n"):
            reply, took = raw_exchange(self.addr, data)
            self.assertIn(status_of(reply), (None, 400), reply[:200])
            self.assertLess(took, 15)
        reply, _ = raw_exchange(self.addr, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        self.assertEqual(status_of(reply), 200)
        self.assert_still_training()

    def test_oversized_requests(self):
        big = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
        reply, _ = raw_exchange(self.addr, big)
        self.assertEqual(status_of(reply), 431, reply[:200])
        many = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(65)) + b"\r\n"
        reply, _ = raw_exchange(self.addr, many)
        self.assertEqual(status_of(reply), 431, reply[:200])
        reply, _ = raw_exchange(self.addr, b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        self.assertEqual(status_of(reply), 414, reply[:200])
        # a POST announcing a huge body is answered (401 here) without reading it
        reply, _ = raw_exchange(self.addr, b"POST /stop HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000\r\n\r\nxx")
        self.assertEqual(status_of(reply), 401, reply[:200])
        self.assertEqual(request(self.addr, "/nowhere")[0], 404)
        self.assertEqual(request(self.addr, "/metrics", "DELETE")[0], 405)
        self.assert_still_training()

    def test_paths_match_only_as_sent(self):
        # the path is matched as the client sent it, before percent-decoding: another spelling of an
        # endpoint is another path
        for path in (b"/%68ealth", b"/health%00.json", b"/health%00", b"/%2Fhealth", b"/HEALTH", b"/health/",
                     b"//health", b"/health;x", b"/stop%00", b"/%73top"):
            reply, _ = raw_exchange(self.addr, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            self.assertEqual(status_of(reply), 404, (path, reply[:200]))
        reply, _ = raw_exchange(self.addr, b"POST /%73top HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                                + TOKEN.encode() + b"\r\n\r\n")
        self.assertEqual(status_of(reply), 404, reply[:200])
        # the query is decoded as usual
        for path in (b"/health", b"/health?", b"/health?x=1", b"/history?since=%31&limit=1"):
            reply, _ = raw_exchange(self.addr, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            self.assertEqual(status_of(reply), 200, (path, reply[:200]))
        self.assert_still_training()

    def test_control_characters_in_a_header_or_query_are_400(self):
        # values are taken with their lengths, not as C strings, and a control character (but a
        # header's tab) makes the request malformed, the token right or not
        for value in (f"Bearer {TOKEN}\x01garbage", f"Bearer {TOKEN}\x7f", f"Bearer {TOKEN}\x1b[0m",
                      f"Bearer \x0b{TOKEN}"):
            reply, _ = raw_exchange(self.addr, b"POST /checkpoint HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: "
                                    + value.encode() + b"\r\n\r\n")
            self.assertEqual(status_of(reply), 400, (value, reply[:200]))
        reply, _ = raw_exchange(self.addr, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Note: a\x01b\r\n\r\n")
        self.assertEqual(status_of(reply), 400, reply[:200])
        reply, _ = raw_exchange(self.addr, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Note: a\tb\r\n\r\n")
        self.assertEqual(status_of(reply), 200, reply[:200])
        for query in (b"since=5%00x", b"since=%00", b"from=1%0A", b"limit=2%01", b"x%00=1"):
            reply, _ = raw_exchange(self.addr, b"GET /history?" + query + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            self.assertEqual(status_of(reply), 400, (query, reply[:200]))
        self.assert_still_training()

    def test_a_slow_client_is_closed_after_the_timeout_and_others_are_served(self):
        host, port = self.addr.rsplit(":", 1)
        slow = socket.create_connection((host, int(port)), timeout=60)
        try:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            t0 = time.monotonic()
            for _ in range(20):  # others are served meanwhile
                self.assertEqual(request(self.addr, "/health")[0], 200)
            got = slow.recv(4096)  # the server hangs up on the idle connection
            took = time.monotonic() - t0
            self.assertEqual(got, b"")
            self.assertGreater(took, 3)
            self.assertLess(took, 20)
        except ConnectionResetError:
            took = time.monotonic() - t0
            self.assertLess(took, 20)
        finally:
            slow.close()
        # more idle connections than the limits allow: the extra ones are refused or closed, every
        # one is closed within the timeout, and the server answers again
        host, port = self.addr.rsplit(":", 1)
        idle = []
        for _ in range(40):
            try:
                idle.append(socket.create_connection((host, int(port)), timeout=30))
            except OSError:
                pass
        deadline = time.monotonic() + 25
        for s in idle:
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
            self.assertLess(time.monotonic(), deadline)
            s.close()
        self.assertEqual(request(self.addr, "/health")[0], 200)
        self.assert_still_training()


class Tricklers:
    """n connections to port from 127.0.0.2, .3, ... (Linux routes all of 127/8 to loopback), each
    sending a request's headers one byte every `period` s, well inside the server's idle timeout, so
    that it never finishes. One the server closes opens again: the slots stay under attack."""

    def __init__(self, port, n=100, period=0.5):
        self.port, self.n, self.period = port, n, period
        self.socks, self.opened, self.closed = {}, 0, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self, i):
        s = socket.socket()
        try:
            s.settimeout(1)
            s.bind((f"127.0.0.{2 + i}", 0))
            s.connect(("127.0.0.1", self.port))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            s.setblocking(False)
        except OSError:  # the server's backlog is full: next round
            s.close()
            return
        self.socks[i] = s
        self.opened += 1

    def _run(self):
        while not self.done.is_set():
            for i in range(self.n):
                if i not in self.socks and not self.done.is_set():
                    self._open(i)
            self.done.wait(self.period)
            for i, s in list(self.socks.items()):
                try:
                    s.send(b"a")
                    if s.recv(4096) != b"":  # an answer: the server gave up on the request
                        continue
                except BlockingIOError:  # nothing to read: still open
                    continue
                except OSError:
                    pass
                s.close()  # closed by the server
                del self.socks[i]
                self.closed += 1
        for s in self.socks.values():
            s.close()

    def stop(self):
        self.done.set()
        self.thread.join(timeout=60)


class SlowClients(unittest.TestCase):
    def trickle_then_stop(self, body):
        """A job with a token file; once step 1 is done, body(addr, trickle) runs, trickle(n) starting n
        Tricklers; then POST /stop. Returns (exit code, job, workdir); the caller cleans the workdir."""
        w, cfg = make_workdir(FOREVER, log_every=100)
        token = write_token(w)
        job = Job([cfg, "--set", f"monitor.token_file={token}"])
        started, rc = [], None
        try:
            addr = job.address()
            wait_for_step(self, addr, 1, job)

            def trickle(n):
                started.append(Tricklers(int(addr.rsplit(":", 1)[1]), n=n))
                return started[-1]

            body(addr, trickle)
            status, _, reply = request(addr, "/stop", "POST", token=TOKEN, timeout=10)
            self.assertEqual(status, 202, reply)
            rc = job.wait(timeout=120)
        finally:
            for t in started:
                t.stop()
            job.stop()
        return rc, job, w

    def test_100_trickling_connections_leave_health_and_stop_served(self):
        # each trickler holds a connection for ever: the server must close one of them for a newcomer,
        # rather than refuse the newcomer, so that probes and POST /stop still get through
        def body(addr, trickle):
            tricklers = trickle(100)
            deadline = time.monotonic() + 60
            while tricklers.opened < 100 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(2)  # a few bytes each: they hold every connection the server has
            for _ in range(5):
                status, _, reply = request(addr, "/health", timeout=10)
                self.assertEqual(status, 200, reply)
                self.assertEqual(json.loads(reply)["status"], "ok")
            self.assertGreater(tricklers.closed, 0)  # closed for newcomers, and they came back

        rc, job, w = self.trickle_then_stop(body)
        try:
            self.assertEqual(rc, 75, job.out + job.err)
            m = re.search(r"stopped by POST /stop at step (\d+) after saving a checkpoint", job.err)
            self.assertTrue(m, job.err)
            self.assertTrue(w.latest().endswith(f"step-{int(m.group(1)):08d}.h5"))
        finally:
            w.cleanup()

    def test_a_client_slow_to_send_its_request_outlives_those_stuck_in_their_headers(self):
        # a probe scheduled out between connect() and send() is the oldest connection that has sent
        # nothing: the ones to close are those that sent a request line and never finished it
        def body(addr, trickle):
            host, port = addr.rsplit(":", 1)
            slow = socket.create_connection((host, int(port)), timeout=10)
            t0 = time.monotonic()
            tricklers = trickle(40)
            while tricklers.closed < 8 and time.monotonic() < t0 + 3:  # 40 > 32: some closed, back again
                time.sleep(0.05)
            self.assertGreaterEqual(tricklers.closed, 8)
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            reply = b""
            while True:
                got = slow.recv(4096)
                if not got:
                    break
                reply += got
            slow.close()
            self.assertLess(time.monotonic() - t0, 5)  # inside the idle timeout
            self.assertEqual(status_of(reply), 200, reply[:200])

        rc, job, w = self.trickle_then_stop(body)
        w.cleanup()
        self.assertEqual(rc, 75, job.out + job.err)


class Load(unittest.TestCase):
    def test_four_clients_2000_requests_during_training_all_valid(self):
        steps = steps_for(20)  # the load slows training: it outlasts the 10 s of requests
        w, cfg = make_workdir(steps, log_every=10)
        job = Job([cfg])
        errors_seen, counts = [], {}
        lock = threading.Lock()

        def check(path, status, body):
            if status != 200:
                return f"{path}: {status} {body[:200]}"
            if path == "/metrics":
                smp, _ = samples(body)
                return None if smp["ddp_train_world_size"][0][1] == 2 else "world size"
            doc = json.loads(body)
            if path == "/health":
                return None if doc["status"] == "ok" else body
            if path == "/status":
                return None if doc["world_size"] == 2 and len(doc["ranks"]) == 2 else body
            return None if isinstance(doc, list) else body

        def client(k, n, period):
            paths = ["/health", "/metrics", "/status", "/history?since=%d"]  # since: 20 steps back
            t0 = time.monotonic()
            for i in range(n):
                path = paths[(i + k) % 4]
                if "%d" in path:
                    path = path % max(0, step_seen[0] - 20)
                try:
                    status, _, body = request(addr, path)
                    why = check(path.split("?")[0], status, body)
                    if path == "/health" and not why:
                        step_seen[0] = max(step_seen[0], json.loads(body)["step"])
                except Exception as e:  # noqa: BLE001 - every failure is a finding
                    why = f"{path}: {e!r}"
                with lock:
                    counts[k] = counts.get(k, 0) + 1
                    if why:
                        errors_seen.append(why)
                pause = t0 + (i + 1) * period - time.monotonic()
                if pause > 0:
                    time.sleep(pause)

        try:
            addr = job.address()
            step_seen = [wait_for_step(self, addr, 1, job)["step"]]
            t0 = time.monotonic()
            clients = [threading.Thread(target=client, args=(k, 500, 10.0 / 500)) for k in range(4)]
            for t in clients:
                t.start()
            for t in clients:
                t.join(timeout=600)
            took = time.monotonic() - t0
            self.assertTrue(job.running(), "training ended before the load did: steps_for() is off")
            rc = job.wait()
        finally:
            job.stop()
        try:
            self.assertEqual(sum(counts.values()), 2000)
            self.assertEqual(errors_seen, [])
            self.assertEqual(rc, 0, job.out + job.err)
            self.assertEqual(max(r["step"] for r in w.metrics()), steps)
            print(f"# load: 2000 requests in {took:.1f} s during {steps} training steps", flush=True)
        finally:
            w.cleanup()


GPU_ENV, GPU_VISIBLE, _ = gpu_setup(2)


@unittest.skipUnless(GPU_VISIBLE >= 2, "needs 2 GPUs (or the stand-in)")
class GpuSeries(unittest.TestCase):
    def test_nvml_series_per_rank_equal_metrics_jsonl(self):
        w, cfg = make_workdir(FOREVER, log_every=5)
        token = write_token(w)
        job = Job([cfg, "--device", "cuda", "--set", f"monitor.token_file={token}"], env=GPU_ENV, binary=GPU_BINARY)
        try:
            addr = job.address()
            deadline = time.monotonic() + 180
            smp = {}
            while "ddp_train_gpu_memory_used_bytes" not in smp and time.monotonic() < deadline:
                time.sleep(0.2)
                smp, _ = samples(request(addr, "/metrics")[2])
            self.assertIn("ddp_train_gpu_memory_used_bytes", smp)
            step = int(value(smp, "ddp_train_metrics_step"))
            rec = [r for r in w.metrics() if r["step"] == step and "loss" in r][-1]
            want = {g["rank"]: g for g in rec["gpu"]}
            for name, key, scale in (("memory_used_bytes", "mem_used_mib", 1 / 1048576),
                                     ("memory_peak_bytes", "mem_peak_mib", 1 / 1048576),
                                     ("utilization_ratio", "util_pct", 100), ("power_watts", "power_w", 1),
                                     ("temperature_celsius", "temp_c", 1)):
                got = smp[f"ddp_train_gpu_{name}"]
                self.assertEqual(sorted(int(l["rank"]) for l, _ in got), [0, 1], name)
                for labels, v in got:
                    self.assertEqual(labels["gpu"], labels["rank"])  # rank i uses GPU i of its node
                    self.assertTrue(labels["host"])
                    self.assertAlmostEqual(v * scale, want[int(labels["rank"])][key], delta=0.5, msg=name)
            st = json.loads(request(addr, "/status")[2])
            self.assertTrue(all(r["device"].startswith(f"GPU {r['rank']}: ") for r in st["ranks"]), st["ranks"])
            self.assertEqual(request(addr, "/stop", "POST", token=TOKEN)[0], 202)
            self.assertEqual(job.wait(), 75, job.out + job.err)
        finally:
            job.stop()
            w.cleanup()


if __name__ == "__main__":
    unittest.main()
