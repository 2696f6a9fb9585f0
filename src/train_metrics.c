/* train_metrics.c: the step reports of a training run (train_metrics.h). */
#include "train_metrics.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp.h"
#include "gpu.h"

enum { max_logged_buckets = 1024 }; /* metrics.jsonl lists each bucket's timing up to this many */

/* Collective at log steps: every rank's mean compute time per step into all (W). Returns the
 * slowest rank and fills min/max/median; prints a straggler line when W > 1. */
static void straggler_line(dt_comm *comm, dt_log *lg, double compute_ms, double *all, double *min_ms, double *max_ms,
                           int *slow) {
  int W = comm->size;
  double *sorted = dt_malloc((size_t)W * sizeof(double));
  comm_allgather_f64(comm, compute_ms, all, "straggler report");
  int lo = 0, hi = 0;
  for (int r = 0; r < W; r++) {
    if (all[r] < all[lo]) lo = r;
    if (all[r] > all[hi]) hi = r;
    sorted[r] = all[r];
  }
  for (int i = 1; i < W; i++) /* insertion sort: W values once per log line */
    for (int j = i; j > 0 && sorted[j] < sorted[j - 1]; j--) {
      double t = sorted[j];
      sorted[j] = sorted[j - 1];
      sorted[j - 1] = t;
    }
  double median = W % 2 ? sorted[W / 2] : 0.5 * (sorted[W / 2 - 1] + sorted[W / 2]);
  *min_ms = all[lo];
  *max_ms = all[hi];
  *slow = median > 0 && all[hi] > 1.1 * median ? hi : -1;
  if (W > 1) {
    if (*slow >= 0)
      log_line(lg, "straggler: rank %d computes %.1f ms/step, %.0f%% over the median %.1f (fastest: rank %d, %.1f)", hi,
               all[hi], 100.0 * (all[hi] / median - 1.0), median, lo, all[lo]);
    else
      log_line(lg, "ranks: compute %.1f to %.1f ms/step (slowest rank %d, fastest rank %d)", all[lo], all[hi], hi, lo);
  }
  free(sorted);
}

/* Collective at log steps on GPU runs: every rank's NVML reading, gathered by rank 0 into all
 * (W x DT_MON_GPU_FIELDS, for the monitor) and written into the metrics line as
 * "gpu": [{rank, mem_used_mib, mem_peak_mib, util_pct, power_w, temp_c}, ...]. */
static void gpu_metrics(dt_comm *comm, int gpu, double *peak, double *all, char *json, size_t cap) {
  dt_gpu_reading r;
  gpu_read(gpu, peak, &r);
  const double mine[DT_MON_GPU_FIELDS] = {[DT_MON_GPU_VALID] = r.valid,
                                          [DT_MON_GPU_INDEX] = gpu,
                                          [DT_MON_GPU_MEM_USED] = r.mem_used_mib,
                                          [DT_MON_GPU_MEM_PEAK] = r.mem_peak_mib,
                                          [DT_MON_GPU_UTIL] = r.util_pct,
                                          [DT_MON_GPU_POWER] = r.power_w,
                                          [DT_MON_GPU_TEMP] = r.temp_c};
  comm_gather_f64(comm, mine, DT_MON_GPU_FIELDS, all);
  json[0] = 0;
  if (comm->rank == 0) {
    size_t len = (size_t)snprintf(json, cap, ", \"gpu\": [");
    int any = 0;
    for (int k = 0; k < comm->size && len < cap; k++) {
      const double *x = all + (size_t)k * DT_MON_GPU_FIELDS;
      if (!x[DT_MON_GPU_VALID]) continue;
      len += (size_t)snprintf(json + len, cap - len,
                              "%s{\"rank\": %d, \"mem_used_mib\": %.0f, \"mem_peak_mib\": %.0f, \"util_pct\": %.0f, "
                              "\"power_w\": %.0f, \"temp_c\": %.0f}",
                              any++ ? ", " : "", k, x[DT_MON_GPU_MEM_USED], x[DT_MON_GPU_MEM_PEAK], x[DT_MON_GPU_UTIL],
                              x[DT_MON_GPU_POWER], x[DT_MON_GPU_TEMP]);
    }
    if (len < cap) snprintf(json + len, cap - len, "]");
    if (!any) json[0] = 0;
  }
}

