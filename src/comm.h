/* comm.h: everything that talks to MPI after start-up.
 * - Every wait has a deadline (dist.timeout_s): each rank announces its arrival to rank 0, which
 *   names the ranks not yet arrived in a warning at half the deadline; at the deadline a
 *   diagnostic (which collective, which step, which ranks) is printed and the job is aborted
 *   with exit code 3. A rank that dies is caught by mpirun, which ends the job.
 * - comm_agree: every rank brings its status; if any failed, the lowest failing rank prints its
 *   message once (naming itself when not every rank failed) and all return that code together.
 * - grad_sync: gradient averaging in buckets over the flat gradient buffer. Buckets are cut from
 *   the end of the buffer (backward finishes gradients from the end), and each bucket's
 *   MPI_Iallreduce starts as soon as backward reports it complete.
 * Owns: the node communicator and the bucket requests. Borrows: the gradient buffer. */
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

typedef struct {
  int64_t begin, end;
  MPI_Request req;
  int started;
} dt_bucket;

/* Called on a bucket's range [begin, end) before it is sent: queues a count of its non-finite
 * values (read with the step's other results), so a NaN is blamed on the rank that produced it. */
typedef void (*dt_check_fn)(void *ctx, int64_t begin, int64_t end);

/* A device collective library that sums over the ranks in place on the device (NCCL,
 * comm_nccl.c), with no host wait: everything is queued, so a step can be captured. Without
 * one, buckets go through MPI. */
typedef struct {
  void (*start)(void *ctx, float *buf, int64_t count); /* queue the sum of buf[0..count) */
  void (*join)(void *ctx);                             /* the compute stream waits for the queued sums */
  void (*sum_f64)(void *ctx, double *buf, int n);      /* queue the sum of n doubles, on the compute stream */
  /* While the host waits for queued work: a failed or vanished peer, or the deadline passed
   * since `since` (dt_now()), aborts the communicator and the job (exit 3), naming `what`. */
  void (*check)(void *ctx, const char *what, double since);
  void *ctx;
} dt_device_reduce;

typedef struct {
  dt_comm *comm;
  const dt_device_reduce *dev; /* borrowed: NULL for MPI */
  dt_backend *be;              /* borrowed: copies device buckets through `staging` when not host memory */
  float *grads;                /* borrowed, backend memory */
  float *staging;              /* owned: host copy of the buffer (NULL for host backends) */
  dt_check_fn check;
  void *check_ctx;
  int n_buckets;
  dt_bucket *buckets; /* buckets[0] is the last range of the buffer */
  int next;           /* first bucket not yet started */
  double wait_s;      /* time spent waiting in grad_sync_finish this step */
} dt_grad_sync;

void grad_sync_init(dt_grad_sync *g, dt_comm *c, const dt_device_reduce *dev, dt_backend *be, float *grads, int64_t n,
                    int64_t bucket_elems, dt_check_fn check, void *check_ctx);

/* comm_nccl.c (CUDA builds): an NCCL communicator over the ranks of c, its unique id sent by MPI
 * from rank 0, initialised non-blocking under c's deadline. Sums run on a communication stream
 * that waits (CUDA events) for `compute_stream`'s work queued before each start. NULL when NCCL
 * fails to initialise: on the rank that failed st is set (exit 3) and the others are told at
 * once, so they stop waiting (their st stays clear; the caller's comm_agree reports the failure). */
typedef struct dt_nccl dt_nccl;
/* grad_bf16: sum the gradient buckets as bfloat16 (dist.grad_dtype bf16). */
dt_nccl *nccl_create(dt_comm *c, void *compute_stream, int grad_bf16, dt_status *st);
const dt_device_reduce *nccl_reducer(dt_nccl *n);
/* Finalizes and destroys the communicator; aborts it instead when the job is failing (failed). */
void nccl_destroy(dt_nccl *n, int failed);
void grad_sync_free(dt_grad_sync *g);
/* Backward hook: every gradient at offset >= from is final. Starts the buckets it completes. */
void grad_sync_ready(dt_grad_sync *g, int64_t from);
/* Starts what is left; sums over ranks in place. Over MPI it waits for every bucket (under the
 * deadline); on the device it only makes the compute stream wait for them. */
void grad_sync_finish(dt_grad_sync *g);

#endif
