/* backend.c: the CUDA backend, the op interface on one GPU: the dt_backend of backend.h (device
 * memory, copies, the upload staging ring, graph capture), the op table and cuda_run. Owns the
 * cuda_impl: stream, cuBLAS and cuDNN handles, copy stream and events. The ops are in gemm.c
 * (cuBLAS), conv.c (cuDNN: the algorithm chosen once per shape from its heuristics) and ops.c
 * (everything else, through kernels/).
 * train.precision sets the math of GEMMs and convolutions: fp32 (FMA, no TF32: results follow the
 * CPU reference to float rounding), tf32, or bf16/fp16 (GEMM inputs rounded on tensor cores,
 * under bf16 a large GEMM's operands copied to bfloat16 first; convolution operands copied to
 * 16-bit NHWC; under bf16 from compute capability 8.0 the fused attention's tile products too);
 * accumulation, storage and every other op stay FP32.
 * All work is queued on one stream and no op waits on the host, so a training step can be
 * captured as a CUDA graph (capture_begin/capture_end/replay; a buffer outgrown mid-capture is
 * retired until the stream drains, and the generation bump makes the owner capture again).
 * upload() copies host data through a pinned staging ring (two halves, each reused once its
 * copies are done), so the caller's buffer may change as soon as it returns. Checked on the CPU
 * stand-in (tests/gpusim) in every `make test`; see the README for what only a real GPU can show. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_impl.h"

/* A failed allocation: out of memory gets the batch-size advice; any other error (a sticky one
 * left by earlier asynchronous work) is reported as it is. */
static _Noreturn void alloc_failed(const cuda_impl *im, cudaError_t err, size_t need, const char *what) {
  size_t free_b = 0, total_b = 0;
  cudaGetLastError(); /* reported here, not again by the next check */
  if (err != cudaErrorMemoryAllocation) {
    char call[256];
    snprintf(call, sizeof call, "cudaMalloc of %zu bytes (%s) on device %d", need, what, im->device);
    cuda_failed(err, call, NULL, __FILE__, __LINE__);
  }
  cudaMemGetInfo(&free_b, &total_b);
  dt_die(
      "out of GPU memory on device %d allocating %zu bytes (%.1f MiB) of %s (%.1f MiB free of %.1f); lower "
      "train.batch_size or train.global_batch_size, or use more ranks",
      im->device, need, (double)need / 1048576.0, what, (double)free_b / 1048576.0, (double)total_b / 1048576.0);
}

cudaError_t cuda_device_malloc(cuda_impl *im, void **p, size_t bytes) {
  cudaError_t err = cudaMalloc(p, bytes);
  if (err != cudaSuccess || !*p) return err;
  if (im->n_blocks == im->cap_blocks) {
    im->cap_blocks = im->cap_blocks ? 2 * im->cap_blocks : 256;
    im->blocks = dt_realloc(im->blocks, (size_t)im->cap_blocks * sizeof *im->blocks);
  }
  im->blocks[im->n_blocks++] = (cuda_block){*p, bytes};
  backend_count_device(im->be, (int64_t)bytes);
  return cudaSuccess;
}

void cuda_device_free(cuda_impl *im, void *p) {
  if (!p) return;
  int i = im->n_blocks - 1; /* the newest first: a grown scratch buffer is among them */
  while (i >= 0 && im->blocks[i].p != p) i--;
  DT_ASSERT(i >= 0); /* not from cuda_device_malloc: a bug */
  backend_count_device(im->be, -(int64_t)im->blocks[i].bytes);
  im->blocks[i] = im->blocks[--im->n_blocks];
  CUDA_CHECK(cudaFree(p));
}

/* Frees the buffers retired during a capture, once no queued work can use them. */
static void free_retired(cuda_impl *im) {
  for (; im->n_retired > 0; im->n_retired--) cuda_device_free(im, im->retired[im->n_retired - 1]);
}

/* Waits for the stream's work, then frees the buffers retired during a capture. */
static void drain(cuda_impl *im) {
  CUDA_CHECK(cudaStreamSynchronize(im->copy));
  CUDA_CHECK(cudaStreamSynchronize(im->stream));
  free_retired(im);
}

void cuda_forget_dy16(cuda_impl *im) {
  im->dy16_of = NULL;
}

