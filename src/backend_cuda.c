/* backend_cuda.c: the op interface on one GPU. GEMM through cuBLAS, convolutions through cuDNN
 * (the algorithm chosen once per shape from cuDNN's heuristics: deterministic, within a workspace
 * limit, no per-run benchmarking), everything else through kernels/ (kernels.h).
 * train.precision sets the math of GEMMs and convolutions: fp32 (FMA, no TF32: results follow the
 * CPU reference to float rounding), tf32, or bf16/fp16 (GEMM inputs rounded on tensor cores;
 * convolution operands copied to 16-bit NHWC); accumulation, storage and every other op stay FP32.
 * All work is queued on one stream and no op waits on the host, so a training step can be
 * captured as a CUDA graph (capture_begin/capture_end/replay; a buffer outgrown mid-capture is
 * retired until the stream drains, and the generation bump makes the owner capture again).
 * upload() copies host data through a pinned staging ring (two halves, each reused once its
 * copies are done), so the caller's buffer may change as soon as it returns. Checked on the CPU
 * stand-in (tests/gpusim) in every `make test`; see the README for what only a real GPU can show. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cuda_check.h"
#include "kernels.h"

static const size_t workspace_limit = (size_t)512 << 20;

/* One convolution shape: descriptors and the three algorithms, each direction with its own
 * convolution descriptor (set to the math type of the kernels chosen for it). FP32 NCHW, or 16-bit
 * NHWC under train.precision bf16 and fp16. */
enum { FWD, BWD_DATA, BWD_FILTER };
typedef struct {
  dt_conv_geom g;
  cudnnTensorDescriptor_t x, y;
  cudnnFilterDescriptor_t w;
  cudnnConvolutionDescriptor_t conv[3];
  int algo[3]; /* cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t */
  cudnnMathType_t math[3];
  size_t ws_bytes;
} conv_plan;

typedef struct {
  dt_backend *be; /* owner: its generation is bumped when an internal buffer moves */
  int device;
  int precision; /* DT_PREC_*: the math of GEMMs and convolutions */
  cudaStream_t stream;
  cublasHandle_t blas;
  cudnnHandle_t dnn;
  conv_plan *plans; /* one per convolution shape and batch size seen: grows */
  int n_plans;
  char *notes; /* the plans made since take_notes last took them, a line each (dt_malloc'd), or NULL */
  void *workspace;
  size_t workspace_bytes;
  uint16_t *h16; /* device: a convolution's operands in 16 bits (bf16, fp16) */
  size_t h16_bytes;
  double *partials; /* device: per-block or per-sample pairs, summed in a fixed order */
  size_t partials_bytes;
  char *stage;              /* pinned host staging for upload(): two halves of stage_half bytes */
  size_t stage_half;        /* bytes in each half */
  size_t stage_used;        /* bytes used in the current half */
  int stage_cur;            /* the half being filled */
  cudaEvent_t staged[2][2]; /* [half][queue: 0 the stream, 1 copy]: after the last copy out of each half */
  cudaStream_t copy;        /* upload_ahead's copies, overlapping the stream's work */
  cudaEvent_t copied;       /* the last upload_ahead: the stream waits for it */
  cudaEvent_t cleared;      /* after the last allocation's memset on the stream: copies wait for it */
  int capturing;            /* between capture_begin and capture_end */
  void *retired[8];         /* buffers outgrown during a capture: freed once the stream drains */
  int n_retired;
} cuda_impl;

/* A failed allocation: out of memory gets the batch-size advice; any other error (a sticky one
 * left by earlier asynchronous work) is reported as it is. */
static _Noreturn void alloc_failed(const cuda_impl *im, cudaError_t err, size_t need, const char *what) {
  size_t free_b = 0, total_b = 0;
  cudaGetLastError(); /* reported here, not again by the next check */
  if (err != cudaErrorMemoryAllocation) {
    char w[512];
    snprintf(w, sizeof w, "cudaMalloc of %zu bytes (%s) on device %d failed: %s (%s)", need, what, im->device,
             cudaGetErrorString(err), cudaGetErrorName(err));
    dt_abort(__FILE__, __LINE__, w);
  }
  cudaMemGetInfo(&free_b, &total_b);
  dt_die(
      "out of GPU memory on device %d allocating %zu bytes (%.1f MiB) of %s (%.1f MiB free of %.1f); lower "
      "train.batch_size or train.global_batch_size, or use more ranks",
      im->device, need, (double)need / 1048576.0, what, (double)free_b / 1048576.0, (double)total_b / 1048576.0);
}

/* Waits for the stream's work, then frees the buffers retired during a capture. */
static void drain(cuda_impl *im) {
  CUDA_CHECK(cudaStreamSynchronize(im->copy));
  CUDA_CHECK(cudaStreamSynchronize(im->stream));
  for (; im->n_retired > 0; im->n_retired--) CUDA_CHECK(cudaFree(im->retired[im->n_retired - 1]));
}

