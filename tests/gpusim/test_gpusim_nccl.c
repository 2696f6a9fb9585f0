/* test_gpusim_nccl: the NCCL stand-in (tests/gpusim/nccl.cc) across real MPI processes, each rank
 * with its own stand-in device. Rank 0 prints one TAP line per test; a check that fails on any
 * rank fails the test, naming the lowest such rank.
 *   mpirun -np 3 -x GPUSIM_DEVICES=3 build/sim/tests/test_gpusim_nccl    tests 1-11
 *   mpirun -np 2 -x GPUSIM_DEVICES=1 build/sim/tests/test_gpusim_nccl    every rank on device 0:
 *                                                                         duplicate detection only
 * Host code never touches device memory (the stand-in aborts if it does), and queued collectives
 * run only at synchronisation points: results are copied back after cudaStreamSynchronize.
 * A test still running after HANG_S seconds (a rank left a collective its peers are waiting in)
 * prints "Bail out!" and exits, so that mpirun ends the job instead of hanging. */
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define HANG_S 90
#define MAX_BUFFERS 16

static int rank, nranks;
static ncclComm_t comm; /* tests 1-8; tests 9-11 make their own to break */
static cudaStream_t stream;
static char why[512];              /* this rank's first failure in the current test; empty while it passes */
static int in_progress_answers;    /* ncclInProgress answers settle() has seen */
static void *buffers[MAX_BUFFERS]; /* the current test's device buffers */
static int nbuffers;
static char hang_note[256];
static size_t hang_len;

static int vfail(const char *fmt, va_list ap) {
  if (!why[0]) vsnprintf(why, sizeof why, fmt, ap);
  return 0;
}

/* Records the first failure of the current test; returns 0, so that a check can `return fail(...)`. */
static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(fmt, ap);
  va_end(ap);
  return 0;
}

/* Returns ok; records fmt as the failure when it is 0. */
static int expect(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int expect(int ok, const char *fmt, ...) {
  if (ok) return 1;
  va_list ap;
  va_start(ap, fmt);
  vfail(fmt, ap);
  va_end(ap);
  return 0;
}

static int cuda_ok(cudaError_t e, const char *call) {
  return e == cudaSuccess ? 1 : fail("%s: %s", call, cudaGetErrorString(e));
}
#define CUDA(call) cuda_ok((call), #call)

/* A non-blocking communicator may answer ncclInProgress to any call, and the stand-in refuses the
 * next call until the last is issued: polls ncclCommGetAsyncError until it is (30 s at most).
 * Returns the state it ended in. */
static ncclResult_t settle(ncclComm_t c) {
  double deadline = MPI_Wtime() + 30;
  for (;;) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r = ncclCommGetAsyncError(c, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress || MPI_Wtime() > deadline) return state;
    in_progress_answers++;
    usleep(100);
  }
}

static int nccl_ok(ncclComm_t c, ncclResult_t r, const char *call) {
  if (r == ncclInProgress) r = settle(c);
  return r == ncclSuccess ? 1 : fail("%s: %s (%s)", call, ncclGetErrorString(r), ncclGetLastError(c));
}
#define NCCL(c, call) nccl_ok((c), (call), #call)

/* A device buffer holding a copy of `bytes` of host memory, freed after the test. */
static void *device_copy(const void *host, size_t bytes) {
  void *p = NULL;
  if (!expect(nbuffers < MAX_BUFFERS, "more than %d device buffers in one test", MAX_BUFFERS) ||
      !CUDA(cudaMalloc(&p, bytes)))
    return NULL;
  buffers[nbuffers++] = p;
  return CUDA(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice)) ? p : NULL;
}

/* Runs the work queued on the stream and checks that the communicator reports no asynchronous
 * error (ranks that disagree on a collective show there, not in its return value). */
static int wait_for(ncclComm_t c) {
  ncclResult_t state = ncclSuccess;
  return CUDA(cudaStreamSynchronize(stream)) && NCCL(c, ncclCommGetAsyncError(c, &state)) &&
         expect(state == ncclSuccess, "asynchronous error: %s (%s)", ncclGetErrorString(state), ncclGetLastError(c));
}

