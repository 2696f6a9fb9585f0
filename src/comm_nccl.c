/* comm_nccl.c: gradient sums over NCCL. Rank 0 makes the unique id, MPI broadcasts it, and each
 * rank joins with ncclCommInitRankConfig in non-blocking mode, so that every wait can poll
 * ncclCommGetAsyncError and give up at dist.timeout_s with ncclCommAbort instead of hanging.
 * Gradient sums run on their own stream; a CUDA event makes each wait for the backward work
 * queued before it, and a second event makes the compute stream wait for the sums (the optimizer
 * step). Nothing here waits on the host: the host's one wait per step (the trainer's) polls
 * nccl_check, so a whole step can be captured as a CUDA graph. */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm_nccl.h"
#include "cuda_check.h"
#include "kernels.h"

struct dt_nccl {
  dt_comm *mpi;   /* borrowed: rank, size, deadline, step for diagnostics */
  dt_backend *be; /* borrowed: its stream is the compute stream; the packed bucket is counted in it */
  ncclComm_t comm;
  cudaStream_t compute, comm_stream;
  cudaEvent_t ready, done;
  int bf16;         /* dist.grad_dtype bf16: buckets are summed as bfloat16 */
  uint16_t *packed; /* (packed_count) device: a bucket in bf16, reused bucket after bucket on comm_stream */
  int64_t packed_count;
  dt_device_reduce reducer;
};

/* Prints why, aborts the communicator (so no rank stays inside NCCL) and the job (exit 3). */
/* ncclCommAbort, its own failure reported: nothing else can be done about it. */
static void abort_comm(dt_nccl *n) {
  ncclResult_t rc = ncclCommAbort(n->comm);
  if (rc != ncclSuccess)
    fprintf(stderr, "ddp_train: warning: rank %d: ncclCommAbort failed: %s\n", n->mpi->rank, ncclGetErrorString(rc));
}

static _Noreturn void give_up(dt_nccl *n, const char *what, const char *why) {
  /* NCCL meets a GPU fault of this rank's work as an unhandled CUDA error: named as a fault (exit 70) */
  const cudaError_t fault = cuda_context_fault();
  if (fault != cudaSuccess) {
    char call[256];
    snprintf(call, sizeof call, "%s at step %lld (NCCL: %s)", what, (long long)n->mpi->step, why);
    cuda_failed(fault, call, NULL, __FILE__, __LINE__);
  }
  fprintf(stderr, "ddp_train: error: rank %d: %s at step %lld %s; aborting the job\n", n->mpi->rank, what,
          (long long)n->mpi->step, why);
  fflush(stderr);
  abort_comm(n);
  comm_abort(n->mpi, DT_EXIT_PEER);
}

static _Noreturn void timed_out(dt_nccl *n, const char *what) {
  char why[128];
  snprintf(why, sizeof why, "did not complete within dist.timeout_s = %.0f s", n->mpi->timeout_s);
  give_up(n, what, why);
}

/* Polls the communicator until its last operation is issued; a failure or the deadline aborts
 * the communicator and the job (exit 3), naming the call. */
static void settle(dt_nccl *n, const char *what) {
  double t0 = dt_now();
  for (;;) {
    ncclResult_t state;
    ncclResult_t rc = ncclCommGetAsyncError(n->comm, &state);
    if (rc == ncclSuccess && state == ncclSuccess) return;
    if (rc != ncclSuccess || state != ncclInProgress) {
      char why[256];
      snprintf(why, sizeof why, "failed: %s", ncclGetErrorString(rc != ncclSuccess ? rc : state));
      give_up(n, what, why);
    }
    if (dt_now() - t0 > n->mpi->timeout_s) timed_out(n, what);
    usleep(100);
  }
}

/* The bf16 buffer for a bucket of count values. Buckets are the same every step, so it only grows
 * in the first (eager) step: never inside a captured one, where it could not wait to free. */
static uint16_t *packed_for(dt_nccl *n, int64_t count) {
  if (count <= n->packed_count) return n->packed;
  enum cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(n->comm_stream, &capturing));
  DT_ASSERT(capturing == cudaStreamCaptureStatusNone);
  CUDA_CHECK(cudaStreamSynchronize(n->comm_stream));
  CUDA_CHECK(cudaFree(n->packed));
  backend_count_device(n->be, -n->packed_count * (int64_t)sizeof(uint16_t));
  CUDA_CHECK(cudaMalloc((void **)&n->packed, (size_t)count * sizeof(uint16_t)));
  backend_count_device(n->be, count * (int64_t)sizeof(uint16_t));
  n->packed_count = count;
  return n->packed;
}

