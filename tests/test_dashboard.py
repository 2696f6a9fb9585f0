"""The dashboard (GET / on monitor.listen) and report.html in a real browser: Debian's chromium,
headless, driven by selenium through chromedriver, against real 2-rank training runs.

- Live: the page loads with no console error and no request to another host; the step counter
  moves and the loss chart gains points; the rank table has 2 rows; a wrong token on "Stop" shows
  an error and training goes on; "Checkpoint now" and "Stop" with the right token end the run
  with exit 75 and a checkpoint. A screenshot goes to build/dashboard.png.
- report.html of that run opens from the file, with no server and no network, and shows the same
  charts and the state "stopped"; a run that finishes writes one with "finished".
- Off loopback the page asks for the token before it shows anything.
- On the GPU stand-in, each rank's NVML reading (utilisation, memory, power, temperature) in the rank
  table, live and in report.html equal to the last metrics.jsonl record's.
- Names and paths holding <script>, tags and quotes (the config's directory, data.path, log.dir)
  show as text in both pages, and nothing of theirs runs.

Every wait polls with a deadline: the runs and the browser share two cores."""
import json
import os
import shutil
import tempfile
import time
import unittest
import urllib.parse

from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from helpers import GPU_BINARY, ROOT, Workdir, gpu_setup, run
from test_monitor import FOREVER, MONITOR_CNN, TOKEN, Job, request, write_token

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOT = os.path.join(ROOT, "build", "dashboard.png")
# what a name may hold to break out of text: each would set window.pwned or the title if it ran
HOSTILE = "x\"'<script>window.pwned=1</script><img src=x onerror=\"window.pwned=2\">"  # "/": directories


def browser(profile):
    o = Options()
    o.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1900",
              "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-default-apps", "--disable-extensions", f"--user-data-dir={profile}"):
        o.add_argument(a)
    o.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=o)
    d.set_page_load_timeout(60)
    return d


def series(records, key):
    """The steps of a chart's line of `key`: a record at or before the last step drops the points from
    its step on (a resume goes back to its checkpoint)."""
    steps = []
    for r in records:
        if key in r:
            while steps and steps[-1] >= r["step"]:
                steps.pop()
            steps.append(r["step"])
    return steps


def wait_until(test, what, fn, timeout=90, job=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        if job is not None:
            test.assertTrue(job.running(), f"the job ended while waiting for {what}:\n{job.out}{job.err}")
        time.sleep(0.1)
    test.fail(f"no {what} within {timeout} s")


class Page:
    """The browser's view of the dashboard."""

    def __init__(self, driver):
        self.d = driver

    def text(self, id_):
        return self.d.find_element(By.ID, id_).text

    def points(self, chart):
        return int(self.d.find_element(By.ID, chart).get_attribute("data-points") or 0)

    def rank_table(self):
        """The rank table's cells' text, row by row, read at once (the page replaces its rows when a
        log step changes them)."""
        return self.d.execute_script("return Array.from(document.querySelectorAll('#ranks tbody tr'))"
                                     ".map(tr => Array.from(tr.cells).map(td => td.textContent))")

    def step(self):
        s = self.text("step")
        return int(s.split("/")[0]) if "/" in s else -1

    def console_errors(self):
        return [e for e in self.d.get_log("browser") if e["level"] == "SEVERE"]

    def requested_urls(self):
        urls = []
        for e in self.d.get_log("performance"):
            m = json.loads(e["message"])["message"]
            if m["method"] == "Network.requestWillBeSent":
                urls.append(m["params"]["request"]["url"])
        return urls

    def nothing_ran(self, test):
        """No element came from a run's string, and nothing of theirs ran (the CSP alone would stop an
        onerror: both are checked)."""
        for where in ("#config", "#run", "#model", "#ranks"):
            test.assertEqual(self.d.find_elements(By.CSS_SELECTOR, f"{where} script, {where} img"), [], where)
        test.assertIsNone(self.d.execute_script("return window.pwned === undefined ? null : window.pwned"))
        test.assertEqual(self.d.title, "ddp_train")
        with test.assertRaises(NoAlertPresentException):
            self.d.switch_to.alert.text


class Base(unittest.TestCase):
    """A browser and a work directory per test."""

    @classmethod
    def setUpClass(cls):
        for tool in (CHROMIUM, CHROMEDRIVER):
            if not os.path.exists(tool):
                raise AssertionError(f"{tool} is missing: make deps installs chromium and chromium-driver")

    def setUp(self):
        self.w = Workdir()
        self.profile = tempfile.mkdtemp(prefix="ddp-chromium-")
        self.d = browser(self.profile)
        self.d.get("about:blank")
        self.page = Page(self.d)
        self.addCleanup(self.close)

    def close(self):
        self.d.quit()
        shutil.rmtree(self.profile, ignore_errors=True)
        self.w.cleanup()

    def hostile_workdir(self, steps):
        """A config in a directory whose name holds HOSTILE, with data.path, log.dir and checkpoint.dir
        there (quoted in the YAML as JSON strings)."""
        sub = os.path.join(self.w.path, HOSTILE)
        os.makedirs(sub)
        self.w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)
        os.rename(self.w.file("data.h5"), os.path.join(sub, "data.h5"))
        text = MONITOR_CNN.format(dir="@DIR@", steps=steps, log_every=2)
        for leaf in ("data.h5", "log", "ckpt"):
            text = text.replace(f"@DIR@/{leaf}", json.dumps(f"{sub}/{leaf}"))
        cfg = os.path.join(sub, "cfg.yaml")
        with open(cfg, "w") as f:
            f.write(text)
        return sub, cfg

    def assert_offline(self, urls, origin):
        """No request left for the network but to origin (the browser's own chrome:// pages, which
        its new tab may still be loading, are not the page's)."""
        network = ("http:", "https:", "ws:", "wss:", "ftp:", "file:")
        others = [u for u in urls if u.startswith(network) and not u.startswith(origin)]
        self.assertEqual(others, [], "requests to other places")

    def open(self, url):
        """Navigates to url, its logs starting empty (the browser's own new-tab page is not ours)."""
        self.d.get_log("performance")
        self.d.get_log("browser")
        self.url = url
        self.d.get(url)

    def open_live(self, job):
        origin = f"http://{job.address()}/"
        self.open(origin)
        return origin


