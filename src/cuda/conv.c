/* conv.c: the convolution ops through cuDNN, as src/cpu/conv.c's through oneDNN. Owns the plans
 * (one per shape and batch size: descriptors and the algorithm of each direction, chosen once from
 * cuDNN's heuristics: deterministic, within a workspace limit, no per-run benchmarking), their notes
 * for the log, the cuDNN workspace and, under train.precision bf16 and fp16, the operands' 16-bit
 * NHWC copies (kernels/convert.cu packs and unpacks them). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_impl.h"

static const size_t workspace_limit = (size_t)512 << 20;

/* One convolution shape: descriptors and the three algorithms, each direction with its own
 * convolution descriptor (set to the math type of the kernels chosen for it). FP32 NCHW, or 16-bit
 * NHWC under train.precision bf16 and fp16. */
enum { FWD, BWD_DATA, BWD_FILTER };
struct conv_plan {
  dt_conv_geom g;
  cudnnTensorDescriptor_t x, y;
  cudnnFilterDescriptor_t w;
  cudnnConvolutionDescriptor_t conv[3];
  int algo[3]; /* cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t */
  cudnnMathType_t math[3];
  size_t ws_bytes;
};

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

/* A line about a new plan for the log (take_notes): the shape, each direction's choice, and the seconds
 * the heuristics took (start-up's, for the first batch's shapes). */
static void note_plan(cuda_impl *im, const conv_plan *p, double seconds) {
  static const char *const precision_names[] = {"fp32", "tf32", "bf16 NHWC", "fp16 NHWC"};
  const dt_conv_geom *g = &p->g;
  char line[512];
  snprintf(
      line, sizeof line,
      "cudnn: conv (%lld, %lld, %lld, %lld) by (%lld, %lld, %lld, %lld) stride %lld pad %lld, %s: forward algorithm "
      "%d (%s), backward data %d (%s), backward filter %d (%s), workspace %.1f MiB, planned in %.1f ms\n",
      (long long)g->b, (long long)g->c, (long long)g->h, (long long)g->w, (long long)g->o, (long long)g->c,
      (long long)g->k, (long long)g->k, (long long)g->stride, (long long)g->pad, precision_names[im->precision],
      p->algo[FWD], math_name(p->math[FWD]), p->algo[BWD_DATA], math_name(p->math[BWD_DATA]), p->algo[BWD_FILTER],
      math_name(p->math[BWD_FILTER]), (double)p->ws_bytes / 1048576.0, seconds * 1e3);
  cuda_note(im, line);
}

static conv_plan *plan_for(cuda_impl *im, const dt_conv_geom *g) {
  for (int i = 0; i < im->n_plans; i++)
    if (!memcmp(&im->plans[i].g, g, sizeof *g)) return &im->plans[i];
  im->plans = dt_realloc(im->plans, (size_t)(im->n_plans + 1) * sizeof *im->plans);
  conv_plan *p = &im->plans[im->n_plans++];
  memset(p, 0, sizeof *p);
  p->g = *g;
  const double t0 = dt_now();
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
  note_plan(im, p, dt_now() - t0);
  return p;
}

/* The plan of a convolution about to run, with the cuDNN workspace grown to what it needs. */
static conv_plan *plan_to_run(cuda_impl *im, const dt_conv_geom *g) {
  conv_plan *p = plan_for(im, g);
  cuda_grow_device(im, &im->workspace, &im->workspace_bytes, p->ws_bytes ? p->ws_bytes : 1, "cuDNN workspace");
  return p;
}

/* Bytes of a convolution's three operands in 16 bits, each 256-byte aligned (conv16_scratch); the filter's but
 * for an op that reads the model's copy (w16) or writes its gradient into the model's grads16 (dw16). */
static size_t conv16_bytes(const dt_conv_geom *g, int w16) {
  return align256((size_t)(g->b * g->c * g->h * g->w) * 2) +
         (w16 ? 0 : align256((size_t)(g->o * g->c * g->k * g->k) * 2)) +
         align256((size_t)(g->b * g->o * g->ho * g->wo) * 2);
}

void cuda_conv_scratch(cuda_impl *im, const dt_conv_geom *g, int w16, size_t *workspace, size_t *h16) {
  if (!g->b) return; /* never run (cuDNN refuses zero-sized tensors) */
  const conv_plan *p = plan_for(im, g);
  const size_t ws = p->ws_bytes ? p->ws_bytes : 1, b16 = is16(im) ? conv16_bytes(g, w16) : 0;
  if (ws > *workspace) *workspace = ws;
  if (b16 > *h16) *h16 = b16;
}

/* A convolution's three operands in 16 bits, NHWC, in im->h16: (b, c, h, w), (b, o, ho, wo) and (o, c, k, k)
 * (none, NULL, where the op reads the model's copy, w16, or writes the model's grads16, dw16), each 256-byte aligned.
 * y's place is the same either way, so that a backward data reading the model's copy finds the dy its backward filter
 * left (dy16 held). */
