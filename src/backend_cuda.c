/* backend_cuda.c: the op interface on one GPU. GEMM through cuBLAS, convolutions through cuDNN
 * (the algorithm chosen once per shape from cuDNN's heuristics, within a workspace limit, with
 * no per-run benchmarking), everything else through kernels/ (kernels.h). All work is queued on
 * one stream; host outputs (loss sums, sums of squares) are read back synchronously.
 * FP32 only, TF32 off: results follow the CPU reference to float rounding. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "kernels.h"

#define CUDA_CHECK(call)                                                                                  \
  do {                                                                                                    \
    cudaError_t e_ = (call);                                                                              \
    if (e_ != cudaSuccess) {                                                                              \
      char w_[512];                                                                                       \
      snprintf(w_, sizeof w_, "%s failed: %s (%s)", #call, cudaGetErrorString(e_), cudaGetErrorName(e_)); \
      dt_abort(__FILE__, __LINE__, w_);                                                                   \
    }                                                                                                     \
  } while (0)

#define CUBLAS_CHECK(call)                                                        \
  do {                                                                            \
    cublasStatus_t e_ = (call);                                                   \
    if (e_ != CUBLAS_STATUS_SUCCESS) {                                            \
      char w_[512];                                                               \
      snprintf(w_, sizeof w_, "%s failed: %s", #call, cublasGetStatusString(e_)); \
      dt_abort(__FILE__, __LINE__, w_);                                           \
    }                                                                             \
  } while (0)

#define CUDNN_CHECK(call)                                                       \
  do {                                                                          \
    cudnnStatus_t e_ = (call);                                                  \
    if (e_ != CUDNN_STATUS_SUCCESS) {                                           \
      char w_[512];                                                             \
      snprintf(w_, sizeof w_, "%s failed: %s", #call, cudnnGetErrorString(e_)); \
      dt_abort(__FILE__, __LINE__, w_);                                         \
    }                                                                           \
  } while (0)

enum { MAX_PLANS = 128 };
static const size_t workspace_limit = (size_t)512 << 20;

/* One convolution shape: descriptors and the three algorithms. */
typedef struct {
  dt_conv_geom g;
  cudnnTensorDescriptor_t x, y;
  cudnnFilterDescriptor_t w;
  cudnnConvolutionDescriptor_t conv;
  cudnnConvolutionFwdAlgo_t fwd;
  cudnnConvolutionBwdDataAlgo_t bwd_data;
  cudnnConvolutionBwdFilterAlgo_t bwd_filter;
  size_t ws_bytes;
} conv_plan;

typedef struct {
  int device;
  cudaStream_t stream;
  cublasHandle_t blas;
  cudnnHandle_t dnn;
  conv_plan plans[MAX_PLANS];
  int n_plans;
  void *workspace;
  size_t workspace_bytes;
  double *out;   /* (2) device: loss and sumsq results */
  void *staging; /* device copies of host inputs: raw rows, labels, targets, mean, std */
  size_t staging_bytes;
} cuda_impl;

static void *grow_device(void **buf, size_t *have, size_t need) {
  if (need > *have) {
    if (*buf) CUDA_CHECK(cudaFree(*buf));
    if (cudaMalloc(buf, need) != cudaSuccess)
      dt_die(
          "out of GPU memory allocating %zu bytes (%.1f MiB) of workspace; lower train.batch_size or "
          "train.global_batch_size",
          need, (double)need / 1048576.0);
    *have = need;
  }
  return *buf;
}