class DashboardTest(Base):
    def test_live_page_then_stop_from_the_page_then_report(self):
        self.w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)
        cfg = self.w.config(MONITOR_CNN, steps=FOREVER, log_every=2)
        token = write_token(self.w)
        job = Job([cfg, "--set", f"monitor.token_file={token}", "--set", "checkpoint.every_steps=0"])
        try:
            origin = self.open_live(job)
            p = self.page
            first = wait_until(self, "a step on the page", lambda: p.step() > 0 and p.step(), job=job)
            wait_until(self, "the step counter moving", lambda: p.step() > first, job=job)
            wait_until(self, "loss points", lambda: p.points("chart-loss") >= 2, job=job)
            wait_until(self, "validation points", lambda: p.points("chart-val") >= 1, job=job)
            self.assertGreater(p.points("chart-time"), 0)
            self.assertGreater(p.points("chart-lr"), 0)
            self.assertGreater(p.points("chart-throughput"), 0)
            wait_until(self, "2 rank bars", lambda: p.points("chart-ranks") == 2, job=job)
            rows = p.rank_table()
            self.assertEqual(len(rows), 2)
            self.assertEqual([r[2] for r in rows], ["cpu", "cpu"])
            self.assertEqual(p.text("state"), "training")
            self.assertIn(os.path.basename(cfg), p.text("config"))
            self.assertEqual(p.text("world"), "2 ranks")
            self.assertIn("conv2d", p.text("model"))
            self.assertEqual(p.console_errors(), [])

            # a wrong token: an error on the page, and the run goes on
            self.d.find_element(By.ID, "token").send_keys("not-the-token")
            self.d.find_element(By.ID, "stop").click()
            wait_until(self, "the error", lambda: "wrong token" in p.text("message"), job=job)
            self.assertEqual(self.d.find_element(By.ID, "message").get_attribute("class"), "error")
            at = p.step()
            wait_until(self, "steps after the wrong token", lambda: p.step() > at + 2, job=job)
            self.assertTrue(job.running())

            # the right token: a checkpoint now, then stop
            self.d.find_element(By.ID, "token").clear()
            self.d.find_element(By.ID, "token").send_keys(TOKEN)
            self.d.find_element(By.ID, "checkpoint-now").click()
            wait_until(self, "the checkpoint", lambda: p.text("checkpoint").startswith("step "), job=job)
            self.assertIn("checkpoint accepted", p.text("message"))
            os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
            wait_until(self, "more loss points", lambda: p.points("chart-loss") >= 6, job=job)
            self.assertTrue(self.d.save_screenshot(SCREENSHOT))
            self.d.find_element(By.ID, "stop").click()
            self.assertEqual(job.wait(), 75, job.out + job.err)
            self.assertIn("stopped by POST /stop", job.err)
            wait_until(self, "the stop's answer", lambda: "stop accepted" in p.text("message"))
            self.assertIsNotNone(self.w.latest(), "no checkpoint")
            wait_until(self, "the page to see the run gone", lambda: p.text("state") == "disconnected")

            # since the checks above: the wrong token's 401, and the polls that failed once the run ended
            errors = [e["message"] for e in p.console_errors()]
            self.assertEqual(len([e for e in errors if "/stop" in e and "401" in e]), 1, errors)
            self.assertEqual([e for e in errors if not ("/stop" in e and "401" in e)
                              and "net::ERR_" not in e and "Failed to fetch" not in e], [])
            self.assert_offline(p.requested_urls(), origin)
        finally:
            job.stop()

        # report.html: the same page from the file, no server
        report = self.w.file("log/report.html")
        self.assertTrue(os.path.exists(report), "no report.html")
        self.open("file://" + urllib.parse.quote(report))
        p = self.page
        wait_until(self, "the report's state", lambda: p.text("state") == "stopped")
        records = [r for r in self.w.metrics() if "loss" in r]
        self.assertEqual(p.points("chart-loss"), len(records))
        self.assertEqual(p.points("chart-ranks"), 2)
        self.assertEqual(len(p.rank_table()), 2)
        self.assertFalse(self.d.find_element(By.ID, "controls").is_displayed())
        self.assertEqual(p.console_errors(), [])
        self.assert_offline(p.requested_urls(), self.url)

    def test_hostile_names_show_as_text_live_and_in_the_report(self):
        sub, cfg = self.hostile_workdir(steps=FOREVER)
        token = write_token(self.w)
        job = Job([cfg, "--set", f"monitor.token_file={token}"])
        shown = HOSTILE
        try:
            origin = self.open_live(job)
            addr = origin[len("http://"):-1]
            p = self.page
            wait_until(self, "loss points", lambda: p.points("chart-loss") >= 2, job=job)
            run_table = self.d.find_element(By.ID, "run").text
            self.assertIn(shown + "/data.h5", run_table)
            self.assertIn(shown + "/log", run_table)
            self.assertIn(shown, p.text("config"))
            p.nothing_ran(self)
            self.assertEqual(p.console_errors(), [])
            self.assert_offline(p.requested_urls(), origin)
            self.assertEqual(request(addr, "/stop", "POST", token=TOKEN)[0], 202)
            self.assertEqual(job.wait(), 75, job.out + job.err)
        finally:
            job.stop()
        report = os.path.join(sub, "log", "report.html")
        with open(report) as f:
            data = f.read().split('id="run-data">', 1)[1].split("</script>", 1)[0]
        self.assertFalse("<" in data, "report.html's data holds '<': a '</script>' in a name would end it")
        self.open("file://" + urllib.parse.quote(report))
        wait_until(self, "the report's state", lambda: self.page.text("state") == "stopped")
        self.assertIn(shown + "/data.h5", self.d.find_element(By.ID, "run").text)
        self.assertIn(shown, self.page.text("config"))
        self.page.nothing_ran(self)
        self.assertEqual(self.page.console_errors(), [])
        self.assert_offline(self.page.requested_urls(), self.url)

    def test_finished_run_without_monitor_writes_a_report(self):
        """20 steps, a record cut short as by a crash, a resume from step 10 to step 40 (which appends
        its first record to the cut one and logs steps 12 to 20 again): the report, from the file,
        shows one point a step, 2 to 40, the spoilt line left out."""
        self.w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)
        cfg = self.w.config(MONITOR_CNN, steps=20, log_every=2)
        sets = ["--set", "monitor.listen=", "--set", "checkpoint.every_steps=10"]
        rc, out, err = run([cfg] + sets, np_=2, timeout=300)
        self.assertEqual(rc, 0, out + err)
        self.assertNotIn("monitor:", out)
        with open(self.w.file("log/metrics.jsonl"), "a") as f:
            f.write('{"step": 21, "epoch": 2, "loss": 0.')
        rc, out, err = run([cfg, "--resume", self.w.file("ckpt/step-00000010.h5"), "--set", "train.max_steps=40"]
                           + sets, np_=2, timeout=300)
        self.assertEqual(rc, 0, out + err)
        report = self.w.file("log/report.html")
        self.open("file://" + urllib.parse.quote(report))
        p = self.page
        wait_until(self, "the report's state", lambda: p.text("state") == "finished")
        self.assertEqual(p.step(), 40)
        self.assertEqual(p.points("chart-loss"), 20)
        self.assertEqual(self.d.find_element(By.ID, "chart-loss").get_attribute("data-last-step"), "40")
        records = []
        with open(self.w.file("log/metrics.jsonl")) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    self.assertIn('{"step": 21, "epoch": 2, "loss": 0.{"step": 12', line)  # the spoilt one
        self.assertEqual(p.points("chart-val"), 2 * len(series(records, "val_loss")))
        self.assertEqual(p.points("chart-loss"), len(series(records, "loss")))
        self.assertEqual(p.text("eta"), "–")
        self.assertEqual(p.console_errors(), [])
        self.assert_offline(p.requested_urls(), self.url)

    def test_a_long_live_run_draws_its_last_record(self):
        """More records than a chart draws (log.every_steps 1, a step of 1-2 ms): the page keeps every
        one it received and draws up to the last of them."""
        self.w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)
        cfg = self.w.config(MONITOR_CNN, steps=FOREVER, log_every=1)
        token = write_token(self.w)
        job = Job([cfg, "--set", f"monitor.token_file={token}", "--set", "train.eval_every_steps=0"])
        try:
            addr = self.open_live(job)[len("http://"):-1]
            p = self.page
            wait_until(self, "2,500 loss points", lambda: p.points("chart-loss") >= 2500, timeout=180, job=job)
            self.assertEqual(request(addr, "/stop", "POST", token=TOKEN)[0], 202)
            self.assertEqual(job.wait(), 75, job.out + job.err)
        finally:
            job.stop()
        wait_until(self, "the page to see the run gone", lambda: p.text("state") == "disconnected")
        n = p.points("chart-loss")
        losses = [r for r in self.w.metrics() if "loss" in r]
        self.assertEqual(int(self.d.find_element(By.ID, "chart-loss").get_attribute("data-last-step")),
                         losses[n - 1]["step"])  # the first n records, the last of them drawn
        drawn = self.d.execute_script("return Chart.getChart(document.querySelector('#chart-loss canvas'))"
                                      ".data.datasets[0].data.length")
        self.assertLessEqual(drawn, 1001)
        self.assertGreater(drawn, 500)

    def test_off_loopback_the_page_asks_for_the_token(self):
        self.w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)
        cfg = self.w.config(MONITOR_CNN, steps=FOREVER, log_every=2)
        token = write_token(self.w)
        job = Job([cfg, "--set", "monitor.listen=0.0.0.0:0", "--set", f"monitor.token_file={token}"])
        try:
            addr = job.address()
            local = "127.0.0.1:" + addr.rsplit(":", 1)[1]
            self.assertEqual(request(local, "/")[0], 200)  # the page holds no run data
            self.assertEqual(request(local, "/status")[0], 401)
            self.open(f"http://{local}/")
            p = self.page
            wait_until(self, "the token prompt", lambda: p.text("state") == "needs the token", job=job)
            self.assertEqual(p.step(), -1)
            self.d.find_element(By.ID, "token").send_keys(TOKEN)
            wait_until(self, "steps after the token", lambda: p.step() > 0, job=job)
            self.assertEqual(p.text("state"), "training")
            self.assertEqual(request(local, "/stop", "POST", token=TOKEN)[0], 202)
            self.assertEqual(job.wait(), 75, job.out + job.err)
        finally:
            job.stop()

    def test_headers_and_the_host(self):
        self.w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)
        cfg = self.w.config(MONITOR_CNN, steps=FOREVER, log_every=50)
        token = write_token(self.w)
        job = Job([cfg, "--set", f"monitor.token_file={token}"])
        try:
            addr = job.address()
            for path, kind in (("/", "text/html"), ("/dashboard.js", "text/javascript"),
                               ("/dashboard.css", "text/css"), ("/chart.min.js", "text/javascript"),
                               ("/status", "application/json")):
                code, h, body = request(addr, path)
                self.assertEqual(code, 200, path)
                self.assertTrue(h["content-type"].startswith(kind), (path, h["content-type"]))
                csp = h["content-security-policy"]
                self.assertIn("default-src 'none'", csp)
                self.assertIn("script-src 'self';", csp)
                self.assertNotIn("unsafe-inline", csp)
                self.assertEqual(h["x-content-type-options"], "nosniff")
            _, _, chart = request(addr, "/chart.min.js")
            with open("/usr/share/javascript/chart.js/chart.min.js") as f:
                self.assertEqual(chart, f.read())  # Debian's Chart.js, as built in
            self.assertEqual(request(addr, "/index.html")[0], 404)
            self.assertEqual(request(addr, "/", "POST")[0], 405)
            # on loopback a read without the token must name a loopback host: a site whose name was
            # pointed at 127.0.0.1 (DNS rebinding) sends its own
            port = addr.rsplit(":", 1)[1]
            for host in ("127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"127.3.2.1:{port}",
                         f"[::1]:{port}"):
                self.assertEqual(request(addr, "/status", headers={"Host": host})[0], 200, host)
            for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}",
                         f"localhost.evil:{port}", f"10.0.0.1:{port}", f"[::2]:{port}", f"127.0.0.1:{port}x"):
                for path in ("/", "/status", "/history", "/metrics", "/health"):
                    code, _, body = request(addr, path, headers={"Host": host})
                    self.assertEqual(code, 403, (host, path))
                self.assertIn("Host header names no loopback address", body)
                self.assertEqual(request(addr, "/status", token=TOKEN, headers={"Host": host})[0], 200, host)
            self.assertEqual(request(addr, "/status", token="wrong", headers={"Host": "evil.example"})[0], 403)
        finally:
            job.stop()