static int fetch(void *host, const void *dev, size_t bytes) {
  return CUDA(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
}

static int same_floats(const char *what, const float *got, const float *want, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (got[i] != want[i]) return fail("%s[%zu] = %g, expected %g", what, i, got[i], want[i]);
  return 1;
}

static int same_ints(const char *what, const int32_t *got, const int32_t *want, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (got[i] != want[i]) return fail("%s[%zu] = %d, expected %d", what, i, got[i], want[i]);
  return 1;
}

/* Rank 0 makes the unique id, MPI broadcasts it, and every rank joins in non-blocking mode.
 * Returns the state initialisation ended in: ncclSuccess, an error, or ncclInProgress after 30 s. */
static ncclResult_t join(ncclComm_t *c) {
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  if (rank == 0) NCCL(NULL, ncclGetUniqueId(&id)); /* broadcast even if it failed: no rank waits forever */
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  *c = NULL;
  ncclResult_t r = ncclCommInitRankConfig(c, nranks, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    fail("ncclCommInitRankConfig: %s (%s)", ncclGetErrorString(r), ncclGetLastError(*c));
    return r;
  }
  return settle(*c);
}

/* ---- the tests (tests 2-10 are written for 3 ranks) ---------------------------------------- */

static void unique_id_and_nonblocking_init(void) {
  in_progress_answers = 0;
  ncclResult_t state = join(&comm);
  if (!expect(state == ncclSuccess, "initialisation ended in: %s (%s)", ncclGetErrorString(state),
              ncclGetLastError(comm)))
    return;
  /* the stand-in answers ncclInProgress a few polls after every rank joined: the loop must run */
  expect(in_progress_answers > 0, "ncclCommGetAsyncError never answered ncclInProgress during initialisation");
  int count = -1, user_rank = -1, device = -1;
  if (NCCL(comm, ncclCommCount(comm, &count)))
    expect(count == nranks, "ncclCommCount = %d, expected %d", count, nranks);
  if (NCCL(comm, ncclCommUserRank(comm, &user_rank)))
    expect(user_rank == rank, "ncclCommUserRank = %d, expected %d", user_rank, rank);
  if (NCCL(comm, ncclCommCuDevice(comm, &device)))
    expect(device == rank, "ncclCommCuDevice = %d, expected %d", device, rank);
}

static void all_reduce_sum_float_and_max_int(void) {
  enum { N = 1000 };
  float sum[N], want_sum[N], avg_in[N], avg[N], want_avg[N];
  int32_t max[N], want_max[N];
  for (int i = 0; i < N; i++) {
    sum[i] = (float)(rank * 10 + i); /* small integers: every sum is exact */
    want_sum[i] = (float)(30 + 3 * i);
    max[i] = ((i + rank) % 3) * 100 - i; /* each rank holds the maximum of a third of the elements */
    want_max[i] = 200 - i;
    avg_in[i] = (float)(rank * 3 + i);
    avg[i] = -1;
    want_avg[i] = (float)(3 + i); /* (0 + 3 + 6) / 3 + i */
  }
  float *d_sum = device_copy(sum, sizeof sum), *d_avg_in = device_copy(avg_in, sizeof avg_in);
  float *d_avg = device_copy(avg, sizeof avg);
  int32_t *d_max = device_copy(max, sizeof max);
  if (d_sum && d_avg_in && d_avg && d_max &&
      NCCL(comm, ncclAllReduce(d_sum, d_sum, N, ncclFloat, ncclSum, comm, stream)) &&
      NCCL(comm, ncclAllReduce(d_max, d_max, N, ncclInt32, ncclMax, comm, stream)) &&
      NCCL(comm, ncclAllReduce(d_avg_in, d_avg, N, ncclFloat, ncclAvg, comm, stream)) && wait_for(comm) &&
      fetch(sum, d_sum, sizeof sum) && fetch(max, d_max, sizeof max) && fetch(avg, d_avg, sizeof avg)) {
    same_floats("sum", sum, want_sum, N); /* only the first failure is kept */
    same_ints("max", max, want_max, N);
    same_floats("avg", avg, want_avg, N);
  }
}

static void large_all_reduce_spans_several_rounds(void) {
  const size_t n = 5000000; /* 20 MB: the stand-in moves 8 MiB of a rank's part per round */
  float *x = malloc(n * sizeof *x);
  if (!expect(x != NULL, "out of host memory")) return;
  for (size_t i = 0; i < n; i++) x[i] = (float)(i % 1000 + rank);
  float *d = device_copy(x, n * sizeof *x);
  if (d && NCCL(comm, ncclAllReduce(d, d, n, ncclFloat, ncclSum, comm, stream)) && wait_for(comm) &&
      fetch(x, d, n * sizeof *x))
    for (size_t i = 0; i < n; i++)
      if (x[i] != (float)(3 * (i % 1000) + 3)) {
        fail("element %zu of %zu = %g, expected %g", i, n, x[i], (float)(3 * (i % 1000) + 3));
        break;
      }
  free(x);
}

static void reduce_scatter_all_gather_broadcast_reduce(void) {
  int32_t scatter_in[15], scatter[5], want_scatter[5], gather_in[4], gather[12], want_gather[12];
  float bcast[6], want_bcast[6], reduce_in[7], reduce[7], want_reduce[7];
  for (int j = 0; j < 15; j++) scatter_in[j] = rank * 100 + j;
  for (int k = 0; k < 5; k++) scatter[k] = -1, want_scatter[k] = 300 + 3 * (5 * rank + k); /* my block of 5 */
  for (int k = 0; k < 4; k++) gather_in[k] = rank * 10 + k;
  for (int j = 0; j < 12; j++) gather[j] = -1, want_gather[j] = j / 4 * 10 + j % 4;
  for (int k = 0; k < 6; k++) bcast[k] = rank == 2 ? 2000 + k : -1, want_bcast[k] = 2000 + k;
  for (int k = 0; k < 7; k++) reduce_in[k] = (float)((rank + 1) * k), reduce[k] = -1, want_reduce[k] = (float)(6 * k);
  int32_t *d_scatter_in = device_copy(scatter_in, sizeof scatter_in), *d_scatter = device_copy(scatter, sizeof scatter);
  int32_t *d_gather_in = device_copy(gather_in, sizeof gather_in), *d_gather = device_copy(gather, sizeof gather);
  float *d_bcast = device_copy(bcast, sizeof bcast);
  float *d_reduce_in = device_copy(reduce_in, sizeof reduce_in), *d_reduce = device_copy(reduce, sizeof reduce);
  if (!d_scatter_in || !d_scatter || !d_gather_in || !d_gather || !d_bcast || !d_reduce_in || !d_reduce) return;
  if (NCCL(comm, ncclReduceScatter(d_scatter_in, d_scatter, 5, ncclInt32, ncclSum, comm, stream)) &&
      NCCL(comm, ncclAllGather(d_gather_in, d_gather, 4, ncclInt32, comm, stream)) &&
      NCCL(comm, ncclBroadcast(d_bcast, d_bcast, 6, ncclFloat, 2, comm, stream)) &&
      NCCL(comm, ncclReduce(d_reduce_in, d_reduce, 7, ncclFloat, ncclSum, 1, comm, stream)) && wait_for(comm) &&
      fetch(scatter, d_scatter, sizeof scatter) && fetch(gather, d_gather, sizeof gather) &&
      fetch(bcast, d_bcast, sizeof bcast) && fetch(reduce, d_reduce, sizeof reduce) &&
      same_ints("reduce-scatter", scatter, want_scatter, 5) && same_ints("all-gather", gather, want_gather, 12) &&
      same_floats("broadcast", bcast, want_bcast, 6))
    if (rank == 1) same_floats("reduce at its root", reduce, want_reduce, 7); /* other ranks' recv is undefined */
}

/* Two collectives of different sizes and types in one group: had they run in another order on
 * some rank, the ranks would disagree and the communicator would report it. */
static void group_calls_run_in_order(void) {
  float a[10], want_a[10];
  int32_t b[7], want_b[7];
  for (int i = 0; i < 10; i++) a[i] = (float)(rank + i), want_a[i] = (float)(3 + 3 * i);
  for (int i = 0; i < 7; i++) b[i] = rank * i, want_b[i] = 2 * i;
  float *d_a = device_copy(a, sizeof a);
  int32_t *d_b = device_copy(b, sizeof b);
  if (!d_a || !d_b || !NCCL(comm, ncclGroupStart())) return;
  int ok = NCCL(comm, ncclAllReduce(d_a, d_a, 10, ncclFloat, ncclSum, comm, stream)) &&
           NCCL(comm, ncclAllReduce(d_b, d_b, 7, ncclInt32, ncclMax, comm, stream));
  ok = NCCL(comm, ncclGroupEnd()) && ok; /* always close the group */
  if (ok && wait_for(comm) && fetch(a, d_a, sizeof a) && fetch(b, d_b, sizeof b)) {
    same_floats("first", a, want_a, 10);
    same_ints("second", b, want_b, 7);
  }
}

/* An all-reduce, then a group of an in-place all-reduce and a broadcast, captured into a graph once:
 * nothing runs at capture, and every launch issues them again, in order, with the data of that
 * moment, as calls made then would. */
static void collectives_in_a_graph_run_at_every_launch(void) {
  enum { N = 300, M = 8 };
  float in[N], out[N], want[N], bc[M], want_bc[M];
  int32_t acc[M], want_acc = 6; /* the sum of rank + 1, then of that, ... */
  for (int i = 0; i < N; i++) in[i] = 0, out[i] = -1;
  for (int k = 0; k < M; k++) bc[k] = -1, acc[k] = rank + 1;
  float *d_in = device_copy(in, sizeof in), *d_out = device_copy(out, sizeof out), *d_bc = device_copy(bc, sizeof bc);
  int32_t *d_acc = device_copy(acc, sizeof acc);
  if (!d_in || !d_out || !d_bc || !d_acc || !CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal))) return;
  int ok = NCCL(comm, ncclAllReduce(d_in, d_out, N, ncclFloat, ncclSum, comm, stream)) && NCCL(comm, ncclGroupStart());
  if (ok) {
    ok = NCCL(comm, ncclAllReduce(d_acc, d_acc, M, ncclInt32, ncclSum, comm, stream)) &&
         NCCL(comm, ncclBroadcast(d_bc, d_bc, M, ncclFloat, 1, comm, stream));
    ok = NCCL(comm, ncclGroupEnd()) && ok; /* always close the group */
  }
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  ok = CUDA(cudaStreamEndCapture(stream, &graph)) && ok && CUDA(cudaGraphInstantiate(&exec, graph, 0)) &&
       fetch(out, d_out, sizeof out) && expect(out[0] == -1, "the captured all-reduce ran at capture: %g", out[0]);
  for (int launch = 0; ok && launch < 3; launch++, want_acc *= 3) {
    for (int i = 0; i < N; i++)
      in[i] = (float)(rank * 10 + i + 1000 * launch), want[i] = (float)(30 + 3 * i + 3000 * launch);
    for (int k = 0; k < M; k++)
      bc[k] = rank == 1 ? (float)(100 * launch + k) : -1, want_bc[k] = (float)(100 * launch + k);
    ok = CUDA(cudaMemcpy(d_in, in, sizeof in, cudaMemcpyHostToDevice)) &&
         CUDA(cudaMemcpy(d_bc, bc, sizeof bc, cudaMemcpyHostToDevice)) && CUDA(cudaGraphLaunch(exec, stream)) &&
         wait_for(comm) && fetch(out, d_out, sizeof out) && fetch(bc, d_bc, sizeof bc) &&
         fetch(acc, d_acc, sizeof acc) && same_floats("all-reduce", out, want, N) &&
         same_floats("broadcast", bc, want_bc, M) &&
         expect(acc[0] == want_acc && acc[M - 1] == want_acc, "launch %d: in-place all-reduce gave %d, expected %d",
                launch, acc[0], want_acc);
  }
  /* two launches queued before one synchronisation: both run, in order */
  if (ok && CUDA(cudaGraphLaunch(exec, stream)) && CUDA(cudaGraphLaunch(exec, stream)) && wait_for(comm) &&
      fetch(acc, d_acc, sizeof acc))
    expect(acc[0] == want_acc * 3, "after two more launches the in-place all-reduce gave %d, expected %d", acc[0],
           want_acc * 3);
  if (exec) CUDA(cudaGraphExecDestroy(exec));
  if (graph) CUDA(cudaGraphDestroy(graph));
}