void metrics_init(dt_step_window *w, const dt_metrics_src *src) {
  memset(w, 0, sizeof *w);
  w->src = *src;
  const size_t nb = (size_t)src->ddp->n_buckets + 1;
  w->ready_s = dt_calloc(nb, sizeof(double));
  w->ready_mpi_s = dt_calloc(nb, sizeof(double));
  if (src->ddp->n_buckets <= max_logged_buckets) { /* more: "buckets" is null */
    w->bucket_json_cap = nb * 96 + 32;
    w->bucket_json = dt_malloc(w->bucket_json_cap);
  }
  w->rank_compute_ms = dt_calloc((size_t)src->comm->size, sizeof(double));
  if (src->gpu >= 0 && src->comm->rank == 0)
    w->gpu_all = dt_calloc((size_t)src->comm->size * DT_MON_GPU_FIELDS, sizeof(double));
  w->t_start = w->t_window = dt_now();
}

void metrics_free(dt_step_window *w) {
  free(w->ready_s);
  free(w->ready_mpi_s);
  free(w->bucket_json);
  free(w->rank_compute_ms);
  free(w->gpu_all);
  memset(w, 0, sizeof *w);
}

/* The window's step timing as metrics.jsonl members, means per step over its steps of span
 * seconds: the input of scripts/scaling.py. Host clock, so only where the backend works as it is
 * called (CPU). Writes the scalars into json (cap bytes); returns the "buckets" member (in
 * w->bucket_json, or a constant). */
static const char *timing_json_text(dt_step_window *w, double span, char *json, size_t cap) {
  const dt_ddp *g = w->src.ddp;
  const double n = (double)w->steps;
  const char *buckets = ", \"buckets\": null";
  if (w->bucket_json) { /* buckets[0] is the end of the gradient buffer: ready first */
    size_t len = (size_t)snprintf(w->bucket_json, w->bucket_json_cap, ", \"buckets\": [");
    for (int i = 0; i < g->n_buckets && len < w->bucket_json_cap; i++)
      len += (size_t)snprintf(w->bucket_json + len, w->bucket_json_cap - len,
                              "%s{\"bytes\": %lld, \"ready_s\": %.6e, \"mpi_s\": %.6e}", i ? ", " : "",
                              (long long)((g->buckets[i].end - g->buckets[i].begin) * (int64_t)sizeof(float)),
                              w->ready_s[i] / n, w->ready_mpi_s[i] / n);
    if (len < w->bucket_json_cap) snprintf(w->bucket_json + len, w->bucket_json_cap - len, "]");
    buckets = w->bucket_json;
  }
  snprintf(json, cap,
           ", \"threads\": %d, \"grad_accum\": %lld, \"rank_batch\": %.2f, \"flops_per_sample\": %lld, "
           "\"step_s\": %.6e, \"data_s\": %.6e, \"forward_s\": %.6e, \"backward_s\": %.6e, \"backward_mpi_s\": %.6e, "
           "\"comm_wait_s\": %.6e, \"update_s\": %.6e, \"agree_s\": %.6e",
           w->src.be->threads, (long long)w->src.accum, (double)w->samples / n / (double)w->src.comm->size,
           (long long)model_flops(w->src.m), span / n, w->data_s / n, w->forward_s / n, w->backward_s / n,
           w->backward_mpi_s / n, w->comm_s / n, w->update_s / n, w->agree_s / n);
  return buckets;
}

/* Whatever the backend chose since the last step, a log line each (rank 0's, as its log has them). */
static void log_backend_notes(dt_step_window *w) {
  dt_backend *be = w->src.be;
  char *notes = be->take_notes ? be->take_notes(be) : NULL;
  for (char *line = notes, *end; line && *line; line = end + 1) {
    end = strchr(line, '\n');
    if (end) *end = 0;
    log_line(w->src.log, "%s", line);
    if (!end) break;
  }
  free(notes);
}