static conv_plan *plan_for(cuda_impl *im, const dt_conv_geom *g) {
  for (int i = 0; i < im->n_plans; i++)
    if (!memcmp(&im->plans[i].g, g, sizeof *g)) return &im->plans[i];
  DT_ASSERT(im->n_plans < MAX_PLANS);
  conv_plan *p = &im->plans[im->n_plans++];
  memset(p, 0, sizeof *p);
  p->g = *g;
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y));
  CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
  CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&p->conv));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, (int)g->b, (int)g->c, (int)g->h,
                                         (int)g->w));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, (int)g->b, (int)g->o, (int)g->ho,
                                         (int)g->wo));
  CUDNN_CHECK(cudnnSetFilter4dDescriptor(p->w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, (int)g->o, (int)g->c, (int)g->k,
                                         (int)g->k));
  CUDNN_CHECK(cudnnSetConvolution2dDescriptor(p->conv, (int)g->pad, (int)g->pad, (int)g->stride, (int)g->stride, 1, 1,
                                              CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv, CUDNN_FMA_MATH)); /* no TF32 */
  int n = 0;
  cudnnConvolutionFwdAlgoPerf_t fwd[8];
  CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(im->dnn, p->x, p->w, p->conv, p->y, 8, &n, fwd));
  cudnnConvolutionBwdDataAlgoPerf_t bd[8];
  int nd = 0;
  CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(im->dnn, p->w, p->y, p->conv, p->x, 8, &nd, bd));
  cudnnConvolutionBwdFilterAlgoPerf_t bf[8];
  int nf = 0;
  CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(im->dnn, p->x, p->y, p->conv, p->w, 8, &nf, bf));
  /* the first (fastest by the heuristics) that succeeds within the workspace limit */
  int i;
  for (i = 0; i < n && (fwd[i].status != CUDNN_STATUS_SUCCESS || fwd[i].memory > workspace_limit); i++) {
  }
  DT_ASSERT(i < n);
  p->fwd = fwd[i].algo;
  p->ws_bytes = fwd[i].memory;
  for (i = 0; i < nd && (bd[i].status != CUDNN_STATUS_SUCCESS || bd[i].memory > workspace_limit); i++) {
  }
  DT_ASSERT(i < nd);
  p->bwd_data = bd[i].algo;
  if (bd[i].memory > p->ws_bytes) p->ws_bytes = bd[i].memory;
  for (i = 0; i < nf && (bf[i].status != CUDNN_STATUS_SUCCESS || bf[i].memory > workspace_limit); i++) {
  }
  DT_ASSERT(i < nf);
  p->bwd_filter = bf[i].algo;
  if (bf[i].memory > p->ws_bytes) p->ws_bytes = bf[i].memory;
  grow_device(&im->workspace, &im->workspace_bytes, p->ws_bytes ? p->ws_bytes : 1);
  return p;
}

/* Host bytes to the device staging area at offset; returns the device pointer. */
static void *stage(cuda_impl *im, const void *host, size_t bytes, size_t offset) {
  char *base = grow_device(&im->staging, &im->staging_bytes, offset + bytes + 256);
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(base + offset, host, bytes, cudaMemcpyHostToDevice, im->stream));
  return base + offset;
}

static size_t align256(size_t n) {
  return (n + 255) & ~(size_t)255;
}

