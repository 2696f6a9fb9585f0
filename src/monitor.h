/* monitor.h: rank 0's live status endpoint (monitor.listen), served by libmicrohttpd from its own
 * thread: GET / (the dashboard page, src/dashboard/), /health, /metrics (Prometheus text), /status,
 * /history (metrics.jsonl), and POST /checkpoint and /stop with a bearer token (monitor.token_file);
 * and at the end of a run the same page, static, as log.dir/report.html.
 * - The training loop never waits on HTTP: it copies a snapshot in after each step
 *   (monitor_publish) and collects the requests that arrived (monitor_take_requests); requests
 *   read the latest snapshot under a mutex.
 * - The HTTP thread never calls MPI; comm_wait tells it which collective rank 0 is waiting in
 *   through monitor_note_wait (dt_comm's wait hook).
 * - Bounded: 16 KiB of request line and headers, 64 headers, 32 connections (a newcomer past them
 *   closes the one longest in its headers, else the one idle longest), 5 s of inactivity per
 *   connection, 10,000 records and 256 KiB per /history answer.
 * Owns: the listening socket, the daemon, the token and its copies of the snapshots. Every other
 * rank holds NULL; every function accepts NULL and does nothing. */
#ifndef DT_MONITOR_H
#define DT_MONITOR_H

#include <stdint.h>

#include "common.h"

typedef struct dt_monitor dt_monitor;

typedef struct {
  const char *listen;     /* monitor.listen, "HOST:PORT" */
  const char *token_file; /* monitor.token_file; "" none */
  double stall_s;         /* /health's limit: seconds without a finished step (> 0) */
  const char *log_dir;    /* log.dir: /history reads its metrics.jsonl; "" none */
  int checkpoints;        /* checkpoint.dir is set: POST /checkpoint can be honoured */
} dt_monitor_opts;

/* Validates the options: the address (exit 2 naming it: bad syntax, one that no socket can listen
 * on, or not loopback without a token file), and the token file (exit 2 naming it: unreadable, not
 * a regular file, owned by another user than this one or root, readable or writable by group or
 * others, or empty). When bind_now, also binds and listens on the address (exit 2 naming it when it
 * is in use or cannot be bound) and returns the monitor, not yet serving; NULL otherwise, or with st
 * set. The caller frees it with monitor_close. */
dt_monitor *monitor_open(const dt_monitor_opts *o, int bind_now, dt_status *st);

/* What does not change during a run, for /status and the labels of /metrics. The strings are
 * copied. hosts and devices: (world_size) each. */
typedef struct {
  const char *config_path;
  const char *model_summary; /* model_summary's text */
  const char *data_path;     /* data.path */
  uint64_t config_hash;
  int world_size;
  const char *const *hosts;
  const char *const *devices; /* "cpu", or gpu_describe's "GPU 0: NVIDIA H100 ..." */
  int64_t global_batch;       /* rows of an optimizer step */
  int64_t rank_rows;          /* the largest rank's rows of a micro-batch */
  int64_t grad_accum;         /* micro-batches of a step */
  const char *auto_batch;     /* train.batch_size auto's choice and why, or "" */
  const char *optim_name;     /* optim.name */
  int zero;                   /* dist.zero */
  int64_t optim_state_bytes;  /* rank 0's optimizer state (dist.zero 1: of its slice) */
  int64_t epochs;
  /* distillation: distill.teacher and distill.weights ("": none), the teacher's parameters, distill.loss,
   * its temperature and alpha */
  const char *teacher, *teacher_weights, *distill_loss;
  int64_t teacher_params;
  double temperature, alpha;
} dt_monitor_run;

/* Starts serving from the daemon's thread and prints where it listens on stdout. Exit 2 naming the
 * address when the daemon cannot start. Without monitor.listen it only keeps the state, for
 * monitor_write_report. */
int monitor_start(dt_monitor *mon, const dt_monitor_run *run, dt_status *st);

/* Each rank's NVML reading, in /metrics as one series per rank: the fields of dt_gpu_reading. */
enum {
  DT_MON_GPU_VALID,
  DT_MON_GPU_INDEX,
  DT_MON_GPU_MEM_USED,
  DT_MON_GPU_MEM_PEAK,
  DT_MON_GPU_UTIL,
  DT_MON_GPU_POWER,
  DT_MON_GPU_TEMP,
  DT_MON_GPU_FIELDS
};

/* The state after a step, copied in by monitor_publish. The log fields are those of the last
 * metrics.jsonl record (log.every_steps), the val fields those of the last evaluation. */
typedef struct {
  int64_t step, total_steps, epoch; /* epoch counted from 1 as in the log */
  int64_t steps_run;                /* optimizer steps this process has run */
  double train_s;                   /* seconds since training started in this process */
  /* the last metrics line (log_step > 0) */
  int64_t log_step;
  double loss, lr, samples_per_s, tokens_per_s; /* tokens_per_s: token models, else 0 */
  double step_ms, compute_ms, data_ms, comm_ms;
  int straggler_rank;            /* -1: none */
  const double *rank_compute_ms; /* (world_size) borrowed for the call */
  const double *gpu;             /* (world_size x DT_MON_GPU_FIELDS) borrowed, or NULL: no GPU */
  /* the last evaluation (val_step > 0) */
  int64_t val_step;
  double val_loss, val_acc; /* val_acc < 0: none (mse) */
  int has_ema;
  double ema_val_loss, ema_val_acc;
  /* the last step checkpoint written by this process (ckpt_step > 0), at dt_now() ckpt_time */
  int64_t ckpt_step;
  double ckpt_time;
} dt_monitor_snapshot;

/* Copies s in (after each step, and once when training starts). Never blocks on HTTP: it holds
 * the mutex only for the copy. */
void monitor_publish(dt_monitor *mon, const dt_monitor_snapshot *s);

/* The requests authorised since the last call, cleared: DT_MON_STOP and DT_MON_CHECKPOINT bits. */
enum { DT_MON_STOP = 1, DT_MON_CHECKPOINT = 2 };
int monitor_take_requests(dt_monitor *mon);

/* dt_comm's wait hook (ctx: the monitor): rank 0 has waited waited_s in collective `what` at step
 * `step` for the ranks in `missing` ("1, 3"; "" when unknown); what NULL: the wait ended. */
void monitor_note_wait(void *ctx, const char *what, int64_t step, double waited_s, const char *missing);

/* Writes log.dir/report.html atomically: the dashboard page with /status (state "finished", or
 * "stopped" for code DT_EXIT_STOPPED) and every whole record of metrics.jsonl inlined, to open from
 * the file with no server and no network. Nothing without log.dir. Exit 5 naming the file. */
int monitor_write_report(dt_monitor *mon, int code, dt_status *st);

/* Stops the daemon (closing its connections) and frees everything. */
void monitor_close(dt_monitor *mon);

#endif