typedef struct {
  uint16_t *x, *w, *y;
} conv16;

static conv16 conv16_scratch(cuda_impl *im, const dt_conv_geom *g, int w16) {
  size_t nx = align256((size_t)(g->b * g->c * g->h * g->w) * 2),
         ny = align256((size_t)(g->b * g->o * g->ho * g->wo) * 2);
  char *base =
      cuda_grow_device(im, (void **)&im->h16, &im->h16_bytes, conv16_bytes(g, w16), "16-bit convolution operands");
  return (conv16){.x = (uint16_t *)base, .w = w16 ? NULL : (uint16_t *)(base + nx + ny), .y = (uint16_t *)(base + nx)};
}

/* The 16-bit filter a forward or backward data reads: the model's copy (w16: w is it), else w packed into the
 * scratch's filter. */
static const void *filter16(cuda_impl *im, const dt_conv_geom *g, const float *w, int w16, const conv16 *h) {
  if (w16) return w;
  k_pack16(im->stream, w, h->w, g->o, g->c, g->k * g->k, im->precision == DT_PREC_BF16);
  return h->w;
}

/* The layout key of a held 16-bit dy (cuda_dy16_held): g's dy as NHWC. */
static void dy16_nhwc(const dt_conv_geom *g, int64_t layout[4]) {
  layout[0] = DY16_NHWC, layout[1] = g->b, layout[2] = g->o, layout[3] = g->ho * g->wo;
}

/* The three convolution ops. FP32: cuDNN on the tensors as they are (NCHW). bf16 and fp16: the
 * operands are rounded into 16-bit NHWC copies, cuDNN computes with FP32 accumulation on tensor
 * cores, and the result comes back to FP32 NCHW (the filter gradient added into dw, as FP32, or left in
 * 16 bits for the model's grads16 op: dw16). The
 * forward's copy of x goes where the op says (x16: the layer keeps it for its backward filter); a y16
 * forward leaves y as cuDNN wrote it, and a dy16 backward reads dy so, without copies. */
void cuda_conv_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.conv_fwd) *q = &op->p.conv_fwd;
  const dt_conv_geom *g = &q->g;
  const float one = 1.0f, zero = 0.0f;
  if (!g->b) return; /* cuDNN refuses zero-sized tensors */
  conv_plan *p = plan_to_run(im, g);
  DT_ASSERT((!q->y16 || q->y16 == cuda_format16(im)) && (!q->in16 || (q->in16 == cuda_format16(im) && !q->x16)) &&
            (!q->w16 || q->w16 == cuda_format16(im)));
  if (!is16(im)) {
    CUDNN_CHECK(cudnnConvolutionForward(im->dnn, &one, p->x, q->x, p->w, q->w, p->conv[FWD],
                                        (cudnnConvolutionFwdAlgo_t)p->algo[FWD], im->workspace, im->workspace_bytes,
                                        &zero, p->y, q->y));
    return;
  }
  const int bf16 = im->precision == DT_PREC_BF16;
  conv16 h = conv16_scratch(im, g, q->w16);
  const uint16_t *x16 = q->in16 ? (const uint16_t *)q->x : q->x16 ? (uint16_t *)q->x16 : h.x;
  uint16_t *y16 = q->y16 ? (uint16_t *)q->y : h.y;
  if (!q->in16) k_pack16(im->stream, q->x, (uint16_t *)x16, g->b, g->c, g->h * g->w, bf16);
  CUDNN_CHECK(cudnnConvolutionForward(im->dnn, &one, p->x, x16, p->w, filter16(im, g, q->w, q->w16, &h), p->conv[FWD],
                                      (cudnnConvolutionFwdAlgo_t)p->algo[FWD], im->workspace, im->workspace_bytes,
                                      &zero, p->y, y16));
  if (!q->y16) k_unpack16(im->stream, h.y, q->y, g->b, g->o, g->ho * g->wo, bf16, 0);
}