GPU_ENV, GPU_VISIBLE, _ = gpu_setup(2)


@unittest.skipUnless(GPU_VISIBLE >= 2, "needs 2 GPUs (or the stand-in)")
class GpuReadings(Base):
    def gpu_cells(self):
        """Each rank row's GPU util, memory (peak), power and temperature cells."""
        return [r[4:8] for r in self.page.rank_table()]

    def test_nvml_readings_per_rank_live_and_in_the_report(self):
        self.w.dataset(n=512, n_val=64, shape=(3, 16, 16), classes=4)
        cfg = self.w.config(MONITOR_CNN, steps=FOREVER, log_every=5)
        token = write_token(self.w)
        job = Job([cfg, "--device", "cuda", "--set", f"monitor.token_file={token}"], env=GPU_ENV, binary=GPU_BINARY)
        try:
            addr = self.open_live(job)[len("http://"):-1]
            wait_until(self, "GPU readings in the rank table",
                       lambda: (lambda cells: len(cells) == 2 and all("–" not in c for row in cells for c in row))(
                           self.gpu_cells()),
                       timeout=180, job=job)
            devices = [r[2] for r in self.page.rank_table()]
            self.assertTrue(all(d.startswith(f"GPU {i}: ") for i, d in enumerate(devices)), devices)
            self.assertEqual(self.page.console_errors(), [])
            self.assertEqual(request(addr, "/stop", "POST", token=TOKEN)[0], 202)
            self.assertEqual(job.wait(), 75, job.out + job.err)
        finally:
            job.stop()
        last = [r for r in self.w.metrics() if "gpu" in r][-1]
        self.open("file://" + urllib.parse.quote(self.w.file("log/report.html")))
        wait_until(self, "the report's state", lambda: self.page.text("state") == "stopped")
        want = [[f"{g['util_pct']:.0f}", f"{g['mem_used_mib']:.0f} ({g['mem_peak_mib']:.0f})", f"{g['power_w']:.0f}",
                 f"{g['temp_c']:.0f}"] for g in sorted(last["gpu"], key=lambda g: g["rank"])]
        self.assertEqual(self.gpu_cells(), want)


if __name__ == "__main__":
    unittest.main()