/* Grows a device buffer to `need` bytes. Work queued earlier may still use the old buffer, so the
 * stream is drained before it is freed (cudaFree does not promise to wait for it); during a
 * capture (which cannot wait) the old buffer is retired instead, kept until the graph has run. */
static void *grow_device(cuda_impl *im, void **buf, size_t *have, size_t need, const char *what) {
  if (need <= *have) return *buf;
  im->be->generation++; /* work captured with the old buffer must be captured again */
  if (*buf) {
    if (im->capturing) {
      DT_ASSERT(im->n_retired < (int)(sizeof im->retired / sizeof im->retired[0]));
      im->retired[im->n_retired++] = *buf;
    } else {
      drain(im);
      CUDA_CHECK(cudaFree(*buf));
    }
    *buf = NULL;
    *have = 0;
  }
  cudaError_t err = cudaMalloc(buf, need);
  if (err != cudaSuccess) alloc_failed(im, err, need, what);
  *have = need;
  return *buf;
}

static size_t align256(size_t n) {
  return (n + 255) & ~(size_t)255;
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
  if (bytes) stage_copy(be->impl, dst, src, bytes, 0);
}

/* On the copy stream, so it overlaps work already queued (the caller guarantees none of it uses
 * dst, but for the memset that cleared dst when it was allocated: the copy waits for that); the
 * stream waits for it before the work queued next. */
static void cuda_upload_ahead(dt_backend *be, void *dst, const void *src, size_t bytes) {
  cuda_impl *im = be->impl;
  if (!bytes) return;
  CUDA_CHECK(cudaStreamWaitEvent(im->copy, im->cleared, 0));
  stage_copy(im, dst, src, bytes, 1);
  CUDA_CHECK(cudaEventRecord(im->copied, im->copy));
  CUDA_CHECK(cudaStreamWaitEvent(im->stream, im->copied, 0));
}

/* dst: pinned host memory from cuda_alloc_host; valid once cuda_done says so. */
static void cuda_download(dt_backend *be, void *dst, const void *src, size_t bytes) {
  cuda_impl *im = be->impl;
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, im->stream));
}

static int cuda_done(dt_backend *be) {
  cuda_impl *im = be->impl;
  cudaError_t q = cudaStreamQuery(im->stream);
  if (q == cudaErrorNotReady) return 0;
  CUDA_CHECK(q);
  if (im->n_retired) drain(im);
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

static const char *const direction_names[] = {"forward", "backward data", "backward filter"};

static _Noreturn void no_algorithm(const cuda_impl *im, const dt_conv_geom *g, int dir) {
  static const char *const precision_names[] = {"fp32 (FMA kernels)", "tf32", "bf16", "fp16"};
  dt_die(
      "cuDNN offers no deterministic %s algorithm for train.precision %s within %zu MiB for the convolution of "
      "(%lld, %lld, %lld, %lld) by (%lld, %lld, %lld, %lld), stride %lld, pad %lld",
      direction_names[dir], precision_names[im->precision], workspace_limit >> 20, (long long)g->b, (long long)g->c,
      (long long)g->h, (long long)g->w, (long long)g->o, (long long)g->c, (long long)g->k, (long long)g->k,
      (long long)g->stride, (long long)g->pad);
}

static int is16(const cuda_impl *im) {
  return im->precision == DT_PREC_BF16 || im->precision == DT_PREC_FP16;
}

/* The math type asked of cuDNN: FP32 FMA, else tensor cores (TF32 for FP32 data from 8.0 on). */
static cudnnMathType_t conv_math(const cuda_impl *im) {
  return im->precision == DT_PREC_FP32 ? CUDNN_FMA_MATH : CUDNN_TENSOR_OP_MATH;
}

/* Kernels of a math type this run may use, as cuDNN reports it per algorithm: fp32 only FMA
 * kernels (never TF32); otherwise tensor-core, default or FMA kernels. cuDNN reports the default
 * kernels where a shape has no tensor-core ones (16-bit data with 1 or 3 channels: a first layer). */
static int math_allowed(const cuda_impl *im, cudnnMathType_t math) {
  if (im->precision == DT_PREC_FP32) return math == CUDNN_FMA_MATH;
  return math == CUDNN_FMA_MATH || math == CUDNN_DEFAULT_MATH || math == CUDNN_TENSOR_OP_MATH;
}

static const char *math_name(cudnnMathType_t math) {
  return math == CUDNN_TENSOR_OP_MATH ? "tensor cores" : math == CUDNN_FMA_MATH ? "FMA" : "default kernels";
}

/* One algorithm the heuristics offer for a direction. */
typedef struct {
  int algo;
  cudnnStatus_t status;
  cudnnDeterminism_t determinism;
  cudnnMathType_t math;
} conv_candidate;

enum { MAX_CANDIDATES = 64 };

/* The heuristics' list for direction dir, fastest first, into c (MAX_CANDIDATES); returns its length. */
static int conv_candidates(cuda_impl *im, conv_plan *p, int dir, conv_candidate *c) {
  int max = 0, n = 0;
  if (dir == FWD) {
    cudnnConvolutionFwdAlgoPerf_t perf[MAX_CANDIDATES];
    CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(im->dnn, &max));
    CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(im->dnn, p->x, p->w, p->conv[dir], p->y,
                                                       max < MAX_CANDIDATES ? max : MAX_CANDIDATES, &n, perf));
    for (int i = 0; i < n; i++)
      c[i] = (conv_candidate){perf[i].algo, perf[i].status, perf[i].determinism, perf[i].mathType};
  } else if (dir == BWD_DATA) {
    cudnnConvolutionBwdDataAlgoPerf_t perf[MAX_CANDIDATES];
    CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(im->dnn, &max));
    CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(im->dnn, p->w, p->y, p->conv[dir], p->x,
                                                            max < MAX_CANDIDATES ? max : MAX_CANDIDATES, &n, perf));
    for (int i = 0; i < n; i++)
      c[i] = (conv_candidate){perf[i].algo, perf[i].status, perf[i].determinism, perf[i].mathType};
  } else {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[MAX_CANDIDATES];
    CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(im->dnn, &max));
    CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(im->dnn, p->x, p->y, p->conv[dir], p->w,
                                                              max < MAX_CANDIDATES ? max : MAX_CANDIDATES, &n, perf));
    for (int i = 0; i < n; i++)
      c[i] = (conv_candidate){perf[i].algo, perf[i].status, perf[i].determinism, perf[i].mathType};
  }
  return n;
}