/* Sums that round: every rank must still get the same bits (data parallelism relies on it). */
static void results_are_bit_identical_on_every_rank(void) {
  enum { N = 4096 };
  float x[N];
  for (int i = 0; i < N; i++) x[i] = 0.1f * (float)(rank + 1) * (float)(i + 1);
  float *d = device_copy(x, sizeof x);
  if (d && NCCL(comm, ncclAllReduce(d, d, N, ncclFloat, ncclSum, comm, stream)) && wait_for(comm) &&
      fetch(x, d, sizeof x))
    for (int i = 0; i < N; i++) {
      double want = 0.6 * (i + 1), err = x[i] > want ? x[i] - want : want - x[i];
      if (!expect(err <= 1e-5 * want, "element %d = %.9g, expected about %.9g", i, x[i], want)) break;
    }
  float *all = malloc(sizeof x * (size_t)nranks);
  if (!expect(all != NULL, "out of host memory")) return; /* MPI_Allgather below cannot be skipped otherwise */
  MPI_Allgather(x, sizeof x, MPI_BYTE, all, sizeof x, MPI_BYTE, MPI_COMM_WORLD);
  for (int r = 0; r < nranks; r++)
    for (int i = 0; i < N; i++)
      if (memcmp(&all[r * N + i], &x[i], sizeof x[i])) {
        fail("element %d is %a on rank %d but %a here", i, all[r * N + i], r, x[i]);
        r = nranks;
        break;
      }
  free(all);
}