static void cuda_run(dt_backend *be, const dt_op *op) {
  cuda_impl *im = be->impl;
  cudaStream_t s = im->stream;
  const float one = 1.0f, zero = 0.0f;
  switch (op->type) {
    case DT_OP_GEMM: {
      const typeof(op->p.gemm) *q = &op->p.gemm;
      /* row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T */
      int lda = (int)(q->trans_a ? q->m : q->k), ldb = (int)(q->trans_b ? q->k : q->n);
      CUBLAS_CHECK(cublasSgemm(im->blas, q->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, q->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                               (int)q->n, (int)q->m, (int)q->k, &q->alpha, q->b, ldb, q->a, lda, &q->beta, q->c,
                               (int)q->n));
      break;
    }
    case DT_OP_BIAS_ADD: {
      const typeof(op->p.bias_add) *q = &op->p.bias_add;
      k_bias_add(s, q->y, q->bias, q->b, q->c, q->s);
      break;
    }
    case DT_OP_BIAS_GRAD: {
      const typeof(op->p.bias_grad) *q = &op->p.bias_grad;
      k_bias_grad(s, q->dy, q->db, q->b, q->c, q->s);
      break;
    }
    case DT_OP_CONV_FWD: {
      conv_plan *p = plan_for(im, &op->p.conv_fwd.g);
      CUDNN_CHECK(cudnnConvolutionForward(im->dnn, &one, p->x, op->p.conv_fwd.x, p->w, op->p.conv_fwd.w, p->conv,
                                          p->fwd, im->workspace, im->workspace_bytes, &zero, p->y, op->p.conv_fwd.y));
      break;
    }
    case DT_OP_CONV_BWD_DATA: {
      conv_plan *p = plan_for(im, &op->p.conv_bwd_data.g);
      CUDNN_CHECK(cudnnConvolutionBackwardData(im->dnn, &one, p->w, op->p.conv_bwd_data.w, p->y, op->p.conv_bwd_data.dy,
                                               p->conv, p->bwd_data, im->workspace, im->workspace_bytes, &zero, p->x,
                                               op->p.conv_bwd_data.dx));
      break;
    }
    case DT_OP_CONV_BWD_FILTER: { /* adds into dw (beta = 1) */
      conv_plan *p = plan_for(im, &op->p.conv_bwd_filter.g);
      CUDNN_CHECK(cudnnConvolutionBackwardFilter(im->dnn, &one, p->x, op->p.conv_bwd_filter.x, p->y,
                                                 op->p.conv_bwd_filter.dy, p->conv, p->bwd_filter, im->workspace,
                                                 im->workspace_bytes, &one, p->w, op->p.conv_bwd_filter.dw));
      break;
    }
    case DT_OP_BN_STATS: {
      const typeof(op->p.bn_stats) *q = &op->p.bn_stats;
      k_bn_stats(s, q->x, q->b, q->c, q->s, q->sum, q->sumsq);
      break;
    }
    case DT_OP_BN_APPLY: {
      const typeof(op->p.bn_apply) *q = &op->p.bn_apply;
      k_bn_apply(s, q->x, q->y, q->b, q->c, q->s, q->mean, q->invstd, q->gamma, q->beta);
      break;
    }
    case DT_OP_BN_BWD_STATS: {
      const typeof(op->p.bn_bwd_stats) *q = &op->p.bn_bwd_stats;
      k_bn_bwd_stats(s, q->x, q->dy, q->b, q->c, q->s, q->mean, q->invstd, q->sum_dy, q->sum_dy_xhat);
      break;
    }
    case DT_OP_BN_BWD_APPLY: {
      const typeof(op->p.bn_bwd_apply) *q = &op->p.bn_bwd_apply;
      DT_ASSERT(!q->dgamma); /* the batchnorm layer adds parameter gradients itself */
      k_bn_bwd_apply(s, q->x, q->dy, q->dx, q->b, q->c, q->s, q->count, q->mean, q->invstd, q->gamma, q->sum_dy,
                     q->sum_dy_xhat);
      break;
    }
    case DT_OP_ACT_FWD: k_act_fwd(s, op->p.act_fwd.kind, op->p.act_fwd.x, op->p.act_fwd.y, op->p.act_fwd.n); break;
    case DT_OP_ACT_BWD: {
      const typeof(op->p.act_bwd) *q = &op->p.act_bwd;
      k_act_bwd(s, q->kind, q->x, q->y, q->dy, q->dx, q->n);
      break;
    }
    case DT_OP_POOL_FWD: {
      const typeof(op->p.pool_fwd) *q = &op->p.pool_fwd;
      k_pool_fwd(s, q->kind, q->x, q->y, q->argmax, q->b, q->c, q->h, q->w, q->k, q->stride, q->ho, q->wo);
      break;
    }
    case DT_OP_POOL_BWD: {
      const typeof(op->p.pool_bwd) *q = &op->p.pool_bwd;
      k_pool_bwd(s, q->kind, q->dy, q->argmax, q->dx, q->b, q->c, q->h, q->w, q->k, q->stride, q->ho, q->wo);
      break;
    }
    case DT_OP_DROPOUT_FWD: {
      const typeof(op->p.dropout_fwd) *q = &op->p.dropout_fwd;
      k_dropout(s, q->x, q->y, q->n, q->p, q->seed);
      break;
    }
    case DT_OP_DROPOUT_BWD: { /* the same mask on the gradient */
      const typeof(op->p.dropout_bwd) *q = &op->p.dropout_bwd;
      k_dropout(s, q->dy, q->dx, q->n, q->p, q->seed);
      break;
    }
    case DT_OP_ADD: k_add(s, op->p.add.a, op->p.add.b, op->p.add.y, op->p.add.n); break;
    case DT_OP_LOSS: {
      const typeof(op->p.loss) *q = &op->p.loss;
      /* labels and targets come from the host loader */
      const int32_t *labels = q->labels ? stage(im, q->labels, (size_t)q->b * sizeof(int32_t), 0) : NULL;
      const float *targets =
          q->targets ? stage(im, q->targets, (size_t)(q->b * q->k) * sizeof(float), align256((size_t)q->b * 4)) : NULL;
      k_loss(s, q->kind, q->logits, labels, targets, q->dlogits, q->b, q->k, q->label_smoothing, q->weight, im->out);
      double host[2];
      CUDA_CHECK(cudaMemcpyAsync(host, im->out, sizeof host, cudaMemcpyDeviceToHost, s));
      CUDA_CHECK(cudaStreamSynchronize(s));
      *q->loss_sum = host[0];
      *q->correct = host[1];
      break;
    }
    case DT_OP_SGD: {
      const typeof(op->p.sgd) *q = &op->p.sgd;
      k_sgd(s, q->param, q->grad, q->mom, q->n, q->lr, q->momentum, q->weight_decay, q->nesterov, q->first);
      break;
    }
    case DT_OP_ADAMW: {
      const typeof(op->p.adamw) *q = &op->p.adamw;
      double bc1 = 1.0 - pow(q->beta1, (double)q->step), bc2 = 1.0 - pow(q->beta2, (double)q->step);
      k_adamw(s, q->param, q->grad, q->m, q->v, q->n, q->lr, q->beta1, q->beta2, q->eps, q->weight_decay,
              (float)(q->lr / bc1), (float)sqrt(bc2));
      break;
    }
    case DT_OP_SCALE: k_scale(s, op->p.scale.x, op->p.scale.alpha, op->p.scale.n); break;
    case DT_OP_SUMSQ: {
      const typeof(op->p.sumsq) *q = &op->p.sumsq;
      k_sumsq(s, q->x, q->n, im->out);
      double host[2];
      CUDA_CHECK(cudaMemcpyAsync(host, im->out, sizeof host, cudaMemcpyDeviceToHost, s));
      CUDA_CHECK(cudaStreamSynchronize(s));
      *q->sumsq = host[0];
      *q->nonfinite = (int64_t)host[1];
      break;
    }
    case DT_OP_INPUT: {
      const typeof(op->p.input) *q = &op->p.input;
      size_t raw_bytes = (size_t)(q->b * q->c * q->s) * sizeof(float), off = align256(raw_bytes);
      const float *raw = stage(im, q->raw, raw_bytes, 0);
      const float *mean = q->mean ? stage(im, q->mean, (size_t)q->c * sizeof(float), off) : NULL;
      const float *std =
          q->std ? stage(im, q->std, (size_t)q->c * sizeof(float), off + 256 + align256((size_t)q->c * 4)) : NULL;
      k_input(s, raw, q->x, q->b, q->c, q->s, q->scale, mean, std);
      break;
    }
    case DT_OP_COUNT: DT_ASSERT(0);
  }
  CUDA_CHECK(cudaGetLastError());
}