/* The workspace of algo for direction dir with the math type set on its descriptor now. */
static cudnnStatus_t conv_workspace(cuda_impl *im, conv_plan *p, int dir, int algo, size_t *ws) {
  if (dir == FWD)
    return cudnnGetConvolutionForwardWorkspaceSize(im->dnn, p->x, p->w, p->conv[dir], p->y,
                                                   (cudnnConvolutionFwdAlgo_t)algo, ws);
  if (dir == BWD_DATA)
    return cudnnGetConvolutionBackwardDataWorkspaceSize(im->dnn, p->w, p->y, p->conv[dir], p->x,
                                                        (cudnnConvolutionBwdDataAlgo_t)algo, ws);
  return cudnnGetConvolutionBackwardFilterWorkspaceSize(im->dnn, p->x, p->y, p->conv[dir], p->w,
                                                        (cudnnConvolutionBwdFilterAlgo_t)algo, ws);
}

/* The first usable algorithm in the heuristics' order (fastest first): it runs, it is
 * deterministic (bit-identical resume and N-rank equivalence need the same sums on every run), its
 * kernels' math type is one this precision allows, and its workspace fits the limit, asked for
 * with that math type set on the descriptor (the size depends on it), where it stays. */
static void choose_algorithm(cuda_impl *im, conv_plan *p, int dir) {
  conv_candidate c[MAX_CANDIDATES];
  const int n = conv_candidates(im, p, dir, c);
  for (int i = 0; i < n; i++) {
    size_t ws = 0;
    if (c[i].status != CUDNN_STATUS_SUCCESS || c[i].determinism != CUDNN_DETERMINISTIC || !math_allowed(im, c[i].math))
      continue;
    CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv[dir], c[i].math));
    if (conv_workspace(im, p, dir, c[i].algo, &ws) != CUDNN_STATUS_SUCCESS || ws > workspace_limit) continue;
    p->algo[dir] = c[i].algo;
    p->math[dir] = c[i].math;
    if (ws > p->ws_bytes) p->ws_bytes = ws;
    return;
  }
  no_algorithm(im, &p->g, dir);
}

/* A line about a new plan for the log (take_notes): the shape and each direction's choice. */
static void note_plan(cuda_impl *im, const conv_plan *p) {
  static const char *const precision_names[] = {"fp32", "tf32", "bf16 NHWC", "fp16 NHWC"};
  const dt_conv_geom *g = &p->g;
  char line[512];
  snprintf(
      line, sizeof line,
      "cudnn: conv (%lld, %lld, %lld, %lld) by (%lld, %lld, %lld, %lld) stride %lld pad %lld, %s: forward algorithm "
      "%d (%s), backward data %d (%s), backward filter %d (%s), workspace %.1f MiB\n",
      (long long)g->b, (long long)g->c, (long long)g->h, (long long)g->w, (long long)g->o, (long long)g->c,
      (long long)g->k, (long long)g->k, (long long)g->stride, (long long)g->pad, precision_names[im->precision],
      p->algo[FWD], math_name(p->math[FWD]), p->algo[BWD_DATA], math_name(p->math[BWD_DATA]), p->algo[BWD_FILTER],
      math_name(p->math[BWD_FILTER]), (double)p->ws_bytes / 1048576.0);
  size_t have = im->notes ? strlen(im->notes) : 0, add = strlen(line);
  im->notes = dt_realloc(im->notes, have + add + 1);
  memcpy(im->notes + have, line, add + 1);
}