/* comm_stream waits for the compute stream's work queued so far: every collective goes on comm_stream
 * (nccl_sum_f64 says why). */
static void after_compute(dt_nccl *n) {
  CUDA_CHECK(cudaEventRecord(n->ready, n->compute));
  CUDA_CHECK(cudaStreamWaitEvent(n->comm_stream, n->ready, 0));
}

/* The compute stream waits for everything queued on comm_stream. */
static void nccl_join(void *ctx) {
  dt_nccl *n = ctx;
  CUDA_CHECK(cudaEventRecord(n->done, n->comm_stream));
  CUDA_CHECK(cudaStreamWaitEvent(n->compute, n->done, 0));
}

/* The sum of buf[0..count) over the ranks, queued on comm_stream after the compute stream's work so
 * far: into every rank's buf (root -1: ncclAllReduce) or into root's (ncclReduce, dist.zero 1). */
static void nccl_sum_into(dt_nccl *n, float *buf, int64_t count, int root) {
  const char *what = root < 0 ? "ncclAllReduce" : "ncclReduce";
  after_compute(n);
  /* bf16: rounded to nearest even, summed by NCCL in bf16, widened back in place */
  uint16_t *packed = n->bf16 ? packed_for(n, count) : NULL;
  if (packed) k_pack16(n->comm_stream, buf, packed, count, 1, 1, 1);
  void *data = packed ? (void *)packed : (void *)buf;
  const ncclDataType_t type = packed ? ncclBfloat16 : ncclFloat;
  ncclResult_t rc = root < 0 ? ncclAllReduce(data, data, (size_t)count, type, ncclSum, n->comm, n->comm_stream)
                             : ncclReduce(data, data, (size_t)count, type, ncclSum, root, n->comm, n->comm_stream);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    char why[256];
    snprintf(why, sizeof why, "failed for %lld values: %s", (long long)count, ncclGetErrorString(rc));
    give_up(n, what, why);
  }
  /* a non-blocking communicator may still be queueing the sum: nothing else goes on its stream
   * before it has (NCCL's rule), or the widening could run ahead of it */
  settle(n, what);
  if (packed && (root < 0 || root == n->mpi->rank)) k_unpack16(n->comm_stream, packed, buf, count, 1, 1, 1, 0);
}

static void nccl_start(void *ctx, float *buf, int64_t count) {
  nccl_sum_into(ctx, buf, count, -1);
}

static void nccl_reduce(void *ctx, float *buf, int64_t count, int root) {
  nccl_sum_into(ctx, buf, count, root);
}

/* Every rank's slice to every rank: one broadcast from each rank (NCCL's all-gather wants equal
 * slices, and an uneven split has none), on comm_stream after the compute stream's update, which
 * then waits for them (one stream for every collective: nccl_sum_f64 says why). */
static void nccl_gather(void *ctx, float *buf, const int64_t *lo) {
  dt_nccl *n = ctx;
  after_compute(n);
  for (int r = 0; r < n->mpi->size; r++) {
    if (lo[r + 1] == lo[r]) continue;
    ncclResult_t rc =
        ncclBroadcast(buf + lo[r], buf + lo[r], (size_t)(lo[r + 1] - lo[r]), ncclFloat, r, n->comm, n->comm_stream);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      char why[256];
      snprintf(why, sizeof why, "failed for rank %d's %lld values: %s", r, (long long)(lo[r + 1] - lo[r]),
               ncclGetErrorString(rc));
      give_up(n, "ncclBroadcast (parameters)", why);
    }
    settle(n, "ncclBroadcast (parameters)");
  }
  nccl_join(n);
}

/* Small sums (synchronised batchnorm statistics), needed by the compute stream at once: on
 * comm_stream all the same, after the buckets queued there, so that every collective of the
 * communicator is in one stream's order. On two streams a captured step holds them on parallel
 * branches, which a graph launch may run in either order, and the ranks then disagree. */
static void nccl_sum_f64(void *ctx, double *buf, int count) {
  dt_nccl *n = ctx;
  after_compute(n);
  ncclResult_t rc = ncclAllReduce(buf, buf, (size_t)count, ncclDouble, ncclSum, n->comm, n->comm_stream);
  if (rc != ncclSuccess && rc != ncclInProgress) {
    char why[256];
    snprintf(why, sizeof why, "failed for %d values: %s", count, ncclGetErrorString(rc));
    give_up(n, "ncclAllReduce (batchnorm statistics)", why);
  }
  settle(n, "ncclAllReduce (batchnorm statistics)");
  nccl_join(n);
}