static void host_buffer_is_an_invalid_argument(void) {
  float *host = calloc(16, sizeof *host);
  if (!expect(host != NULL, "out of host memory")) return;
  ncclResult_t r = ncclAllReduce(host, host, 16, ncclFloat, ncclSum, comm, stream);
  expect(r == ncclInvalidArgument, "ncclAllReduce of a host buffer returned: %s, expected ncclInvalidArgument",
         ncclGetErrorString(r));
  expect(strstr(ncclGetLastError(comm), "not device memory") != NULL,
         "ncclGetLastError says \"%s\", expected it to mention \"not device memory\"", ncclGetLastError(comm));
  if (r == ncclInProgress) settle(comm); /* it was accepted: let it be issued before the next call */
  /* the communicator stays usable */
  float x[4] = {(float)rank + 1, 1, 2, 3}, want[4] = {6, 3, 6, 9};
  float *d = device_copy(x, sizeof x);
  if (d && NCCL(comm, ncclAllReduce(d, d, 4, ncclFloat, ncclSum, comm, stream)) && wait_for(comm) &&
      fetch(x, d, sizeof x))
    same_floats("all-reduce after the refused call", x, want, 4);
  free(host);
}

static void mismatched_counts_are_detected(void) {
  ncclComm_t c;
  ncclResult_t state = join(&c);
  if (expect(state == ncclSuccess, "initialisation ended in: %s", ncclGetErrorString(state))) {
    float x[200] = {0};
    float *d = device_copy(x, sizeof x);
    size_t count = rank == 0 ? 100 : 200; /* rank 0 disagrees with the others */
    if (d && NCCL(c, ncclAllReduce(d, d, count, ncclFloat, ncclSum, c, stream)) &&
        CUDA(cudaStreamSynchronize(stream)) && NCCL(c, ncclCommGetAsyncError(c, &state))) {
      expect(state == ncclInvalidUsage, "asynchronous error: %s, expected ncclInvalidUsage", ncclGetErrorString(state));
      expect(strstr(ncclGetLastError(c), "disagree") != NULL,
             "ncclGetLastError says \"%s\", expected it to mention \"disagree\"", ncclGetLastError(c));
    }
  }
  if (c) NCCL(c, ncclCommAbort(c));
}