static conv_plan *plan_for(cuda_impl *im, const dt_conv_geom *g) {
  for (int i = 0; i < im->n_plans; i++)
    if (!memcmp(&im->plans[i].g, g, sizeof *g)) return &im->plans[i];
  im->plans = dt_realloc(im->plans, (size_t)(im->n_plans + 1) * sizeof *im->plans);
  conv_plan *p = &im->plans[im->n_plans++];
  memset(p, 0, sizeof *p);
  p->g = *g;
  const cudnnDataType_t type = im->precision == DT_PREC_BF16   ? CUDNN_DATA_BFLOAT16
                               : im->precision == DT_PREC_FP16 ? CUDNN_DATA_HALF
                                                               : CUDNN_DATA_FLOAT;
  const cudnnTensorFormat_t layout = is16(im) ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y));
  CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, layout, type, (int)g->b, (int)g->c, (int)g->h, (int)g->w));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, layout, type, (int)g->b, (int)g->o, (int)g->ho, (int)g->wo));
  CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, type, layout, (int)g->o, (int)g->c, (int)g->k, (int)g->k));
  for (int d = 0; d < 3; d++) {
    CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&p->conv[d]));
    CUDNN_CHECK(cudnnSetConvolution2dDescriptor(p->conv[d], (int)g->pad, (int)g->pad, (int)g->stride, (int)g->stride, 1,
                                                1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv[d], conv_math(im))); /* what the heuristics may offer */
    choose_algorithm(im, p, d);
  }
  grow_device(im, &im->workspace, &im->workspace_bytes, p->ws_bytes ? p->ws_bytes : 1, "cuDNN workspace");
  note_plan(im, p);
  return p;
}

/* A convolution's three operands in 16 bits, NHWC, in im->h16: (b, c, h, w), (o, c, k, k) and
 * (b, o, ho, wo), each 256-byte aligned. */
typedef struct {
  uint16_t *x, *w, *y;
} conv16;

static conv16 conv16_scratch(cuda_impl *im, const dt_conv_geom *g) {
  size_t nx = align256((size_t)(g->b * g->c * g->h * g->w) * 2), nw = align256((size_t)(g->o * g->c * g->k * g->k) * 2);
  size_t ny = align256((size_t)(g->b * g->o * g->ho * g->wo) * 2);
  char *base = grow_device(im, (void **)&im->h16, &im->h16_bytes, nx + nw + ny, "16-bit convolution operands");
  return (conv16){.x = (uint16_t *)base, .w = (uint16_t *)(base + nx), .y = (uint16_t *)(base + nx + nw)};
}

/* The three convolution ops. FP32: cuDNN on the tensors as they are (NCHW). bf16 and fp16: the
 * operands are rounded into 16-bit NHWC copies, cuDNN computes with FP32 accumulation on tensor
 * cores, and the result comes back to FP32 NCHW (the filter gradient added into dw, as FP32). */
static void cuda_conv_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.conv_fwd) *q = &op->p.conv_fwd;
  const dt_conv_geom *g = &q->g;
  const float one = 1.0f, zero = 0.0f;
  if (!g->b) return; /* cuDNN refuses zero-sized tensors */
  conv_plan *p = plan_for(im, g);
  if (!is16(im)) {
    CUDNN_CHECK(cudnnConvolutionForward(im->dnn, &one, p->x, q->x, p->w, q->w, p->conv[FWD],
                                        (cudnnConvolutionFwdAlgo_t)p->algo[FWD], im->workspace, im->workspace_bytes,
                                        &zero, p->y, q->y));
    return;
  }
  const int bf16 = im->precision == DT_PREC_BF16;
  conv16 h = conv16_scratch(im, g);
  k_pack16(im->stream, q->x, h.x, g->b, g->c, g->h * g->w, bf16);
  k_pack16(im->stream, q->w, h.w, g->o, g->c, g->k * g->k, bf16);
  CUDNN_CHECK(cudnnConvolutionForward(im->dnn, &one, p->x, h.x, p->w, h.w, p->conv[FWD],
                                      (cudnnConvolutionFwdAlgo_t)p->algo[FWD], im->workspace, im->workspace_bytes,
                                      &zero, p->y, h.y));
  k_unpack16(im->stream, h.y, q->y, g->b, g->o, g->ho * g->wo, bf16, 0);
}