void cuda_conv_bwd_data(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.conv_bwd_data) *q = &op->p.conv_bwd_data;
  const dt_conv_geom *g = &q->g;
  const float one = 1.0f, zero = 0.0f;
  if (!g->b) return;
  conv_plan *p = plan_to_run(im, g);
  DT_ASSERT((!q->dy16 || q->dy16 == cuda_format16(im)) && (!q->in16 || q->in16 == cuda_format16(im)) &&
            (!q->w16 || q->w16 == cuda_format16(im)));
  if (!is16(im)) {
    CUDNN_CHECK(cudnnConvolutionBackwardData(im->dnn, &one, p->w, q->w, p->y, q->dy, p->conv[BWD_DATA],
                                             (cudnnConvolutionBwdDataAlgo_t)p->algo[BWD_DATA], im->workspace,
                                             im->workspace_bytes, &zero, p->x, q->dx));
    return;
  }
  const int bf16 = im->precision == DT_PREC_BF16;
  conv16 h = conv16_scratch(im, g, q->w16);
  int64_t layout[4];
  dy16_nhwc(g, layout);
  const uint16_t *dy16 = q->dy16 ? (const uint16_t *)q->dy : h.y;
  if (!q->dy16) { /* else as the batchnorm after wrote it */
    if (cuda_dy16_held(im, q->dy, h.y, layout))
      im->dy16_reuses++;
    else
      k_pack16(im->stream, q->dy, h.y, g->b, g->o, g->ho * g->wo, bf16);
  }
  cuda_forget_dy16(im); /* one use: another backward data may pack another dy, or lay h16 out otherwise */
  CUDNN_CHECK(cudnnConvolutionBackwardData(im->dnn, &one, p->w, filter16(im, g, q->w, q->w16, &h), p->y, dy16,
                                           p->conv[BWD_DATA], (cudnnConvolutionBwdDataAlgo_t)p->algo[BWD_DATA],
                                           im->workspace, im->workspace_bytes, &zero, p->x,
                                           q->in16 ? (void *)q->dx : h.x));
  if (!q->in16) k_unpack16(im->stream, h.x, q->dx, g->b, g->c, g->h * g->w, bf16, 0);
}

/* Adds into dw: beta = 1 in FP32; in 16 bits the result is added as it is widened, or (dw16) written to dw as
 * cuDNN computes it. */
void cuda_conv_bwd_filter(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.conv_bwd_filter) *q = &op->p.conv_bwd_filter;
  const dt_conv_geom *g = &q->g;
  const float one = 1.0f, zero = 0.0f;
  DT_ASSERT((!q->dy16 || q->dy16 == cuda_format16(im)) && (!q->in16 || (q->in16 == cuda_format16(im) && !q->x16)) &&
            (!q->dw16 || q->dw16 == cuda_format16(im)));
  if (!g->b) { /* no rows: nothing to add, or a 16-bit gradient of zeros for the grads16 op to add */
    if (q->dw16) CUDA_CHECK(cudaMemsetAsync(q->dw, 0, (size_t)(g->o * g->c * g->k * g->k) * 2, im->stream));
    return;
  }
  conv_plan *p = plan_to_run(im, g);
  if (!is16(im)) {
    CUDNN_CHECK(cudnnConvolutionBackwardFilter(im->dnn, &one, p->x, q->x, p->y, q->dy, p->conv[BWD_FILTER],
                                               (cudnnConvolutionBwdFilterAlgo_t)p->algo[BWD_FILTER], im->workspace,
                                               im->workspace_bytes, &one, p->w, q->dw));
    return;
  }
  const int bf16 = im->precision == DT_PREC_BF16;
  conv16 h = conv16_scratch(im, g, q->dw16); /* its filter gradient's 16 bits, unless they go to dw (dw16) */
  const uint16_t *x16 = q->in16 ? (const uint16_t *)q->x : q->x16;
  if (!x16) k_pack16(im->stream, q->x, h.x, g->b, g->c, g->h * g->w, bf16), x16 = h.x;
  const uint16_t *dy16 = q->dy16 ? (const uint16_t *)q->dy : h.y;
  if (!q->dy16) k_pack16(im->stream, q->dy, h.y, g->b, g->o, g->ho * g->wo, bf16);
  CUDNN_CHECK(cudnnConvolutionBackwardFilter(im->dnn, &one, p->x, x16, p->y, dy16, p->conv[BWD_FILTER],
                                             (cudnnConvolutionBwdFilterAlgo_t)p->algo[BWD_FILTER], im->workspace,
                                             im->workspace_bytes, &zero, p->w, q->dw16 ? (void *)q->dw : h.w));
  if (!q->dw16) k_unpack16(im->stream, h.w, q->dw, g->o, g->c, g->k * g->k, bf16, 1);
  if (!q->dy16) { /* cuDNN left h.y as it was */
    int64_t layout[4];
    dy16_nhwc(g, layout);
    cuda_hold_dy16(im, q->dy, h.y, layout);
  }
}

/* At shut-down, once the stream has drained. */
void cuda_conv_free(cuda_impl *im) {
  for (int i = 0; i < im->n_plans; i++) {
    CUDNN_CHECK(cudnnDestroyTensorDescriptor(im->plans[i].x));
    CUDNN_CHECK(cudnnDestroyTensorDescriptor(im->plans[i].y));
    CUDNN_CHECK(cudnnDestroyFilterDescriptor(im->plans[i].w));
    for (int d = 0; d < 3; d++) CUDNN_CHECK(cudnnDestroyConvolutionDescriptor(im->plans[i].conv[d]));
  }
  free(im->plans);
  cuda_device_free(im, im->workspace);
  cuda_device_free(im, im->h16);
}
