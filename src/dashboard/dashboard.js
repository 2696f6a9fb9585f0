/* dashboard.js: the page on GET / (live: polls /status and /history at most once a second) and
 * report.html (static: the same page with the run's data inlined in #run-data). Every string from
 * the run (paths, names, hosts) reaches the page through textContent, never as markup. */
"use strict";

(function () {
  const POLL_MS = 1000;
  const MAX_DRAWN = 1000; /* points a line draws; a longer series draws every k-th and its last */
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

  /* ---- small helpers ---- */
  function $(id) { return document.getElementById(id); }
  /* Sets an element's text only when it changes: an unchanged page is not laid out again. */
  function text(id, s) {
    const e = $(id);
    if (e.textContent !== s) e.textContent = s;
  }
  function num(v, digits) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
    return v.toFixed(digits === undefined ? (a >= 100 ? 0 : a >= 1 ? 2 : 4) : digits);
  }
  function duration(s) {
    if (s === null || s === undefined || !isFinite(s) || s < 0) return "–";
    s = Math.round(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    return h ? h + " h " + m + " min" : m ? m + " min " + sec + " s" : sec + " s";
  }
  function bytes(b) {
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return (i ? b.toFixed(1) : b) + " " + u[i];
  }
  function cell(row, s, cls) {
    const td = document.createElement("td");
    td.textContent = s;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }

  /* ---- charts: Chart.js line charts of {x: step, y} points ---- */
  function lineChart(id, series, opts) {
    const holder = $(id);
    const datasets = series.map(function (s, i) {
      return {label: s.label, data: [], borderColor: s.color || COLORS[i], backgroundColor: s.fill || s.color || COLORS[i],
              borderWidth: 1.5, pointRadius: 0, fill: !!s.fill, yAxisID: s.axis || "y", stack: s.stack};
    });
    const scales = {x: {type: "linear", title: {display: true, text: "step"}},
                    y: {type: opts && opts.log ? "logarithmic" : "linear", stacked: !!(opts && opts.stacked),
                        beginAtZero: !!(opts && opts.zero)}};
    if (series.some(function (s) { return s.axis === "y2"; }))
      scales.y2 = {type: "linear", position: "right", grid: {drawOnChartArea: false}};
    const chart = new Chart(holder.querySelector("canvas"), {
      type: "line",
      data: {datasets: datasets},
      options: {animation: false, responsive: true, maintainAspectRatio: false, parsing: false, normalized: true,
                interaction: {mode: "nearest", axis: "x", intersect: false}, scales: scales,
                plugins: {legend: {display: series.length > 1}}}
    });
    /* series: every point received, per dataset; the chart draws a thinned copy (redraw) */
    return {chart: chart, holder: holder, keys: series.map(function (s) { return s.key; }),
            series: series.map(function () { return []; })};
  }

  /* Adds a record's values to the chart's series; a step at or before a series' last point (a
   * resume goes back to its checkpoint's step) first drops the points from that step on. */
  function addRecord(c, r) {
    c.keys.forEach(function (key, i) {
      const v = typeof key === "function" ? key(r) : r[key];
      if (v === undefined || v === null || !isFinite(v)) return;
      const data = c.series[i];
      while (data.length && data[data.length - 1].x >= r.step) data.pop();
      data.push({x: r.step, y: v});
    });
  }

  /* Every k-th point and the last, at most about MAX_DRAWN: series of one chart with as many points
   * keep the same steps, so stacked ones stay aligned. */
  function thin(points) {
    if (points.length <= MAX_DRAWN) return points.slice();
    const k = Math.ceil(points.length / MAX_DRAWN), out = [];
    for (let i = 0; i < points.length; i += k) out.push(points[i]);
    if (out[out.length - 1] !== points[points.length - 1]) out.push(points[points.length - 1]);
    return out;
  }

  /* data-points: the points received; data-last-step: the last step the first line draws. */
  function redraw(c) {
    let n = 0;
    c.series.forEach(function (points, i) {
      n += points.length;
      c.chart.data.datasets[i].data = thin(points);
    });
    c.holder.setAttribute("data-points", String(n));
    const drawn = c.chart.data.datasets[0].data;
    c.holder.setAttribute("data-last-step", drawn.length ? String(drawn[drawn.length - 1].x) : "");
    c.chart.update("none");
  }

  /* The records of a /history answer or of report.html, as objects: a line that is no JSON object (a
   * record cut by a crash, which a resume appended to) is left out, not the whole answer. */
  function parseRecords(lines) {
    const out = [];
    lines.forEach(function (line) {
      try {
        const r = typeof line === "string" ? JSON.parse(line) : line;
        if (r && typeof r === "object" && !Array.isArray(r)) out.push(r);
      } catch (e) { /* left out */ }
    });
    return out;
  }

  /* A /history answer: a JSON array with one record a line; parsed line by line when it is not
   * valid JSON as a whole. */
  function historyRecords(text) {
    try {
      return parseRecords(JSON.parse(text));
    } catch (e) {
      return parseRecords(text.split("\n").map(function (l) { return l.replace(/,\s*$/, ""); })
                              .filter(function (l) { return l.charAt(0) === "{"; }));
    }
  }

  /* ---- the page ---- */
  function Dashboard(report) {
    this.report = report;
    this.nextFrom = 0;
    this.token = "";
    this.tokens = false; /* a token model: tokens/s */
    this.charts = {
      loss: lineChart("chart-loss", [{label: "loss", key: "loss"}]),
      val: lineChart("chart-val", [
        {label: "val_loss", key: "val_loss"},
        {label: "ema_val_loss", key: "ema_val_loss", color: "#93c5fd"},
        {label: "val_acc", key: "val_acc", axis: "y2", color: COLORS[2]},
        {label: "ema_val_acc", key: "ema_val_acc", axis: "y2", color: "#86efac"}]),
      lr: lineChart("chart-lr", [{label: "lr", key: "lr"}], {zero: true}),
      throughput: lineChart("chart-throughput", [{label: "throughput", key: function (r) {
        return r.tokens_per_s !== undefined ? r.tokens_per_s : r.samples_per_s;
      }}], {zero: true}),
      time: lineChart("chart-time", [
        {label: "compute", key: "compute_ms", fill: "rgba(37,99,235,0.5)", color: COLORS[0], stack: "t"},
        {label: "data", key: "data_ms", fill: "rgba(234,88,12,0.5)", color: COLORS[4], stack: "t"},
        {label: "communication", key: "comm_ms", fill: "rgba(147,51,234,0.5)", color: COLORS[3], stack: "t"}],
        {stacked: true, zero: true})
    };
    const ranksHolder = $("chart-ranks");
    this.ranks = {holder: ranksHolder, chart: new Chart(ranksHolder.querySelector("canvas"), {
      type: "bar",
      data: {labels: [], datasets: [{label: "compute ms", data: [], backgroundColor: []}]},
      options: {animation: false, responsive: true, maintainAspectRatio: false, plugins: {legend: {display: false}},
                scales: {y: {beginAtZero: true}}}
    })};
  }

  Dashboard.prototype.addRecords = function (records) {
    const self = this;
    if (!records.length) return;
    records.forEach(function (r) {
      if (typeof r.step !== "number") return;
      if (r.tokens_per_s !== undefined) self.tokens = true;
      Object.keys(self.charts).forEach(function (k) { addRecord(self.charts[k], r); });
    });
    text("throughput-caption", this.tokens ? "tokens/s" : "samples/s");
    Object.keys(this.charts).forEach(function (k) { redraw(self.charts[k]); });
  };

  Dashboard.prototype.showState = function (state) {
    text("state", state);
    const cls = "state " + state.replace(/ /g, "-");
    if ($("state").className !== cls) $("state").className = cls;
  };

  Dashboard.prototype.showStatus = function (s) {
    this.showState(s.state);
    text("config", s.config + "  ·  hash " + s.config_hash + "  ·  ddp_train " + s.version);
    text("world", String(s.world_size) + (s.world_size === 1 ? " rank" : " ranks"));
    const p = s.progress;
    if (p) {
      text("step", p.step + " / " + p.total_steps);
      if ($("progress").value !== p.fraction) $("progress").value = p.fraction;
      text("epoch", p.epoch + " / " + p.epochs);
      text("eta", s.state === "training" || s.state === "stalled" ? duration(s.eta_s) : "–");
    }
    const l = s.last_log;
    if (l) text("throughput", l.tokens_per_s !== undefined ? num(l.tokens_per_s, 0) + " tokens/s"
                                                            : num(l.samples_per_s, 0) + " samples/s");
    const c = s.last_checkpoint;
    text("checkpoint", c ? "step " + c.step + ", " + duration(c.age_s) + " ago" : "none yet");
    this.showRanks(s);
    this.showRun(s);
    text("model", s.model_summary || "");
  };

  /* The rank table and bars, redrawn when their values change (a log step). */
  Dashboard.prototype.showRanks = function (s) {
    const straggler = s.last_log ? s.last_log.straggler_rank : -1;
    const key = JSON.stringify([s.ranks, straggler]);
    if (key === this.ranksKey) return;
    this.ranksKey = key;
    const body = $("ranks").querySelector("tbody");
    const rows = [];
    const labels = [], values = [], colors = [];
    s.ranks.forEach(function (r) {
      const tr = document.createElement("tr");
      if (r.rank === straggler) tr.className = "straggler";
      cell(tr, String(r.rank) + (r.rank === straggler ? " (straggler)" : ""));
      cell(tr, r.host);
      cell(tr, r.device);
      cell(tr, r.compute_ms === null || r.compute_ms === undefined ? "–" : num(r.compute_ms, 2), "num");
      const g = r.gpu;
      cell(tr, g ? num(g.util_pct, 0) : "–", "num");
      cell(tr, g ? num(g.mem_used_mib, 0) + " (" + num(g.mem_peak_mib, 0) + ")" : "–", "num");
      cell(tr, g ? num(g.power_w, 0) : "–", "num");
      cell(tr, g ? num(g.temp_c, 0) : "–", "num");
      rows.push(tr);
      labels.push("rank " + r.rank);
      values.push(r.compute_ms === undefined ? null : r.compute_ms);
      colors.push(r.rank === straggler ? "#dc2626" : "#2563eb");
    });
    body.replaceChildren.apply(body, rows);
    const ch = this.ranks.chart;
    ch.data.labels = labels;
    ch.data.datasets[0].data = values;
    ch.data.datasets[0].backgroundColor = colors;
    ch.update("none");
    this.ranks.holder.setAttribute("data-points", String(values.filter(function (v) { return v !== null; }).length));
  };

  Dashboard.prototype.showRun = function (s) {
    const rows = [["config", s.config], ["config hash", s.config_hash], ["world size", String(s.world_size)],
                  ["global batch", String(s.global_batch) + " (" + s.batch.rank_rows + " rows per rank x " +
                   s.batch.grad_accum + " micro-batches)"],
                  ["optimizer", s.optimizer.name + (s.optimizer.zero ? ", dist.zero " + s.optimizer.zero : "") +
                   ", state " + bytes(s.optimizer.state_bytes_per_rank) + " per rank"]];
    if (s.batch.auto) rows.push(["batch_size auto", s.batch.auto]);
    if (s.distill) rows.push(["distillation", "teacher " + s.distill.teacher + ", weights " + s.distill.weights +
                              ", " + s.distill.loss + ", T " + s.distill.temperature + ", alpha " + s.distill.alpha]);
    if (s.data) rows.push(["data.path", s.data]);
    if (s.log_dir) rows.push(["log.dir", s.log_dir]);
    if (this.report && s.train_s !== undefined) rows.push(["training time", duration(s.train_s)]);
    if (s.last_eval) rows.push(["last evaluation", "step " + s.last_eval.step + ": val_loss " + num(s.last_eval.val_loss) +
                                (s.last_eval.val_acc !== undefined ? ", val_acc " + num(s.last_eval.val_acc) : "")]);
    if (!this.report) rows.push(["served from", s.monitor.listen + " (POST: " + s.monitor.post + ")"]);
    const key = JSON.stringify(rows);
    if (key === this.runKey) return;
    this.runKey = key;
    const trs = rows.map(function (r) {
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      th.textContent = r[0];
      tr.appendChild(th);
      cell(tr, r[1]);
      return tr;
    });
    const body = $("run").querySelector("tbody");
    body.replaceChildren.apply(body, trs);
  };

  Dashboard.prototype.headers = function () {
    this.token = $("token").value;
    return this.token ? {"Authorization": "Bearer " + this.token} : {};
  };

  Dashboard.prototype.say = function (msg, error) {
    const m = $("message");
    m.textContent = msg;
    m.className = error ? "error" : "ok";
  };

  /* One round: /status, then the records since the last round (pages of /history until none is left). */
  Dashboard.prototype.poll = async function () {
    const h = this.headers();
    const r = await fetch("status", {headers: h, cache: "no-store"});
    if (r.status === 401) {
      this.showState("needs the token");
      this.say("reading needs the token here (not loopback): enter it above", true);
      return;
    }
    if (!r.ok) throw new Error("/status answered " + r.status);
    const s = await r.json();
    const step = s.progress ? s.progress.step : 0;
    if (this.nextFrom && (s.config_hash !== this.hash || step < this.step)) this.restart();
    this.hash = s.config_hash;
    this.step = step;
    this.showStatus(s);
    for (let page = 0; page < 20; page++) {
      const hr = await fetch("history?from=" + this.nextFrom, {headers: h, cache: "no-store"});
      if (hr.status === 404) return; /* no log.dir: no history */
      if (!hr.ok) throw new Error("/history answered " + hr.status);
      const text = await hr.text();
      const next = hr.headers.get("X-Next-From");
      /* "[", a record a line, "]": the lines sent, good or not */
      this.nextFrom = next !== null ? Number(next) : this.nextFrom + Math.max(0, text.split("\n").length - 3);
      this.addRecords(historyRecords(text));
      if (next === null) return;
    }
  };

  /* Another run on this address (another config, or a step before the last one seen: a new
   * metrics.jsonl, or a resume from an older checkpoint): its history is read again from the start. */
  Dashboard.prototype.restart = function () {
    const self = this;
    this.nextFrom = 0;
    Object.keys(this.charts).forEach(function (k) {
      self.charts[k].series.forEach(function (points) { points.length = 0; });
      redraw(self.charts[k]);
    });
  };

  /* Polls at most once a second, and not at all while the tab is hidden. */
  Dashboard.prototype.loop = async function () {
    const self = this;
    if (document.hidden) {
      document.addEventListener("visibilitychange", function () { self.loop(); }, {once: true});
      return;
    }
    const t0 = performance.now();
    try {
      await this.poll();
    } catch (e) {
      this.showState("disconnected");
      text("eta", "–");
    }
    const wait = Math.max(0, POLL_MS - (performance.now() - t0));
    setTimeout(function () { self.loop(); }, wait);
  };

  Dashboard.prototype.post = async function (what) {
    const h = this.headers();
    if (!this.token) {
      this.say("enter the token of monitor.token_file first", true);
      return;
    }
    let r;
    try {
      r = await fetch(what, {method: "POST", headers: h, cache: "no-store"});
    } catch (e) {
      this.say("the run did not answer: " + e.message, true);
      return;
    }
    let body = {};
    try { body = await r.json(); } catch (e) { /* keep {} */ }
    if (r.status === 202)
      this.say(what === "stop" ? "stop accepted: the run saves a checkpoint and exits 75 at the next step"
                               : "checkpoint accepted: written at the next step", false);
    else
      this.say((r.status === 401 ? "wrong token" : "refused") + " (" + r.status + "): " + (body.error || ""), true);
  };

  function main() {
    const inlined = $("run-data");
    const d = new Dashboard(!!inlined);
    if (inlined) { /* report.html: the finished run */
      const data = JSON.parse(inlined.textContent);
      $("controls").hidden = true;
      d.showStatus(data.status);
      d.addRecords(parseRecords(data.records));
      return;
    }
    $("checkpoint-now").addEventListener("click", function () { d.post("checkpoint"); });
    $("stop").addEventListener("click", function () { d.post("stop"); });
    d.loop();
  }

  document.addEventListener("DOMContentLoaded", main);
})();