/* NCCL's rule for CUDA graphs: a collective is captured on every rank or on none. Rank 0 launches
 * its all-reduce from a graph while the others queue theirs eagerly. */
static void captured_on_one_rank_only_is_detected(void) {
  ncclComm_t c;
  ncclResult_t state = join(&c);
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  if (expect(state == ncclSuccess, "initialisation ended in: %s", ncclGetErrorString(state))) {
    float x[64] = {0};
    float *d = device_copy(x, sizeof x);
    int ok = d != NULL;
    if (ok && rank == 0)
      ok = CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal)) &&
           NCCL(c, ncclAllReduce(d, d, 64, ncclFloat, ncclSum, c, stream)) &&
           CUDA(cudaStreamEndCapture(stream, &graph)) && CUDA(cudaGraphInstantiate(&exec, graph, 0)) &&
           CUDA(cudaGraphLaunch(exec, stream));
    else if (ok)
      ok = NCCL(c, ncclAllReduce(d, d, 64, ncclFloat, ncclSum, c, stream));
    if (ok && CUDA(cudaStreamSynchronize(stream)) && NCCL(c, ncclCommGetAsyncError(c, &state))) {
      expect(state == ncclInvalidUsage, "asynchronous error: %s, expected ncclInvalidUsage", ncclGetErrorString(state));
      expect(strstr(ncclGetLastError(c), "runs in a CUDA graph") != NULL,
             "ncclGetLastError says \"%s\", expected it to mention \"runs in a CUDA graph\"", ncclGetLastError(c));
    }
  }
  if (exec) CUDA(cudaGraphExecDestroy(exec));
  if (graph) CUDA(cudaGraphDestroy(graph));
  if (c) NCCL(c, ncclCommAbort(c));
}