static void cuda_conv_bwd_data(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.conv_bwd_data) *q = &op->p.conv_bwd_data;
  const dt_conv_geom *g = &q->g;
  const float one = 1.0f, zero = 0.0f;
  if (!g->b) return;
  conv_plan *p = plan_for(im, g);
  if (!is16(im)) {
    CUDNN_CHECK(cudnnConvolutionBackwardData(im->dnn, &one, p->w, q->w, p->y, q->dy, p->conv[BWD_DATA],
                                             (cudnnConvolutionBwdDataAlgo_t)p->algo[BWD_DATA], im->workspace,
                                             im->workspace_bytes, &zero, p->x, q->dx));
    return;
  }
  const int bf16 = im->precision == DT_PREC_BF16;
  conv16 h = conv16_scratch(im, g);
  k_pack16(im->stream, q->dy, h.y, g->b, g->o, g->ho * g->wo, bf16);
  k_pack16(im->stream, q->w, h.w, g->o, g->c, g->k * g->k, bf16);
  CUDNN_CHECK(cudnnConvolutionBackwardData(im->dnn, &one, p->w, h.w, p->y, h.y, p->conv[BWD_DATA],
                                           (cudnnConvolutionBwdDataAlgo_t)p->algo[BWD_DATA], im->workspace,
                                           im->workspace_bytes, &zero, p->x, h.x));
  k_unpack16(im->stream, h.x, q->dx, g->b, g->c, g->h * g->w, bf16, 0);
}

/* Adds into dw: beta = 1 in FP32; in 16 bits the result is added as it is widened. */
static void cuda_conv_bwd_filter(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.conv_bwd_filter) *q = &op->p.conv_bwd_filter;
  const dt_conv_geom *g = &q->g;
  const float one = 1.0f, zero = 0.0f;
  if (!g->b) return;
  conv_plan *p = plan_for(im, g);
  if (!is16(im)) {
    CUDNN_CHECK(cudnnConvolutionBackwardFilter(im->dnn, &one, p->x, q->x, p->y, q->dy, p->conv[BWD_FILTER],
                                               (cudnnConvolutionBwdFilterAlgo_t)p->algo[BWD_FILTER], im->workspace,
                                               im->workspace_bytes, &one, p->w, q->dw));
    return;
  }
  const int bf16 = im->precision == DT_PREC_BF16;
  conv16 h = conv16_scratch(im, g);
  k_pack16(im->stream, q->x, h.x, g->b, g->c, g->h * g->w, bf16);
  k_pack16(im->stream, q->dy, h.y, g->b, g->o, g->ho * g->wo, bf16);
  CUDNN_CHECK(cudnnConvolutionBackwardFilter(im->dnn, &one, p->x, h.x, p->y, h.y, p->conv[BWD_FILTER],
                                             (cudnnConvolutionBwdFilterAlgo_t)p->algo[BWD_FILTER], im->workspace,
                                             im->workspace_bytes, &zero, p->w, h.w));
  k_unpack16(im->stream, h.w, q->dw, g->o, g->c, g->k * g->k, bf16, 1);
}

/* The kernels split indices with 32-bit fast division: main.c refuses larger tensors. */
#define CHECK_INDEXABLE(n) DT_ASSERT((int64_t)(n) < ((int64_t)1 << 31))

/* FP32 operands; the inputs rounded on tensor cores as train.precision says, FP32 accumulation. */
static const cublasComputeType_t gemm_compute[] = {[DT_PREC_FP32] = CUBLAS_COMPUTE_32F_PEDANTIC,
                                                   [DT_PREC_TF32] = CUBLAS_COMPUTE_32F_FAST_TF32,
                                                   [DT_PREC_BF16] = CUBLAS_COMPUTE_32F_FAST_16BF,
                                                   [DT_PREC_FP16] = CUBLAS_COMPUTE_32F_FAST_16F};

/* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap, and so do
 * their leading dimensions (at least 1, even when k is 0) and batch strides. */
static void cuda_gemm(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  if (!q->m || !q->n) return; /* a rank with no rows this batch */
  int64_t lda = q->trans_a ? q->m : q->k, ldb = q->trans_b ? q->k : q->n;
  const cublasOperation_t ta = q->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = q->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (q->batch > 1) {
    DT_ASSERT(q->batch < ((int64_t)1 << 31) && !q->bias);
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        im->blas, tb, ta, (int)q->n, (int)q->m, (int)q->k, &q->alpha, q->b, CUDA_R_32F, (int)(ldb > 1 ? ldb : 1),
        q->stride_b, q->a, CUDA_R_32F, (int)(lda > 1 ? lda : 1), q->stride_a, &q->beta, q->c, CUDA_R_32F, (int)q->n,
        q->stride_c, (int)q->batch, gemm_compute[im->precision], CUBLAS_GEMM_DEFAULT));
    return;
  }
  /* with a bias, C starts as the bias rows and the GEMM adds to it (beta 1), one rounding as on the CPU */
  const float one = 1.0f, *beta = &q->beta;
  if (q->bias) {
    DT_ASSERT(q->beta == 0.0f);
    k_fill_rows(im->stream, q->c, q->bias, q->m, q->n);
    beta = &one;
  }
  CUBLAS_CHECK(cublasGemmEx(im->blas, tb, ta, (int)q->n, (int)q->m, (int)q->k, &q->alpha, q->b, CUDA_R_32F,
                            (int)(ldb > 1 ? ldb : 1), q->a, CUDA_R_32F, (int)(lda > 1 ? lda : 1), beta, q->c,
                            CUDA_R_32F, (int)q->n, gemm_compute[im->precision], CUBLAS_GEMM_DEFAULT));
}