int cuda_dy16_held(const cuda_impl *im, const float *dy, const uint16_t *at, const int64_t layout[4]) {
  return im->dy16_of == dy && im->dy16_at == at && !memcmp(im->dy16_layout, layout, sizeof im->dy16_layout);
}

void cuda_hold_dy16(cuda_impl *im, const float *dy, const uint16_t *at, const int64_t layout[4]) {
  im->dy16_of = dy, im->dy16_at = at;
  memcpy(im->dy16_layout, layout, sizeof im->dy16_layout);
}

/* Grows a device buffer to `need` bytes. Work queued earlier may still use the old buffer, so the
 * stream is drained before it is freed (cudaFree does not promise to wait for it); during a
 * capture (which cannot wait) the old buffer is retired instead, kept until the graph has run. */
void *cuda_grow_device(cuda_impl *im, void **buf, size_t *have, size_t need, const char *what) {
  if (need <= *have) return *buf;
  im->be->generation++; /* work captured with the old buffer must be captured again */
  if (*buf == im->h16) cuda_forget_dy16(im); /* a new h16 may start where the old one did */
  if (*buf) {
    if (im->capturing) {
      DT_ASSERT(im->n_retired < (int)(sizeof im->retired / sizeof im->retired[0]));
      im->retired[im->n_retired++] = *buf;
      im->retired_after = im->marks_made;
    } else {
      drain(im);
      cuda_device_free(im, *buf);
    }
    *buf = NULL;
    *have = 0;
  }
  cudaError_t err = cuda_device_malloc(im, buf, need);
  if (err != cudaSuccess) alloc_failed(im, err, need, what);
  *have = need;
  return *buf;
}

static void wait_half(cuda_impl *im, int h) {
  for (int q = 0; q < 2; q++) CUDA_CHECK(cudaEventSynchronize(im->staged[h][q]));
}

/* Queues a copy of host bytes to dst through the pinned staging ring on queue q (0: the stream,
 * 1: the copy stream): the copy reads a pinned snapshot, so src may change as soon as this
 * returns. A half is refilled only once the copies out of it are done (events, long passed in a
 * steady loop). */
static void stage_copy(cuda_impl *im, void *dst, const void *src, size_t bytes, int q) {
  cudaStream_t s = q ? im->copy : im->stream;
  size_t need = align256(bytes);
  if (need > im->stage_half) { /* grow: wait for every copy out of the ring, then replace it */
    for (int h = 0; h < 2; h++) wait_half(im, h);
    if (im->stage) CUDA_CHECK(cudaFreeHost(im->stage));
    size_t half = (size_t)1 << 20;
    while (half < need) half *= 2;
    cudaError_t err = cudaMallocHost((void **)&im->stage, 2 * half);
    if (err != cudaSuccess) {
      cudaGetLastError();
      dt_die("cudaMallocHost of %zu bytes of pinned upload staging failed: %s (%s)", 2 * half, cudaGetErrorString(err),
             cudaGetErrorName(err));
    }
    im->stage_half = half;
    im->stage_used = 0;
    im->stage_cur = 0;
  } else if (im->stage_used + need > im->stage_half) { /* the other half, once its copies are done */
    im->stage_cur ^= 1;
    im->stage_used = 0;
    wait_half(im, im->stage_cur);
  }
  char *at = im->stage + (size_t)im->stage_cur * im->stage_half + im->stage_used;
  memcpy(at, src, bytes);
  im->stage_used += need;
  CUDA_CHECK(cudaMemcpyAsync(dst, at, bytes, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaEventRecord(im->staged[im->stage_cur][q], s));
}

static void cuda_upload(dt_backend *be, void *dst, const void *src, size_t bytes) {
  cuda_forget_dy16(be->impl);
  if (bytes) stage_copy(be->impl, dst, src, bytes, 0);
}

/* On the copy stream, so it overlaps work already queued (the caller guarantees none of it uses
 * dst, but for the memset that cleared dst when it was allocated: the copy waits for that); the
 * stream waits for it before the work queued next. */
static void cuda_upload_ahead(dt_backend *be, void *dst, const void *src, size_t bytes) {
  cuda_impl *im = be->impl;
  cuda_forget_dy16(im);
  if (!bytes) return;
  CUDA_CHECK(cudaStreamWaitEvent(im->copy, im->cleared, 0));
  stage_copy(im, dst, src, bytes, 1);
  CUDA_CHECK(cudaEventRecord(im->copied, im->copy));
  CUDA_CHECK(cudaStreamWaitEvent(im->stream, im->copied, 0));
}

/* dst: pinned host memory from cuda_alloc_host; valid once a later mark is reached. */
static void cuda_download(dt_backend *be, void *dst, const void *src, size_t bytes) {
  cuda_impl *im = be->impl;
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, im->stream));
}