/* An all-reduce that can never complete (a peer is gone): polls until the communicator says so. */
static void expect_remote_error(ncclComm_t c) {
  float x[16] = {0};
  float *d = device_copy(x, sizeof x);
  ncclResult_t r = d ? ncclAllReduce(d, d, 16, ncclFloat, ncclSum, c, stream) : ncclSuccess;
  if (!d || !expect(r == ncclSuccess || r == ncclInProgress, "ncclAllReduce: %s", ncclGetErrorString(r))) return;
  double deadline = MPI_Wtime() + 30;
  for (;;) {
    cudaError_t q = cudaStreamQuery(stream); /* lets the all-reduce run: it checks its peers every 0.1 s */
    if (q != cudaSuccess && q != cudaErrorNotReady) {
      fail("cudaStreamQuery: %s", cudaGetErrorString(q));
      return;
    }
    ncclResult_t state = ncclSuccess;
    if (!NCCL(c, ncclCommGetAsyncError(c, &state))) return;
    if (state == ncclRemoteError) break;
    if (!expect(state == ncclSuccess || state == ncclInProgress, "asynchronous error: %s, expected ncclRemoteError",
                ncclGetErrorString(state)) ||
        !expect(MPI_Wtime() < deadline, "no ncclRemoteError 30 s after the peer aborted (the stream is %s)",
                q == cudaSuccess ? "idle" : "busy"))
      return;
    usleep(1000);
  }
  expect(strstr(ncclGetLastError(c), "rank 1") != NULL, "ncclGetLastError says \"%s\", expected it to name rank 1",
         ncclGetLastError(c));
}

static void peer_abort_shows_as_remote_error(void) {
  ncclComm_t c;
  ncclResult_t state = join(&c);
  int joined = expect(state == ncclSuccess, "initialisation ended in: %s", ncclGetErrorString(state));
  if (rank == 1 && c) {
    NCCL(c, ncclCommAbort(c));
    c = NULL;
  }
  MPI_Barrier(MPI_COMM_WORLD); /* rank 1 has aborted before the others start */
  if (joined && c) expect_remote_error(c);
  /* both survivors have seen rank 1's abort before either aborts (else one could see the other's first);
   * aborting cancels the all-reduce if it is still queued */
  MPI_Barrier(MPI_COMM_WORLD);
  if (c) NCCL(c, ncclCommAbort(c));
  CUDA(cudaStreamSynchronize(stream));
}

/* Run with GPUSIM_DEVICES=1: every rank is on device 0. */
static void duplicate_device_is_invalid_usage(void) {
  ncclComm_t c;
  ncclResult_t state = join(&c);
  expect(state == ncclInvalidUsage, "initialisation ended in: %s, expected ncclInvalidUsage",
         ncclGetErrorString(state));
  expect(strstr(ncclGetLastError(c), "Duplicate GPU detected") != NULL,
         "ncclGetLastError says \"%s\", expected it to mention \"Duplicate GPU detected\"", ncclGetLastError(c));
  if (c) NCCL(c, ncclCommAbort(c));
}