/* A peer's failure surfaces as an asynchronous error of the communicator. */
static void nccl_check(void *ctx, const char *what, double since) {
  dt_nccl *n = ctx;
  ncclResult_t state;
  ncclResult_t rc = ncclCommGetAsyncError(n->comm, &state);
  if (rc != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
    char why[256];
    snprintf(why, sizeof why, "failed: %s", ncclGetErrorString(rc != ncclSuccess ? rc : state));
    give_up(n, what, why);
  }
  if (dt_now() - since > n->mpi->timeout_s) timed_out(n, what);
}

/* Joins the communicator: polls ncclCommGetAsyncError until the non-blocking initialisation is
 * done, a peer announces that its own failed, or the deadline passes. Returns 0 when joined. */
static int join(dt_nccl *n, ncclResult_t rc, dt_status *st) {
  dt_comm *c = n->mpi;
  double t0 = dt_now();
  while (rc == ncclSuccess || rc == ncclInProgress) {
    ncclResult_t state = ncclInProgress;
    rc = ncclCommGetAsyncError(n->comm, &state);
    if (rc != ncclSuccess) break;
    if (state == ncclSuccess) return 0;
    if (state != ncclInProgress) {
      rc = state;
      break;
    }
    int peer = comm_failed_peer(c);
    if (peer >= 0) { /* that rank reports why; this one leaves quietly */
      abort_comm(n);
      return -1;
    }
    if (dt_now() - t0 > c->timeout_s) {
      dt_fail(st, DT_EXIT_PEER, "ncclCommInitRankConfig did not complete within dist.timeout_s = %.0f s", c->timeout_s);
      break;
    }
    usleep(100);
  }
  const char *detail = n->comm ? ncclGetLastError(n->comm) : "";
  dt_fail(st, DT_EXIT_PEER, "NCCL initialisation failed: %s%s%s", ncclGetErrorString(rc), detail[0] ? ": " : "",
          detail);
  comm_announce_failure(c);
  if (n->comm) abort_comm(n);
  return -1;
}

dt_nccl *nccl_create(dt_comm *c, dt_backend *be, int grad_bf16, dt_status *st) {
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  ncclResult_t rc = ncclSuccess;
  if (c->rank == 0) rc = ncclGetUniqueId(&id);
  int ok = rc == ncclSuccess, all_ok = ok;
  comm_bcast(c, &all_ok, sizeof all_ok, 0);
  if (!all_ok) {
    dt_fail(st, DT_EXIT_PEER, "ncclGetUniqueId failed on rank 0: %s", ncclGetErrorString(rc));
    return NULL;
  }
  comm_bcast(c, &id, sizeof id, 0);
  dt_nccl *n = dt_calloc(1, sizeof *n);
  n->mpi = c;
  n->be = be;
  n->compute = (cudaStream_t)be->stream;
  n->bf16 = grad_bf16;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  rc = ncclCommInitRankConfig(&n->comm, c->size, id, c->rank, &config);
  if (join(n, rc, st)) {
    free(n);
    return NULL;
  }
  CUDA_CHECK(cudaStreamCreateWithFlags(&n->comm_stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&n->ready, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&n->done, cudaEventDisableTiming));
  n->reducer = (dt_device_reduce){.start = nccl_start,
                                  .reduce = nccl_reduce,
                                  .gather = nccl_gather,
                                  .join = nccl_join,
                                  .sum_f64 = nccl_sum_f64,
                                  .check = nccl_check,
                                  .ctx = n};
  return n;
}

const dt_device_reduce *nccl_reducer(dt_nccl *n) {
  return &n->reducer;
}

void nccl_destroy(dt_nccl *n, int failed) {
  if (!n) return;
  if (failed) { /* the job is ending on an error: peers may be gone, do not wait for them */
    abort_comm(n);
  } else {
    CUDA_CHECK(cudaStreamSynchronize(n->comm_stream));
    ncclResult_t rc = ncclCommFinalize(n->comm);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      char why[256];
      snprintf(why, sizeof why, "failed: %s", ncclGetErrorString(rc));
      give_up(n, "ncclCommFinalize", why);
    }
    settle(n, "ncclCommFinalize");
    rc = ncclCommDestroy(n->comm);
    if (rc != ncclSuccess)
      fprintf(stderr, "ddp_train: warning: rank %d: ncclCommDestroy failed: %s\n", n->mpi->rank,
              ncclGetErrorString(rc));
  }
  CUDA_CHECK(cudaFree(n->packed));
  backend_count_device(n->be, -n->packed_count * (int64_t)sizeof(uint16_t));
  CUDA_CHECK(cudaEventDestroy(n->ready));
  CUDA_CHECK(cudaEventDestroy(n->done));
  CUDA_CHECK(cudaStreamDestroy(n->comm_stream));
  free(n);
}