static float *cuda_alloc(dt_backend *be, size_t bytes) {
  cuda_impl *im = be->impl;
  void *p = NULL;
  if (cudaMalloc(&p, bytes ? bytes : 256) != cudaSuccess) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    dt_die(
        "out of GPU memory on device %d allocating %zu bytes (%.1f MiB, %.1f MiB free of %.1f); lower "
        "train.batch_size or train.global_batch_size, or use more ranks",
        im->device, bytes, (double)bytes / 1048576.0, (double)free_b / 1048576.0, (double)total_b / 1048576.0);
  }
  CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, im->stream));
  return p;
}

static void cuda_free(dt_backend *be, void *p) {
  (void)be;
  if (p) CUDA_CHECK(cudaFree(p));
}

/* cudaMemcpyDefault: host or device on either side (unified addressing). Synchronous with the
 * stream, so host buffers may be reused at once. */
static void cuda_copy(dt_backend *be, void *dst, const void *src, size_t bytes) {
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
  cuda_impl *im = be->impl;
  CUDA_CHECK(cudaStreamSynchronize(im->stream));
}

static void cuda_destroy(dt_backend *be) {
  cuda_impl *im = be->impl;
  cudaStreamSynchronize(im->stream);
  for (int i = 0; i < im->n_plans; i++) {
    cudnnDestroyTensorDescriptor(im->plans[i].x);
    cudnnDestroyTensorDescriptor(im->plans[i].y);
    cudnnDestroyFilterDescriptor(im->plans[i].w);
    cudnnDestroyConvolutionDescriptor(im->plans[i].conv);
  }
  cudaFree(im->workspace);
  cudaFree(im->staging);
  cudaFree(im->out);
  cudnnDestroy(im->dnn);
  cublasDestroy(im->blas);
  cudaStreamDestroy(im->stream);
  free(im);
  free(be);
}

dt_backend *backend_cuda_create(int device) {
  dt_backend *be = dt_calloc(1, sizeof *be);
  cuda_impl *im = dt_calloc(1, sizeof *im);
  im->device = device;
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaStreamCreateWithFlags(&im->stream, cudaStreamNonBlocking));
  CUBLAS_CHECK(cublasCreate(&im->blas));
  CUBLAS_CHECK(cublasSetStream(im->blas, im->stream));
  CUBLAS_CHECK(cublasSetMathMode(im->blas, CUBLAS_PEDANTIC_MATH)); /* FP32 reference: no TF32 */
  CUDNN_CHECK(cudnnCreate(&im->dnn));
  CUDNN_CHECK(cudnnSetStream(im->dnn, im->stream));
  CUDA_CHECK(cudaMalloc((void **)&im->out, 2 * sizeof(double)));
  *be = (dt_backend){.name = "cuda",
                     .run = cuda_run,
                     .alloc = cuda_alloc,
                     .free = cuda_free,
                     .to_device = cuda_copy,
                     .to_host = cuda_copy,
                     .zero = cuda_zero,
                     .sync = cuda_sync,
                     .destroy = cuda_destroy,
                     .threads = 1,
                     .host_memory = 0,
                     .stream = im->stream,
                     .impl = im};
  return be;
}
