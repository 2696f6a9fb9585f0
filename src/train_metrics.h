/* train_metrics.h: what a training run says about its steps. Every step: the progress line and
 * whatever the backend chose (cuDNN plans). Every log.every_steps steps, over the window since the
 * last report: the console line and the metrics.jsonl record (loss, learning rate, throughput, the
 * step time split into compute, data and communication; on the CPU backend also the phases of a
 * step and each gradient bucket's readiness, the input of scripts/scaling.py), the straggler line
 * (every rank's compute time: a collective), on GPU runs every rank's NVML reading (a collective),
 * and the snapshot the status endpoint serves (monitor.h).
 * Owns: the window's sums and its text buffers. Borrows: the log, the communicator, the backend,
 * the model and the gradient buckets (dt_metrics_src). */
#ifndef DT_TRAIN_METRICS_H
#define DT_TRAIN_METRICS_H

#include "comm.h"
#include "log.h"
#include "memory.h"
#include "model.h"
#include "monitor.h"

typedef struct dt_ddp dt_ddp; /* ddp.h */

/* What the reports read of the run, borrowed. */
typedef struct {
  dt_log *log;
  dt_comm *comm;
  dt_backend *be;
  const dt_model *m;
  const dt_ddp *ddp;
  int gpu;       /* this rank's GPU for NVML; -1 on the CPU */
  int64_t accum; /* micro-batches per step */
} dt_metrics_src;

typedef struct {
  dt_metrics_src src;
  double t_start, t_window; /* the run's start, the window's (dt_now()) */
  int64_t steps, samples, run_samples;
  double loss, data_s, comm_s; /* sums over the window's steps */
  /* the step's phases (host clock: meaningful on the CPU backend, which runs work as it is queued):
   * forward and loss, backward, the update after the gradient wait, the step agreement, the MPI
   * calls inside the last backward; per bucket its readiness (ddp.h) */
  double forward_s, backward_s, update_s, agree_s, backward_mpi_s;
  double *ready_s, *ready_mpi_s; /* (n_buckets) */
  char *bucket_json;             /* (bucket_json_cap) the "buckets" member, or NULL past max_logged_buckets */
  size_t bucket_json_cap;
  double gpu_peak_mib;
  double *rank_compute_ms;  /* (W) every rank's compute time at the last report */
  double *gpu_all;          /* rank 0 on GPU runs: (W x DT_MON_GPU_FIELDS); else NULL */
  dt_monitor_snapshot snap; /* the state after the last step, for the status endpoint */
} dt_step_window;

void metrics_init(dt_step_window *w, const dt_metrics_src *src);
void metrics_free(dt_step_window *w);

/* One optimizer step done: its mean loss per target, its global batch, its seconds waiting for
 * data. Prints the progress line; at log steps (every log_every steps and the last) the reports
 * above, a collective, then a new window. */
void metrics_step(dt_step_window *w, int64_t step, int64_t total, int64_t epoch, double lr, double loss, double count,
                  double data_s, int64_t log_every);

/* Collective, at the end of a run (step: its last): every rank's measured memory peak (memory.h,
 * from the baseline mem), gathered; rank 0 logs the largest against the estimate (bytes) and
 * writes it as a metrics.jsonl record {"step", "mem_peak_mib", "mem_peak_rank", "mem_estimate_mib",
 * "mem_measured"}. Nothing when mem is NULL. */
void metrics_memory(dt_step_window *w, const dt_memory_watch *mem, size_t estimate, int64_t step);

#endif