/* kernels/elementwise.cu */

static void cuda_bias_add(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bias_add) *q = &op->p.bias_add;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  k_bias_add(im->stream, q->y, q->bias, q->b, q->c, q->s);
}

static void cuda_bias_grad(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bias_grad) *q = &op->p.bias_grad;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  k_bias_grad(im->stream, q->dy, q->db, q->b, q->c, q->s);
}

static void cuda_act_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.act_fwd) *q = &op->p.act_fwd;
  k_act_fwd(im->stream, q->kind, q->x, q->y, q->n);
}

static void cuda_act_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.act_bwd) *q = &op->p.act_bwd;
  k_act_bwd(im->stream, q->kind, q->x, q->y, q->dy, q->dx, q->n);
}

static void cuda_dropout_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.dropout_fwd) *q = &op->p.dropout_fwd;
  k_dropout(im->stream, q->x, q->y, q->n, q->p, q->seed, q->step_seed);
}

/* the same mask on the gradient */
static void cuda_dropout_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.dropout_bwd) *q = &op->p.dropout_bwd;
  k_dropout(im->stream, q->dy, q->dx, q->n, q->p, q->seed, q->step_seed);
}

static void cuda_add(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.add) *q = &op->p.add;
  k_add(im->stream, q->a, q->b, q->y, q->n);
}

static void cuda_scale(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.scale) *q = &op->p.scale;
  k_scale(im->stream, q->x, q->alpha, q->n);
}

static void cuda_sumsq(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.sumsq) *q = &op->p.sumsq;
  double *pairs = grow_device(im, (void **)&im->partials, &im->partials_bytes,
                              (size_t)K_SUM_BLOCKS * 2 * sizeof(double), "sums of squares");
  k_sumsq(im->stream, q->x, q->n, q->out, pairs);
}

static void cuda_clip(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.clip) *q = &op->p.clip;
  k_clip(im->stream, q->x, q->n, q->max_norm, q->sumsq);
}

static void cuda_copy(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.copy) *q = &op->p.copy;
  if (q->n) CUDA_CHECK(cudaMemcpyAsync(q->y, q->x, (size_t)q->n * sizeof(float), cudaMemcpyDeviceToDevice, im->stream));
}

static void cuda_input(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.input) *q = &op->p.input;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  k_input(im->stream, q->raw, q->x, q->b, q->c, q->s, q->scale, q->mean, q->std);
}

static void cuda_gather(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.gather) *q = &op->p.gather;
  CHECK_INDEXABLE(q->n * q->row);
  k_gather(im->stream, q->type, q->src, q->idx, q->out, q->n, q->row);
}

/* kernels/norm.cu: batchnorm, layernorm */

static void cuda_bn_stats(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_stats) *q = &op->p.bn_stats;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  k_bn_stats(im->stream, q->x, q->b, q->c, q->s, q->sums);
}

static void cuda_bn_finalize(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_finalize) *q = &op->p.bn_finalize;
  k_bn_finalize(im->stream, q->c, q->training, q->momentum, q->eps, q->sums, q->mean, q->invstd, q->running_mean,
                q->running_var);
}

static void cuda_bn_apply(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_apply) *q = &op->p.bn_apply;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  k_bn_apply(im->stream, q->relu, q->x, q->y, q->b, q->c, q->s, q->mean, q->invstd, q->gamma, q->beta);
}

static void cuda_bn_bwd_stats(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_bwd_stats) *q = &op->p.bn_bwd_stats;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  k_bn_bwd_stats(im->stream, q->relu, q->x, q->dy, q->b, q->c, q->s, q->mean, q->invstd, q->gamma, q->beta, q->sums,
                 q->dgamma, q->dbeta);
}

static void cuda_bn_bwd_apply(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_bwd_apply) *q = &op->p.bn_bwd_apply;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  k_bn_bwd_apply(im->stream, q->relu, q->x, q->dy, q->dx, q->b, q->c, q->s, q->count, q->mean, q->invstd, q->gamma,
                 q->beta, q->sums);
}

static void cuda_ln_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.ln_fwd) *q = &op->p.ln_fwd;
  CHECK_INDEXABLE(q->n * q->d);
  k_ln_fwd(im->stream, q->x, q->gamma, q->beta, q->y, q->mean, q->rstd, q->n, q->d, q->eps);
}

static void cuda_ln_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.ln_bwd) *q = &op->p.ln_bwd;
  CHECK_INDEXABLE(q->n * q->d);
  if (!q->n) return;
  size_t need = (size_t)(2 * K_LN_CHUNKS * q->d > 2 * K_SUM_BLOCKS ? 2 * K_LN_CHUNKS * q->d : 2 * K_SUM_BLOCKS);
  double *partials =
      grow_device(im, (void **)&im->partials, &im->partials_bytes, need * sizeof(double), "layernorm sums");
  k_ln_bwd(im->stream, q->x, q->dy, q->gamma, q->mean, q->rstd, q->dx, q->dgamma, q->dbeta, q->n, q->d, partials);
}