static void cuda_mark(dt_backend *be, int slot) {
  cuda_impl *im = be->impl;
  CUDA_CHECK(cudaEventRecord(im->marks[slot], im->stream));
  im->mark_seq[slot] = ++im->marks_made;
}

/* A mark recorded after buffers were retired, once reached, says that the work queued before the
 * capture that retired them (the only work that used them) is done: they are freed then, though
 * later steps may run. */
static int cuda_reached(dt_backend *be, int slot) {
  cuda_impl *im = be->impl;
  cudaError_t q = cudaEventQuery(im->marks[slot]);
  if (q == cudaErrorNotReady) return 0;
  CUDA_CHECK_AS(q, "cudaEventQuery(im->marks[slot])");
  if (im->mark_seq[slot] > im->retired_after) free_retired(im);
  return 1;
}

static void *cuda_alloc_host(dt_backend *be, size_t bytes) {
  (void)be;
  void *p = NULL;
  cudaError_t err = cudaMallocHost(&p, bytes ? bytes : 1);
  if (err != cudaSuccess) {
    cudaGetLastError();
    dt_die("cudaMallocHost of %zu bytes failed: %s (%s)", bytes, cudaGetErrorString(err), cudaGetErrorName(err));
  }
  memset(p, 0, bytes ? bytes : 1);
  return p;
}

static void cuda_free_host(dt_backend *be, void *p) {
  cuda_impl *im = be->impl;
  if (!p) return;
  CUDA_CHECK(cudaStreamSynchronize(im->stream)); /* queued copies may still read or write it */
  CUDA_CHECK(cudaFreeHost(p));
}

/* cuda_<name> for each X(NAME, name) of DT_OPS */
typedef void (*cuda_op_fn)(cuda_impl *im, const dt_op *op);
static const cuda_op_fn cuda_ops[DT_OP_COUNT] = {
#define CUDA_OP_(NAME, name) [DT_OP_##NAME] = cuda_##name,
    DT_OPS(CUDA_OP_)
#undef CUDA_OP_
};

/* Queues the op on the stream; a kernel launch that failed is reported as it returns, naming the op (under
 * CUDA_LAUNCH_BLOCKING=1, a kernel that faults too). */
static void cuda_run(dt_backend *be, const dt_op *op) {
  DT_ASSERT(op->type >= 0 && op->type < DT_OP_COUNT);
  /* a backward data or a GEMM may reuse the 16-bit dy that the op before it packed */
  if (op->type != DT_OP_CONV_BWD_DATA && op->type != DT_OP_GEMM) cuda_forget_dy16(be->impl);
  cuda_ops[op->type](be->impl, op);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    char call[96];
    snprintf(call, sizeof call, "cudaGetLastError() after the %s op", dt_op_names[op->type]);
    cuda_failed(e, call, NULL, __FILE__, __LINE__);
  }
}

static float *cuda_alloc(dt_backend *be, size_t bytes) {
  cuda_impl *im = be->impl;
  void *p = NULL;
  cuda_forget_dy16(im); /* the new buffer may start where a freed one, a held dy, did */
  cudaError_t err = cuda_device_malloc(im, &p, bytes ? bytes : 256);
  if (err != cudaSuccess) alloc_failed(im, err, bytes, "model buffers");
  CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, im->stream));
  CUDA_CHECK(cudaEventRecord(im->cleared, im->stream));
  return p;
}

/* Buffers are freed at shut-down, after work that may still use them: drain the stream first. */
static void cuda_free(dt_backend *be, void *p) {
  cuda_impl *im = be->impl;
  if (!p) return;
  drain(im);
  cuda_device_free(im, p);
}

/* cudaMemcpyDefault: host or device on either side (unified addressing). Synchronous with the
 * stream, so host buffers may be reused at once. */
