/* comm.h: everything that talks to MPI after start-up (NCCL: comm_nccl.h; gradient buckets over
 * either: ddp.h).
 * - Every wait has a deadline (dist.timeout_s): each rank announces its arrival to rank 0, which
 *   names the ranks not yet arrived in a warning at half the deadline; at the deadline a
 *   diagnostic (which collective, which step, which ranks) is printed and the job is aborted
 *   with exit code 3. A rank that dies is caught by mpirun, which ends the job.
 * - comm_agree: every rank brings its status; if any failed, the lowest failing rank prints its
 *   message once (naming itself when not every rank failed) and all return that code together.
 * Owns: the node communicator and the arrival-tracking requests. */
#ifndef DT_COMM_H
#define DT_COMM_H

#include <mpi.h>
#include <stdint.h>

#include "backend.h"
#include "common.h"

typedef struct {
  int rank, size;             /* in MPI_COMM_WORLD */
  int local_rank, local_size; /* on this node (MPI_COMM_TYPE_SHARED) */
  MPI_Comm world, node;
  char host[256];
  double timeout_s; /* deadline of every wait (dist.timeout_s; 600 until the config is read) */
  int64_t step;     /* the training step, for diagnostics (-1 at start-up) */
  /* arrival tracking: rank 0 receives one message from each rank per wait */
  int64_t seq, send_seq;
  int64_t *arrived_seq;    /* rank 0: (size) */
  MPI_Request *arrive_req; /* rank 0: (size) */
  MPI_Request send_req;
  /* rank 0 (optional): told about a wait once it has lasted a second, every half second after,
   * and once more with what NULL when it ends: the collective, the step and the ranks that have
   * not arrived ("1, 3"). It runs on the waiting thread and must not block (monitor_note_wait). */
  void (*wait_hook)(void *ctx, const char *what, int64_t step, double waited_s, const char *missing);
  void *wait_ctx;
} dt_comm;

int comm_init(dt_comm *c, int *argc, char ***argv);
void comm_finalize(dt_comm *c);

/* Collective: returns the agreed exit code (0: all ok). Prints the message once. */
int comm_agree(dt_comm *c, const dt_status *st);

/* Collective: exit-2 status naming the ranks whose hash differs from rank 0's. */
int comm_check_same(dt_comm *c, uint64_t hash, const char *what, dt_status *st);

/* Waits for reqs[0..n) under the deadline; `what` names the collective in diagnostics. */
void comm_wait(dt_comm *c, MPI_Request *reqs, int n, const char *what);

void comm_bcast(dt_comm *c, void *buf, size_t bytes, int root);

/* For a wait outside MPI (NCCL's initialisation): a rank that fails tells every other rank, and
 * comm_failed_peer (never blocking) returns the first rank that did so, or -1. */
void comm_announce_failure(dt_comm *c);
int comm_failed_peer(dt_comm *c);

/* Rank 0 receives every rank's text (cap bytes each) in rank order into all (size * cap bytes,
 * allocated by the caller on rank 0; NULL elsewhere). */
void comm_gather_text(dt_comm *c, const char *text, size_t cap, char *all);

/* Every rank receives every rank's text, as comm_gather_text (all: size * cap bytes, on every rank). */
void comm_allgather_text(dt_comm *c, const char *text, size_t cap, char *all);

/* Rank 0 receives every rank's n doubles in rank order into all (size * n, allocated by the caller
 * on rank 0; NULL elsewhere). */
void comm_gather_f64(dt_comm *c, const double *mine, int n, double *all);

/* Rank 0 receives every rank's rows (n_mine x width floats) in rank order into all (caller
 * allocates total rows x width on rank 0). */
void comm_gather_rows(dt_comm *c, const float *mine, int64_t n_mine, int64_t width, float *all);

/* Every rank receives every rank's value. */
void comm_allgather_f64(dt_comm *c, double mine, double *all, const char *what);
void comm_allreduce_sum_f64(dt_comm *c, double *data, int n, const char *what);
/* The lowest of every rank's value, on every rank. */
int comm_min_i32(dt_comm *c, int mine, const char *what);

/* The per-step agreement: one small all-gather of every rank's report. out gets the sums and
 * whether any rank asked to stop or for a checkpoint; the return is the agreed exit code (0: all well), with the
 * lowest failing rank's message printed once. */
typedef struct {
  double loss_sum, correct;
  int32_t code;       /* this rank's status code (st) */
  int32_t stop;       /* this rank was asked to stop: the signal number, DT_STOP_TIME_LIMIT or DT_STOP_HTTP */
  int32_t checkpoint; /* a checkpoint was asked for (POST /checkpoint): every rank writes one at this step */
} dt_step_report;
enum { DT_STOP_TIME_LIMIT = -1, DT_STOP_HTTP = -2 };
int comm_step_agree(dt_comm *c, const dt_step_report *mine, const dt_status *st, dt_step_report *out);

/* A non-blocking operation in flight (ddp.c's buckets). */
typedef MPI_Request dt_comm_request;
#define DT_COMM_REQUEST_NULL MPI_REQUEST_NULL
/* Starts the sum of buf[0..count) over the ranks, in place (count < 2^31). */
void comm_isum_f32(dt_comm *c, float *buf, int64_t count, dt_comm_request *req);
/* Starts the sum of buf[0..count) over the ranks into root's buf (in place there; the others' buf
 * is only read) (count < 2^31). */
void comm_ireduce_f32(dt_comm *c, float *buf, int64_t count, int root, dt_comm_request *req);
/* Every rank r's slice buf[lo[r], lo[r + 1]) to every rank, in place (lo: size + 1 offsets, lo[size]
 * < 2^31), under the deadline. */
void comm_allgather_slices_f32(dt_comm *c, float *buf, const int64_t *lo, const char *what);
/* Lets the library advance req (Open MPI progresses non-blocking collectives only inside MPI calls). */
void comm_progress(dt_comm_request *req);

/* Ends the job at once with `code` on every rank (a deadline passed, a peer failed): the caller has
 * printed why. */
_Noreturn void comm_abort(dt_comm *c, int code);

/* A device collective library that sums over the ranks in place on the device (NCCL,
 * comm_nccl.h), with no host wait: everything is queued, so a step can be captured. Without
 * one, ddp.c's buckets go through MPI. */
typedef struct {
  void (*start)(void *ctx, float *buf, int64_t count); /* queue the sum of buf[0..count) */
  /* dist.zero 1: queue the sum of buf[0..count) into root's buf; queue every rank r's slice
   * buf[lo[r], lo[r + 1]) to every rank; the compute stream waits (lo: size + 1 offsets) */
  void (*reduce)(void *ctx, float *buf, int64_t count, int root);
  void (*gather)(void *ctx, float *buf, const int64_t *lo);
  void (*join)(void *ctx);                        /* the compute stream waits for the queued sums */
  void (*sum_f64)(void *ctx, double *buf, int n); /* queue the sum of n doubles; the compute stream waits */
  /* While the host waits for queued work: a failed or vanished peer, or the deadline passed
   * since `since` (dt_now()), aborts the communicator and the job (exit 3), naming `what`. */
  void (*check)(void *ctx, const char *what, double since);
  void *ctx;
} dt_device_reduce;

#endif