/* kernels/pool.cu */

static void cuda_pool_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.pool_fwd) *q = &op->p.pool_fwd;
  CHECK_INDEXABLE(q->b * q->c * q->h * q->w);
  k_pool_fwd(im->stream, q->kind, q->x, q->y, q->argmax, q->b, q->c, q->h, q->w, q->k, q->stride, q->ho, q->wo);
}

static void cuda_pool_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.pool_bwd) *q = &op->p.pool_bwd;
  CHECK_INDEXABLE(q->b * q->c * q->h * q->w);
  k_pool_bwd(im->stream, q->kind, q->dy, q->argmax, q->dx, q->b, q->c, q->h, q->w, q->k, q->stride, q->ho, q->wo);
}

/* kernels/loss.cu */

static void cuda_loss(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.loss) *q = &op->p.loss;
  double *pairs = grow_device(im, (void **)&im->partials, &im->partials_bytes,
                              (size_t)(q->b > K_SUM_BLOCKS ? q->b : K_SUM_BLOCKS) * 2 * sizeof(double), "loss sums");
  k_loss(im->stream, q->kind, q->logits, q->labels, q->targets, q->dlogits, q->b, q->k, q->label_smoothing,
         q->ignore ? q->ignore_index : -1, q->weight, q->weight_dev, q->grad_scale, q->sums, pairs);
}

/* kernels/optim.cu: optimizer steps, fp16 loss scaling, EMA */

static void cuda_sgd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.sgd) *q = &op->p.sgd;
  k_sgd(im->stream, q->param, q->grad, q->mom, q->n, q->hyper, q->skip, q->momentum, q->weight_decay, q->nesterov);
}

static void cuda_adamw(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.adamw) *q = &op->p.adamw;
  k_adamw(im->stream, q->param, q->grad, q->m, q->v, q->n, q->hyper, q->skip, q->beta1, q->beta2, q->eps,
          q->weight_decay);
}

static void cuda_unscale(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.unscale) *q = &op->p.unscale;
  CHECK_INDEXABLE(q->n);
  if (q->n) k_unscale(im->stream, q->x, q->n, q->scaler);
}

static void cuda_scaler_update(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.scaler_update) *q = &op->p.scaler_update;
  k_scaler_update(im->stream, q->scaler, q->overflow, q->growth_interval, q->growth, q->backoff);
}

static void cuda_ema(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.ema) *q = &op->p.ema;
  CHECK_INDEXABLE(q->n);
  k_ema(im->stream, q->ema, q->x, q->n, q->decay);
}

/* kernels/transformer.cu: embeddings, softmax, permute */

static void cuda_embed_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.embed_fwd) *q = &op->p.embed_fwd;
  CHECK_INDEXABLE(q->n * q->d);
  CHECK_INDEXABLE(q->vocab * q->d);
  k_embed_fwd(im->stream, q->tokens, q->wte, q->wpe, q->y, q->n, q->t, q->d);
}

static void cuda_embed_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.embed_bwd) *q = &op->p.embed_bwd;
  CHECK_INDEXABLE(q->n * q->d);
  CHECK_INDEXABLE(q->vocab * q->d);
  k_embed_bwd(im->stream, q->tokens, q->dy, q->dwte, q->dwpe, q->n, q->t, q->d, q->vocab);
}

static void cuda_softmax_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.softmax_fwd) *q = &op->p.softmax_fwd;
  CHECK_INDEXABLE(q->rows * q->t);
  k_softmax_fwd(im->stream, q->x, q->y, q->rows, q->t, q->causal, q->scale);
}

static void cuda_softmax_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.softmax_bwd) *q = &op->p.softmax_bwd;
  CHECK_INDEXABLE(q->rows * q->t);
  k_softmax_bwd(im->stream, q->y, q->dy, q->dx, q->rows, q->t, q->causal, q->scale);
}

static void cuda_permute(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.permute) *q = &op->p.permute;
  DT_ASSERT(q->ndim >= 2 && q->ndim <= 5);
  int64_t total = 1;
  int seen = 0;
  for (int i = 0; i < q->ndim; i++) {
    DT_ASSERT(q->perm[i] >= 0 && q->perm[i] < q->ndim && !(seen & (1 << q->perm[i])));
    seen |= 1 << q->perm[i];
    total *= q->dims[i];
  }
  CHECK_INDEXABLE(total);
  k_permute(im->stream, q->x, q->y, q->ndim, q->dims, q->perm);
}

/* cuda_<name> for each X(NAME, name) of DT_OPS */
typedef void (*cuda_op_fn)(cuda_impl *im, const dt_op *op);
static const cuda_op_fn cuda_ops[DT_OP_COUNT] = {
#define CUDA_OP_(NAME, name) [DT_OP_##NAME] = cuda_##name,
    DT_OPS(CUDA_OP_)
#undef CUDA_OP_
};