/* ---- the runner ------------------------------------------------------------------------- */

static int ntests, failures;

static void on_hang(int sig) {
  (void)sig;
  if (write(STDOUT_FILENO, hang_note, hang_len) < 0) { /* nothing else to do in a signal handler */
  }
  _exit(2);
}

/* Runs one test on every rank; rank 0 prints its TAP line, naming the lowest rank that failed.
 * Returns whether it passed (the same answer on every rank). */
static int run_test(const char *name, void (*test)(void)) {
  int n = ++ntests;
  why[0] = 0;
  snprintf(hang_note, sizeof hang_note, "Bail out! rank %d: test %d - %s still running after %d s\n", rank, n, name,
           HANG_S);
  hang_len = strlen(hang_note);
  alarm(HANG_S);
  test();
  alarm(0);
  if (!why[0]) /* after a failure queued work may still use them (freeing would be fatal): left */
    for (int i = 0; i < nbuffers; i++) CUDA(cudaFree(buffers[i]));
  nbuffers = 0;
  int first = why[0] ? rank : nranks;
  MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (first < nranks) MPI_Bcast(why, sizeof why, MPI_CHAR, first, MPI_COMM_WORLD);
  if (rank == 0) {
    if (first < nranks)
      printf("not ok %d - %s: rank %d: %s\n", n, name, first, why);
    else
      printf("ok %d - %s\n", n, name);
    fflush(stdout);
  }
  failures += first < nranks;
  return first == nranks;
}

static _Noreturn void bail_out(const char *reason) {
  printf("Bail out! rank %d: %s\n", rank, reason);
  fflush(stdout);
  MPI_Abort(MPI_COMM_WORLD, 1);
  exit(1);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  signal(SIGALRM, on_hang);
  const char *devices = getenv("GPUSIM_DEVICES");
  int duplicate = devices && !strcmp(devices, "1"); /* every rank on device 0 */
  if (duplicate ? nranks < 2 : nranks != 3)
    bail_out("run with mpirun -np 3 -x GPUSIM_DEVICES=3, or -np 2 (or more) -x GPUSIM_DEVICES=1");
  if (!CUDA(cudaSetDevice(duplicate ? 0 : rank)) || !CUDA(cudaStreamCreate(&stream))) bail_out(why);

  if (duplicate) {
    run_test("duplicate_device_is_invalid_usage", duplicate_device_is_invalid_usage);
  } else if (!run_test("unique_id_and_nonblocking_init", unique_id_and_nonblocking_init)) {
    if (rank == 0) printf("Bail out! no communicator to test with\n");
    fflush(stdout);
    MPI_Finalize();
    return 1;
  } else {
    run_test("all_reduce_sum_float_and_max_int", all_reduce_sum_float_and_max_int);
    run_test("large_all_reduce_spans_several_rounds", large_all_reduce_spans_several_rounds);
    run_test("reduce_scatter_all_gather_broadcast_reduce", reduce_scatter_all_gather_broadcast_reduce);
    run_test("group_calls_run_in_order", group_calls_run_in_order);
    run_test("collectives_in_a_graph_run_at_every_launch", collectives_in_a_graph_run_at_every_launch);
    run_test("results_are_bit_identical_on_every_rank", results_are_bit_identical_on_every_rank);
    run_test("host_buffer_is_an_invalid_argument", host_buffer_is_an_invalid_argument);
    run_test("mismatched_counts_are_detected", mismatched_counts_are_detected);
    run_test("captured_on_one_rank_only_is_detected", captured_on_one_rank_only_is_detected);
    run_test("peer_abort_shows_as_remote_error", peer_abort_shows_as_remote_error);
    /* a non-blocking ncclCommFinalize may answer ncclInProgress while it flushes: NCCL() polls */
    why[0] = 0;
    if (!NCCL(comm, ncclCommFinalize(comm)) || !NCCL(comm, ncclCommDestroy(comm))) {
      fprintf(stderr, "test_gpusim_nccl: rank %d: %s\n", rank, why);
      failures++;
    }
  }
  if (rank == 0) printf("1..%d\n", ntests);
  fflush(stdout);
  CUDA(cudaStreamDestroy(stream));
  MPI_Finalize();
  return failures ? 1 : 0;
}