static void cuda_copy_bytes(dt_backend *be, void *dst, const void *src, size_t bytes) {
  cuda_impl *im = be->impl;
  cuda_forget_dy16(im);
  if (!bytes) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, im->stream));
  CUDA_CHECK(cudaStreamSynchronize(im->stream));
}

static void cuda_zero(dt_backend *be, void *p, size_t bytes) {
  cuda_impl *im = be->impl;
  cuda_forget_dy16(im);
  CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, im->stream));
}

static void cuda_sync(dt_backend *be) {
  drain(be->impl);
}

/* Relaxed capture: a buffer that must grow mid-capture may still be allocated (cuda_grow_device). */
static void cuda_capture_begin(dt_backend *be) {
  cuda_impl *im = be->impl;
  DT_ASSERT(!im->capturing);
  cuda_forget_dy16(im); /* what was packed before the capture is not in the graph */
  CUDA_CHECK(cudaStreamBeginCapture(im->stream, cudaStreamCaptureModeRelaxed));
  im->capturing = 1;
}

static void *cuda_capture_end(dt_backend *be) {
  cuda_impl *im = be->impl;
  DT_ASSERT(im->capturing);
  cuda_forget_dy16(im);
  cudaGraph_t graph = NULL;
  im->capturing = 0;
  CUDA_CHECK(cudaStreamEndCapture(im->stream, &graph));
  cudaGraphExec_t exec = NULL;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return exec;
}

static void cuda_replay(dt_backend *be, void *graph) {
  cuda_impl *im = be->impl;
  cuda_forget_dy16(im); /* the graph's convolutions reuse h16 */
  CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph, im->stream));
}

static void cuda_graph_free(dt_backend *be, void *graph) {
  if (!graph) return;
  drain(be->impl);
  CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)graph));
}

void cuda_note(cuda_impl *im, const char *line) {
  size_t have = im->notes ? strlen(im->notes) : 0, add = strlen(line);
  im->notes = dt_realloc(im->notes, have + add + 1);
  memcpy(im->notes + have, line, add + 1);
}

static char *cuda_take_notes(dt_backend *be) {
  cuda_impl *im = be->impl;
  char *notes = im->notes;
  im->notes = NULL;
  return notes;
}

static size_t cuda_scratch(dt_backend *be, const dt_op *ops, int n) {
  cuda_impl *im = be->impl;
  size_t workspace = 0, h16 = 0, partials = 0, tickets = 0;
  for (int i = 0; i < n; i++) {
    const dt_op *op = &ops[i];
    const size_t p = cuda_partials_bytes(op), t = cuda_tickets_bytes(op);
    if (p > partials) partials = p;
    if (t > tickets) tickets = t;
    if (op->type == DT_OP_CONV_FWD) cuda_conv_scratch(im, &op->p.conv_fwd.g, op->p.conv_fwd.w16, &workspace, &h16);
    if (op->type == DT_OP_CONV_BWD_DATA)
      cuda_conv_scratch(im, &op->p.conv_bwd_data.g, op->p.conv_bwd_data.w16, &workspace, &h16);
    if (op->type == DT_OP_CONV_BWD_FILTER)
      cuda_conv_scratch(im, &op->p.conv_bwd_filter.g, op->p.conv_bwd_filter.dw16, &workspace, &h16);
    if (op->type == DT_OP_GEMM && cuda_gemm16_bytes(im, op) > h16) h16 = cuda_gemm16_bytes(im, op);
    if (op->type == DT_OP_GEMM && cuda_gemm_workspace(op) > workspace) workspace = cuda_gemm_workspace(op);
  }
  return workspace + h16 + partials + tickets;
}

static void cuda_destroy(dt_backend *be) {
  cuda_impl *im = be->impl;
  drain(im);
  free(im->notes);
  cuda_conv_free(im);
  cuda_gemm_free(im);
  if (im->stage) CUDA_CHECK(cudaFreeHost(im->stage));
  for (int h = 0; h < 2; h++)
    for (int q = 0; q < 2; q++) CUDA_CHECK(cudaEventDestroy(im->staged[h][q]));
  CUDA_CHECK(cudaEventDestroy(im->copied));
  CUDA_CHECK(cudaEventDestroy(im->cleared));
  for (int i = 0; i < 2; i++) CUDA_CHECK(cudaEventDestroy(im->marks[i]));
  CUDA_CHECK(cudaStreamDestroy(im->copy));
  cuda_device_free(im, im->partials);
  cuda_device_free(im, im->tickets);
  CUDNN_CHECK(cudnnDestroy(im->dnn));
  CUBLAS_CHECK(cublasLtDestroy(im->lt));
  CUBLAS_CHECK(cublasDestroy(im->blas));
  CUDA_CHECK(cudaStreamDestroy(im->stream));
  free(im->blocks);
  free(im);
  free(be);
}