/* Queues the op on the stream; a kernel launch that failed is reported as it returns. */
static void cuda_run(dt_backend *be, const dt_op *op) {
  DT_ASSERT(op->type >= 0 && op->type < DT_OP_COUNT);
  cuda_ops[op->type](be->impl, op);
  CUDA_CHECK(cudaGetLastError());
}

static float *cuda_alloc(dt_backend *be, size_t bytes) {
  cuda_impl *im = be->impl;
  void *p = NULL;
  cudaError_t err = cudaMalloc(&p, bytes ? bytes : 256);
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
  CUDA_CHECK(cudaFree(p));
}

/* cudaMemcpyDefault: host or device on either side (unified addressing). Synchronous with the
 * stream, so host buffers may be reused at once. */
static void cuda_copy_bytes(dt_backend *be, void *dst, const void *src, size_t bytes) {
  cuda_impl *im = be->impl;
  if (!bytes) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, im->stream));
  CUDA_CHECK(cudaStreamSynchronize(im->stream));
}

static void cuda_zero(dt_backend *be, void *p, size_t bytes) {
  cuda_impl *im = be->impl;
  CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, im->stream));
}

static void cuda_sync(dt_backend *be) {
  drain(be->impl);
}

/* Relaxed capture: a buffer that must grow mid-capture may still be allocated (grow_device). */
static void cuda_capture_begin(dt_backend *be) {
  cuda_impl *im = be->impl;
  DT_ASSERT(!im->capturing);
  CUDA_CHECK(cudaStreamBeginCapture(im->stream, cudaStreamCaptureModeRelaxed));
  im->capturing = 1;
}

static void *cuda_capture_end(dt_backend *be) {
  cuda_impl *im = be->impl;
  DT_ASSERT(im->capturing);
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
  CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph, im->stream));
}

static void cuda_graph_free(dt_backend *be, void *graph) {
  if (!graph) return;
  drain(be->impl);
  CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)graph));
}

static char *cuda_take_notes(dt_backend *be) {
  cuda_impl *im = be->impl;
  char *notes = im->notes;
  im->notes = NULL;
  return notes;
}

static void cuda_destroy(dt_backend *be) {
  cuda_impl *im = be->impl;
  drain(im);
  free(im->notes);
  for (int i = 0; i < im->n_plans; i++) {
    CUDNN_CHECK(cudnnDestroyTensorDescriptor(im->plans[i].x));
    CUDNN_CHECK(cudnnDestroyTensorDescriptor(im->plans[i].y));
    CUDNN_CHECK(cudnnDestroyFilterDescriptor(im->plans[i].w));
    for (int d = 0; d < 3; d++) CUDNN_CHECK(cudnnDestroyConvolutionDescriptor(im->plans[i].conv[d]));
  }
  free(im->plans);
  CUDA_CHECK(cudaFree(im->workspace));
  CUDA_CHECK(cudaFree(im->h16));
  if (im->stage) CUDA_CHECK(cudaFreeHost(im->stage));
  for (int h = 0; h < 2; h++)
    for (int q = 0; q < 2; q++) CUDA_CHECK(cudaEventDestroy(im->staged[h][q]));
  CUDA_CHECK(cudaEventDestroy(im->copied));
  CUDA_CHECK(cudaEventDestroy(im->cleared));
  CUDA_CHECK(cudaStreamDestroy(im->copy));
  CUDA_CHECK(cudaFree(im->partials));
  CUDNN_CHECK(cudnnDestroy(im->dnn));
  CUBLAS_CHECK(cublasDestroy(im->blas));
  CUDA_CHECK(cudaStreamDestroy(im->stream));
  free(im);
  free(be);
}

dt_backend *backend_cuda_create(int device, int precision) {
  dt_backend *be = dt_calloc(1, sizeof *be);
  cuda_impl *im = dt_calloc(1, sizeof *im);
  im->device = device;
  im->precision = precision;
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaStreamCreateWithFlags(&im->stream, cudaStreamNonBlocking));
  CUBLAS_CHECK(cublasCreate(&im->blas));
  CUBLAS_CHECK(cublasSetStream(im->blas, im->stream));
  /* fp32: the FP32 reference, no TF32; otherwise the GEMM's compute type decides */
  CUBLAS_CHECK(cublasSetMathMode(im->blas, precision == DT_PREC_FP32 ? CUBLAS_PEDANTIC_MATH : CUBLAS_DEFAULT_MATH));
  CUDNN_CHECK(cudnnCreate(&im->dnn));
  CUDNN_CHECK(cudnnSetStream(im->dnn, im->stream));
  CUDA_CHECK(cudaStreamCreateWithFlags(&im->copy, cudaStreamNonBlocking));
  for (int h = 0; h < 2; h++)
    for (int q = 0; q < 2; q++) CUDA_CHECK(cudaEventCreateWithFlags(&im->staged[h][q], cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&im->copied, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&im->cleared, cudaEventDisableTiming));
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
                     .done = cuda_done,
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
                     .threads = 1,
                     .host_memory = 0,
                     .stream = im->stream,
                     .impl = im};
  return be;
}