/* The log step's reports (collectives), then a new window. */
static void report(dt_step_window *w, int64_t step, int64_t total, int64_t epoch, double lr, double now) {
  dt_comm *comm = w->src.comm;
  const int64_t tokens = w->src.m->tokens;
  double span = now - w->t_window, ms = 1e3 * span / (double)w->steps;
  double data_ms = 1e3 * w->data_s / (double)w->steps, comm_ms = 1e3 * w->comm_s / (double)w->steps;
  double sps = span > 0 ? (double)w->samples / span : 0, mean_loss = w->loss / (double)w->steps;
  double min_ms, max_ms;
  int slow;
  straggler_line(comm, w->src.log, ms - data_ms - comm_ms, w->rank_compute_ms, &min_ms, &max_ms, &slow);
  char gpu_json[8192] = "";
  if (tokens) /* a token model's throughput in tokens too */
    snprintf(gpu_json, sizeof gpu_json, ", \"tokens_per_s\": %.1f", sps * (double)tokens);
  if (w->src.gpu >= 0) {
    size_t used = strlen(gpu_json);
    gpu_metrics(comm, w->src.gpu, &w->gpu_peak_mib, w->gpu_all, gpu_json + used, sizeof gpu_json - used);
  }
  dt_monitor_snapshot *sn = &w->snap;
  sn->log_step = step;
  sn->loss = mean_loss;
  sn->lr = lr;
  sn->samples_per_s = sps;
  sn->tokens_per_s = tokens ? sps * (double)tokens : 0;
  sn->step_ms = ms;
  sn->compute_ms = ms - data_ms - comm_ms;
  sn->data_ms = data_ms;
  sn->comm_ms = comm_ms;
  sn->straggler_rank = slow;
  sn->rank_compute_ms = w->rank_compute_ms;
  sn->gpu = w->gpu_all;
  log_line(w->src.log,
           "step %lld/%lld epoch %lld loss %.4f lr %.5f | %.0f samples/s | %.1f ms/step (compute %.1f, data %.1f, "
           "comm %.1f)",
           (long long)step, (long long)total, (long long)epoch + 1, mean_loss, lr, sps, ms, ms - data_ms - comm_ms,
           data_ms, comm_ms);
  char timing_json[512] = "";
  const char *buckets = w->src.be->host_memory ? timing_json_text(w, span, timing_json, sizeof timing_json) : "";
  log_metrics(w->src.log,
              "\"step\": %lld, \"epoch\": %lld, \"loss\": %.9g, \"lr\": %.9g, \"samples_per_s\": %.1f, "
              "\"step_ms\": %.3f, \"compute_ms\": %.3f, \"data_ms\": %.3f, \"comm_ms\": %.3f, "
              "\"compute_ms_min\": %.3f, \"compute_ms_max\": %.3f, \"straggler_rank\": %d, \"world_size\": %d, "
              "\"local_size\": %d%s%s%s",
              (long long)step, (long long)epoch + 1, mean_loss, lr, sps, ms, ms - data_ms - comm_ms, data_ms, comm_ms,
              min_ms, max_ms, slow, comm->size, comm->local_size, timing_json, buckets, gpu_json);
  const int nb = w->src.ddp->n_buckets;
  w->t_window = now;
  w->loss = w->data_s = w->comm_s = 0;
  w->forward_s = w->backward_s = w->update_s = w->agree_s = w->backward_mpi_s = 0;
  memset(w->ready_s, 0, (size_t)nb * sizeof(double));
  memset(w->ready_mpi_s, 0, (size_t)nb * sizeof(double));
  w->samples = w->steps = 0;
}

void metrics_step(dt_step_window *w, int64_t step, int64_t total, int64_t epoch, double lr, double loss, double count,
                  double data_s, int64_t log_every) {
  const dt_ddp *g = w->src.ddp;
  w->loss += loss;
  w->steps++;
  w->samples += (int64_t)count;
  w->run_samples += (int64_t)count;
  w->data_s += data_s;
  w->comm_s += g->wait_s;
  for (int i = 0; i < g->n_buckets; i++) {
    w->ready_s[i] += g->ready_s[i];
    w->ready_mpi_s[i] += g->ready_mpi_s[i];
  }
  double now = dt_now();
  log_progress(w->src.log, step, total, now - w->t_start, loss);
  log_backend_notes(w);
  if (step % log_every == 0 || step == total) report(w, step, total, epoch, lr, now);
}

void metrics_memory(dt_step_window *w, const dt_memory_watch *mem, size_t estimate, int64_t step) {
  if (!mem) return;
  dt_comm *comm = w->src.comm;
  const double mib = 1048576.0, mine = (double)memory_watch_peak(mem, w->src.be) / mib;
  double *all = dt_malloc((size_t)comm->size * sizeof(double));
  comm_allgather_f64(comm, mine, all, "memory report");
  int top = 0;
  for (int r = 1; r < comm->size; r++)
    if (all[r] > all[top]) top = r;
  const double est = (double)estimate / mib, peak = all[top];
  const char *kind = memory_watch_kind(w->src.be);
  log_line(w->src.log, "memory: at most %.1f MiB per rank (%s, rank %d); --dry-run estimates %.1f MiB (%+.1f%%)", peak,
           kind, top, est, peak > 0 ? 100.0 * (est / peak - 1.0) : 0.0);
  log_metrics(w->src.log,
              "\"step\": %lld, \"mem_peak_mib\": %.3f, \"mem_peak_rank\": %d, \"mem_estimate_mib\": %.3f, "
              "\"mem_measured\": \"%s\"",
              (long long)step, peak, top, est, kind);
  free(all);
}