int64_t backend_cuda_dy16_reuses(const dt_backend *be) {
  return ((const cuda_impl *)be->impl)->dy16_reuses;
}

int64_t backend_cuda_col_sums_copied(const dt_backend *be) {
  return ((const cuda_impl *)be->impl)->col_sums_copied;
}

int64_t backend_cuda_gemm_epilogues(const dt_backend *be) {
  return ((const cuda_impl *)be->impl)->gemm_epilogues;
}

dt_backend *backend_cuda_create(int device, int precision) {
  dt_backend *be = dt_calloc(1, sizeof *be);
  cuda_impl *im = dt_calloc(1, sizeof *im);
  im->device = device;
  im->precision = precision;
  const double t0 = dt_now(); /* start-up's "device" phase, for the log: where it goes */
  CUDA_CHECK(cudaSetDevice(device));
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  im->cc = major * 10 + minor;
  if (precision == DT_PREC_BF16 && im->cc >= 80) CUDA_CHECK(k_attention_tensor_cores_built(&im->attention_tc));
  CUDA_CHECK(cudaStreamCreateWithFlags(&im->stream, cudaStreamNonBlocking));
  const double t_context = dt_now();
  CUBLAS_CHECK(cublasCreate(&im->blas));
  CUBLAS_CHECK(cublasSetStream(im->blas, im->stream));
  /* fp32: the FP32 reference, no TF32; otherwise the GEMM's compute type decides */
  CUBLAS_CHECK(cublasSetMathMode(im->blas, precision == DT_PREC_FP32 ? CUBLAS_PEDANTIC_MATH : CUBLAS_DEFAULT_MATH));
  CUBLAS_CHECK(cublasLtCreate(&im->lt));
  const double t_blas = dt_now();
  CUDNN_CHECK(cudnnCreate(&im->dnn));
  CUDNN_CHECK(cudnnSetStream(im->dnn, im->stream));
  const double t_dnn = dt_now();
  CUDA_CHECK(cudaStreamCreateWithFlags(&im->copy, cudaStreamNonBlocking));
  for (int h = 0; h < 2; h++)
    for (int q = 0; q < 2; q++) CUDA_CHECK(cudaEventCreateWithFlags(&im->staged[h][q], cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&im->copied, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&im->cleared, cudaEventDisableTiming));
  for (int i = 0; i < 2; i++) CUDA_CHECK(cudaEventCreateWithFlags(&im->marks[i], cudaEventDisableTiming));
  char line[160];
  snprintf(line, sizeof line, "cuda: GPU %d set up in %.3f s (context %.3f, cuBLAS and cuBLASLt %.3f, cuDNN %.3f)\n",
           device, dt_now() - t0, t_context - t0, t_blas - t_context, t_dnn - t_blas);
  cuda_note(im, line);
  im->be = be;
  *be = (dt_backend){.name = "cuda",
                     .run = cuda_run,
                     .alloc = cuda_alloc,
                     .free = cuda_free,
                     .to_device = cuda_copy_bytes,
                     .to_host = cuda_copy_bytes,
                     .upload = cuda_upload,
                     .upload_ahead = cuda_upload_ahead,
                     .download = cuda_download,
                     .mark = cuda_mark,
                     .reached = cuda_reached,
                     .alloc_host = cuda_alloc_host,
                     .free_host = cuda_free_host,
                     .zero = cuda_zero,
                     .capture_begin = cuda_capture_begin,
                     .capture_end = cuda_capture_end,
                     .replay = cuda_replay,
                     .graph_free = cuda_graph_free,
                     .sync = cuda_sync,
                     .destroy = cuda_destroy,
                     .take_notes = cuda_take_notes,
                     .scratch = cuda_scratch,
                     .threads = 1,
                     .host_memory = 0,
                     .stream = im->stream,
                     .impl = im};
  return be;
}
