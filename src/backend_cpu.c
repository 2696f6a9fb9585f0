/* backend_cpu.c: the reference backend. Matrix products and convolutions (im2col + GEMM) go
 * through OpenBLAS; loops are parallel with OpenMP (OpenBLAS's OpenMP build shares the pool). */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cpu_dnnl.h"
#include "tanh_poly.h"

/* The elementwise and reduction loops below are built three times, for AVX-512 (x86-64-v4), AVX2 +
 * FMA (v3) and the baseline, and the loader picks the widest the CPU has: one portable binary that
 * streams activations at the width of the machine it runs on. -ffp-contract=off keeps the FMA of v3
 * and v4 out of their arithmetic, so elementwise results are the same bits in all three. */
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* The op names, DT_OPS's second column: backend.h declares them, the reference backend holds them. */
const char *const dt_op_names[DT_OP_COUNT] = {
#define OP_NAME_(NAME, name) #name,
    DT_OPS(OP_NAME_)
#undef OP_NAME_
};

/* Per-thread workspaces, grown on first use at each new shape (the first steps). */
typedef struct {
  float **col; /* [threads] im2col of one sample (C*K*K, Ho*Wo) */
  size_t col_bytes;
  float **dw; /* [threads] private filter gradients (O, C*K*K) */
  size_t dw_bytes;
  int threads;
  cpu_dnnl *dnnl; /* oneDNN's convolutions; NULL: im2col + GEMM for all */
} cpu_impl;

static void grow_all(float **bufs, size_t *have, size_t need, int n) {
  if (need <= *have) return;
  for (int t = 0; t < n; t++) {
    free(bufs[t]);
    bufs[t] = dt_malloc(need);
  }
  *have = need;
}

/* Valid output columns [lo, hi) for kernel column kw: 0 <= ow*stride - pad + kw < w. */
static void valid_range(const dt_conv_geom *g, int64_t kw, int64_t *lo, int64_t *hi) {
  int64_t off = kw - g->pad;
  int64_t a = off >= 0 ? 0 : (-off + g->stride - 1) / g->stride;
  int64_t b = (g->w - off + g->stride - 1) / g->stride;
  if (b > g->wo) b = g->wo;
  if (a > b) a = b;
  *lo = a;
  *hi = b;
}

/* col (C*K*K, Ho*Wo) from one sample x (C, H, W). */
static void im2col(const dt_conv_geom *g, const float *x, float *col) {
  const int64_t hw = g->ho * g->wo, kk = g->k * g->k;
  for (int64_t c = 0; c < g->c; c++) {
    const float *xc = x + c * g->h * g->w;
    for (int64_t ki = 0; ki < kk; ki++) {
      int64_t kh = ki / g->k, kw = ki % g->k, lo, hi;
      valid_range(g, kw, &lo, &hi);
      float *dst = col + (c * kk + ki) * hw;
      for (int64_t oh = 0; oh < g->ho; oh++) {
        int64_t ih = oh * g->stride - g->pad + kh;
        float *row = dst + oh * g->wo;
        if (ih < 0 || ih >= g->h) {
          memset(row, 0, (size_t)g->wo * sizeof(float));
          continue;
        }
        const float *xr = xc + ih * g->w + kw - g->pad;
        for (int64_t ow = 0; ow < lo; ow++) row[ow] = 0.0f;
        if (g->stride == 1)
          memcpy(row + lo, xr + lo, (size_t)(hi - lo) * sizeof(float));
        else
          for (int64_t ow = lo; ow < hi; ow++) row[ow] = xr[ow * g->stride];
        for (int64_t ow = hi; ow < g->wo; ow++) row[ow] = 0.0f;
      }
    }
  }
}

/* dx (C, H, W) of one sample = col2im(col); overwrites dx. */
static void col2im(const dt_conv_geom *g, const float *col, float *dx) {
  const int64_t hw = g->ho * g->wo, kk = g->k * g->k;
  memset(dx, 0, (size_t)(g->c * g->h * g->w) * sizeof(float));
  for (int64_t c = 0; c < g->c; c++) {
    float *xc = dx + c * g->h * g->w;
    for (int64_t ki = 0; ki < kk; ki++) {
      int64_t kh = ki / g->k, kw = ki % g->k, lo, hi;
      valid_range(g, kw, &lo, &hi);
      const float *src = col + (c * kk + ki) * hw;
      for (int64_t oh = 0; oh < g->ho; oh++) {
        int64_t ih = oh * g->stride - g->pad + kh;
        if (ih < 0 || ih >= g->h) continue;
        float *xr = xc + ih * g->w + kw - g->pad;
        const float *row = src + oh * g->wo;
        if (g->stride == 1)
          for (int64_t ow = lo; ow < hi; ow++) xr[ow] += row[ow];
        else
          for (int64_t ow = lo; ow < hi; ow++) xr[ow * g->stride] += row[ow];
      }
    }
  }
}

/* Samples run in parallel, each with a single-threaded GEMM (OpenBLAS's OpenMP build runs
 * serially inside a parallel region), so one sample's columns stay in cache. */
static void conv_fwd(cpu_impl *im, const dt_conv_geom *g, const float *x, const float *w, float *y) {
  if (im->dnnl && cpu_dnnl_conv(im->dnnl, CPU_DNNL_FWD, g, x, w, y)) return;
  const int64_t ckk = g->c * g->k * g->k, hw = g->ho * g->wo;
  grow_all(im->col, &im->col_bytes, (size_t)(ckk * hw) * sizeof(float), im->threads);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < g->b; b++) {
    float *col = im->col[omp_get_thread_num()];
    im2col(g, x + b * g->c * g->h * g->w, col);
    /* y_b(O, hw) = w(O, ckk) col(ckk, hw) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)g->o, (int)hw, (int)ckk, 1.0f, w, (int)ckk, col,
                (int)hw, 0.0f, y + b * g->o * hw, (int)hw);
  }
}

static void conv_bwd_data(cpu_impl *im, const dt_conv_geom *g, const float *dy, const float *w, float *dx) {
  if (im->dnnl && cpu_dnnl_conv(im->dnnl, CPU_DNNL_BWD_DATA, g, dy, w, dx)) return;
  const int64_t ckk = g->c * g->k * g->k, hw = g->ho * g->wo;
  grow_all(im->col, &im->col_bytes, (size_t)(ckk * hw) * sizeof(float), im->threads);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < g->b; b++) {
    float *col = im->col[omp_get_thread_num()];
    /* col(ckk, hw) = w^T(ckk, O) dy_b(O, hw) */
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)ckk, (int)hw, (int)g->o, 1.0f, w, (int)ckk,
                dy + b * g->o * hw, (int)hw, 0.0f, col, (int)hw);
    col2im(g, col, dx + b * g->c * g->h * g->w);
  }
}

static void conv_bwd_filter(cpu_impl *im, const dt_conv_geom *g, const float *x, const float *dy, float *dw) {
  if (im->dnnl && cpu_dnnl_conv(im->dnnl, CPU_DNNL_BWD_FILTER, g, x, dy, dw)) return;
  const int64_t ckk = g->c * g->k * g->k, hw = g->ho * g->wo, nw = g->o * ckk;
  grow_all(im->col, &im->col_bytes, (size_t)(ckk * hw) * sizeof(float), im->threads);
  grow_all(im->dw, &im->dw_bytes, (size_t)nw * sizeof(float), im->threads);
#pragma omp parallel
  {
    int t = omp_get_thread_num();
    float *col = im->col[t], *acc = im->dw[t];
    memset(acc, 0, (size_t)nw * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < g->b; b++) {
      im2col(g, x + b * g->c * g->h * g->w, col);
      /* acc(O, ckk) += dy_b(O, hw) col^T(hw, ckk) */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)g->o, (int)ckk, (int)hw, 1.0f, dy + b * g->o * hw,
                  (int)hw, col, (int)hw, 1.0f, acc, (int)ckk);
    }
    /* fixed order of the per-thread sums: results do not depend on scheduling */
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nw; i++) {
      float s = 0;
      for (int k = 0; k < omp_get_num_threads(); k++) s += im->dw[k][i];
      dw[i] += s;
    }
  }
}

static inline float gelu_f(float x) {
  return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}
static inline float gelu_grad(float x) {
  float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
  float pdf = 0.39894228040143268f * expf(-0.5f * x * x);
  return cdf + x * pdf;
}

/* PyTorch's gelu(approximate='tanh'): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), and its
 * exact derivative, in the order of PyTorch's GeluBackward. */
static inline float gelu_tanh_f(float x) {
  float inner = 0.79788456080286536f * (x + 0.044715f * (x * x * x));
  return 0.5f * x * (1.0f + dt_tanhf(inner));
}
static inline float gelu_tanh_grad(float x) {
  float x2 = x * x, t = dt_tanhf(0.79788456080286536f * (x + 0.044715f * (x2 * x)));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * (0.79788456080286536f * (1.0f + 3.0f * 0.044715f * x2));
}

/* One loop per kind, so each vectorises without a branch per element. */
VECTOR_CLONES static void act_fwd(int kind, int64_t n, const float *x, float *y) {
  switch (kind) {
    case DT_ACT_RELU:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) y[i] = x[i] < 0 ? 0.0f : x[i]; /* NaN passes, as in PyTorch */
      break;
    case DT_ACT_GELU:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) y[i] = gelu_f(x[i]);
      break;
    case DT_ACT_TANH:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) y[i] = dt_tanhf(x[i]);
      break;
    case DT_ACT_GELU_TANH:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) y[i] = gelu_tanh_f(x[i]);
      break;
    default:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) y[i] = 1.0f / (1.0f + expf(-x[i]));
      break;
  }
}

VECTOR_CLONES static void act_bwd(int kind, int64_t n, const float *x, const float *y, const float *dy, float *dx) {
  switch (kind) {
    case DT_ACT_RELU:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) {
        float g = dy[i]; /* loaded unconditionally, so the loop vectorises instead of branching */
        dx[i] = x[i] > 0 ? g : 0.0f;
      }
      break;
    case DT_ACT_GELU:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) dx[i] = gelu_grad(x[i]) * dy[i];
      break;
    case DT_ACT_TANH:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) dx[i] = (1.0f - y[i] * y[i]) * dy[i];
      break;
    case DT_ACT_GELU_TANH:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) dx[i] = gelu_tanh_grad(x[i]) * dy[i];
      break;
    default:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) dx[i] = y[i] * (1.0f - y[i]) * dy[i];
      break;
  }
}

static void gemm_one(const typeof(((dt_op *)0)->p.gemm) *q, int64_t i) {
  int64_t lda = q->trans_a ? q->m : q->k, ldb = q->trans_b ? q->k : q->n;
  cblas_sgemm(CblasRowMajor, q->trans_a ? CblasTrans : CblasNoTrans, q->trans_b ? CblasTrans : CblasNoTrans, (int)q->m,
              (int)q->n, (int)q->k, q->alpha, q->a + i * q->stride_a, (int)(lda > 1 ? lda : 1), q->b + i * q->stride_b,
              (int)(ldb > 1 ? ldb : 1), q->beta, q->c + i * q->stride_c, (int)q->n);
}

/* The products one by one with a threaded GEMM each, or, when there are at least as many products
 * as threads, in parallel with a single-threaded GEMM each (as conv_fwd's). The threaded GEMM is
 * called outside any parallel region: inside even an if(0) one, OpenBLAS's own region is nested,
 * and libgomp starts fresh threads for it on every call while the pool's threads spin. */
static void op_gemm(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.gemm) *q = &op->p.gemm;
  if (!q->m || !q->n) return; /* a rank with no rows this batch */
  if (q->bias) {              /* C starts as the bias rows and the GEMM adds to it: one pass fewer over C */
    DT_ASSERT(q->beta == 0.0f && q->batch <= 1);
    typeof(((dt_op *)0)->p.gemm) with = *q;
    with.beta = 1.0f;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < q->m; r++) memcpy(q->c + r * q->n, q->bias, (size_t)q->n * sizeof(float));
    gemm_one(&with, 0);
    return;
  }
  int64_t batch = q->batch > 1 ? q->batch : 1;
  if (batch > 1 && batch >= im->threads) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; i++) gemm_one(q, i);
  } else {
    for (int64_t i = 0; i < batch; i++) gemm_one(q, i);
  }
}

VECTOR_CLONES static void op_bias_add(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bias_add) *q = &op->p.bias_add;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t c = 0; c < q->c; c++) {
      float *y = q->y + (b * q->c + c) * q->s, bias = q->bias[c];
      for (int64_t s = 0; s < q->s; s++) y[s] += bias;
    }
}

VECTOR_CLONES static void op_bias_grad(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bias_grad) *q = &op->p.bias_grad;
  if (q->s == 1) { /* dy (b, c) row-major: each thread streams the rows over its own block of columns */
    enum { CHUNK = 256 };
#pragma omp parallel for schedule(static)
    for (int64_t c0 = 0; c0 < q->c; c0 += CHUNK) {
      int64_t n = q->c - c0 < CHUNK ? q->c - c0 : CHUNK;
      double acc[CHUNK] = {0}; /* the same order of additions as the per-column loop below */
      for (int64_t b = 0; b < q->b; b++) {
        const float *dy = q->dy + b * q->c + c0;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) acc[j] += dy[j];
      }
      for (int64_t j = 0; j < n; j++) q->db[c0 + j] += (float)acc[j];
    }
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < q->c; c++) {
    double acc = 0;
    for (int64_t b = 0; b < q->b; b++) {
      const float *dy = q->dy + (b * q->c + c) * q->s;
#pragma omp simd reduction(+ : acc)
      for (int64_t s = 0; s < q->s; s++) acc += dy[s];
    }
    q->db[c] += (float)acc;
  }
}

static void op_conv_fwd(cpu_impl *im, const dt_op *op) {
  conv_fwd(im, &op->p.conv_fwd.g, op->p.conv_fwd.x, op->p.conv_fwd.w, op->p.conv_fwd.y);
}

static void op_conv_bwd_data(cpu_impl *im, const dt_op *op) {
  conv_bwd_data(im, &op->p.conv_bwd_data.g, op->p.conv_bwd_data.dy, op->p.conv_bwd_data.w, op->p.conv_bwd_data.dx);
}

static void op_conv_bwd_filter(cpu_impl *im, const dt_op *op) {
  conv_bwd_filter(im, &op->p.conv_bwd_filter.g, op->p.conv_bwd_filter.x, op->p.conv_bwd_filter.dy,
                  op->p.conv_bwd_filter.dw);
}

VECTOR_CLONES static void op_bn_stats(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bn_stats) *q = &op->p.bn_stats;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < q->c; c++) {
    double s1 = 0, s2 = 0;
    for (int64_t b = 0; b < q->b; b++) {
      const float *x = q->x + (b * q->c + c) * q->s;
      /* simd reductions vectorise (a fixed order for a given build, so results are repeatable) */
#pragma omp simd reduction(+ : s1, s2)
      for (int64_t s = 0; s < q->s; s++) {
        s1 += x[s];
        s2 += (double)x[s] * x[s];
      }
    }
    q->sums[c] = s1;
    q->sums[q->c + c] = s2;
  }
  q->sums[2 * q->c] = (double)(q->b * q->s);
}

/* Batch statistics (biased variance) from the sums, running statistics updated with the unbiased
 * one, as PyTorch; in evaluation the running statistics. Double precision, as kernels/norm.cu. */
static void op_bn_finalize(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bn_finalize) *q = &op->p.bn_finalize;
  for (int64_t c = 0; c < q->c; c++) {
    if (!q->training) {
      q->mean[c] = q->running_mean[c];
      q->invstd[c] = (float)(1.0 / sqrt((double)q->running_var[c] + q->eps));
      continue;
    }
    double n = q->sums[2 * q->c];
    double mu = n > 0 ? q->sums[c] / n : 0.0;
    double var = n > 0 ? q->sums[q->c + c] / n - mu * mu : 0.0;
    if (var < 0) var = 0;
    q->mean[c] = (float)mu;
    q->invstd[c] = (float)(1.0 / sqrt(var + q->eps));
    if (n > 0) {
      double unbiased = n > 1 ? var * n / (n - 1) : var;
      float m = q->momentum;
      q->running_mean[c] = (1 - m) * q->running_mean[c] + m * (float)mu;
      q->running_var[c] = (1 - m) * q->running_var[c] + m * (float)unbiased;
    }
  }
}

/* The normalised value z = (x - mean) * (invstd * gamma) + beta, rounded in this order by forward
 * and by the fused relu's backward, which recomputes z for its mask (CFLAGS -ffp-contract=off: no FMA
 * changes one of them; kernels/norm.cu rounds the same way). */
static inline float bn_z(float x, float mean, float scale, float beta) {
  return (x - mean) * scale + beta;
}

VECTOR_CLONES static void op_bn_apply(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bn_apply) *q = &op->p.bn_apply;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t c = 0; c < q->c; c++) {
      const float *x = q->x + (b * q->c + c) * q->s;
      float *y = q->y + (b * q->c + c) * q->s;
      float a = q->invstd[c] * q->gamma[c], m = q->mean[c], beta = q->beta[c];
      if (q->relu) {
        for (int64_t s = 0; s < q->s; s++) {
          float z = bn_z(x[s], m, a, beta);
          y[s] = z < 0 ? 0.0f : z; /* as act_fwd's relu: NaN passes */
        }
      } else {
        for (int64_t s = 0; s < q->s; s++) y[s] = bn_z(x[s], m, a, beta);
      }
    }
}

/* The gradient at z: dy, or with a fused relu, dy where z > 0 and 0 elsewhere (act_bwd's relu). */
static inline float bn_relu_grad(float dy, float x, float mean, float scale, float beta) {
  return bn_z(x, mean, scale, beta) > 0 ? dy : 0.0f;
}

VECTOR_CLONES static void op_bn_bwd_stats(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bn_bwd_stats) *q = &op->p.bn_bwd_stats;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < q->c; c++) {
    double s1 = 0, s2 = 0;
    float m = q->mean[c], is = q->invstd[c];
    float a = q->relu ? is * q->gamma[c] : 0.0f, beta = q->relu ? q->beta[c] : 0.0f;
    for (int64_t b = 0; b < q->b; b++) {
      const float *x = q->x + (b * q->c + c) * q->s, *dy = q->dy + (b * q->c + c) * q->s;
      if (q->relu) {
#pragma omp simd reduction(+ : s1, s2)
        for (int64_t s = 0; s < q->s; s++) {
          float g = bn_relu_grad(dy[s], x[s], m, a, beta);
          s1 += g;
          s2 += (double)g * ((x[s] - m) * is);
        }
      } else {
#pragma omp simd reduction(+ : s1, s2)
        for (int64_t s = 0; s < q->s; s++) {
          s1 += dy[s];
          s2 += (double)dy[s] * ((x[s] - m) * is);
        }
      }
    }
    q->sums[c] = s1;
    q->sums[q->c + c] = s2;
    q->dbeta[c] += (float)s1;
    q->dgamma[c] += (float)s2;
  }
}

VECTOR_CLONES static void op_bn_bwd_apply(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bn_bwd_apply) *q = &op->p.bn_bwd_apply;
  double count = *q->count;
  /* dx = gamma*invstd * (dy - mean(dy) - xhat * mean(dy*xhat)), means over the (global) count */
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t c = 0; c < q->c; c++) {
      const float *x = q->x + (b * q->c + c) * q->s, *dy = q->dy + (b * q->c + c) * q->s;
      float *dx = q->dx + (b * q->c + c) * q->s;
      float m = q->mean[c], is = q->invstd[c], gi = q->gamma[c] * is;
      float mdy = (float)(q->sums[c] / count), mdyx = (float)(q->sums[q->c + c] / count);
      if (q->relu) {
        float a = is * q->gamma[c], beta = q->beta[c];
        for (int64_t s = 0; s < q->s; s++) {
          float xhat = (x[s] - m) * is, g = bn_relu_grad(dy[s], x[s], m, a, beta);
          dx[s] = gi * (g - mdy - xhat * mdyx);
        }
      } else {
        for (int64_t s = 0; s < q->s; s++) {
          float xhat = (x[s] - m) * is;
          dx[s] = gi * (dy[s] - mdy - xhat * mdyx);
        }
      }
    }
}

static void op_act_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  act_fwd(op->p.act_fwd.kind, op->p.act_fwd.n, op->p.act_fwd.x, op->p.act_fwd.y);
}

static void op_act_bwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  act_bwd(op->p.act_bwd.kind, op->p.act_bwd.n, op->p.act_bwd.x, op->p.act_bwd.y, op->p.act_bwd.dy, op->p.act_bwd.dx);
}

/* Max pooling 2x2, stride 2, no padding (every CNN here): the same choices as the general loop
 * below (first maximum in row-major order wins, a NaN wins over numbers). */
VECTOR_CLONES static void max_pool_2x2(const typeof(((dt_op *)0)->p.pool_fwd) *q) {
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < q->b * q->c; p++) {
    const float *x = q->x + p * q->h * q->w;
    float *y = q->y + p * q->ho * q->wo;
    int32_t *am = q->argmax + p * q->ho * q->wo;
    int32_t w = (int32_t)q->w;
    for (int64_t oh = 0; oh < q->ho; oh++) {
      const float *r0 = x + 2 * oh * q->w, *r1 = r0 + q->w;
      float *yo = y + oh * q->wo;
      int32_t *ao = am + oh * q->wo, row = (int32_t)(2 * oh * q->w);
      /* branch-free, so it vectorises: a candidate wins when greater, or NaN over a number */
      for (int64_t ow = 0; ow < q->wo; ow++) {
        int32_t at = row + 2 * (int32_t)ow;
        float best = r0[2 * ow], v1 = r0[2 * ow + 1], v2 = r1[2 * ow], v3 = r1[2 * ow + 1];
        int take = v1 > best || (v1 != v1 && best == best);
        best = take ? v1 : best;
        int32_t where = take ? at + 1 : at;
        take = v2 > best || (v2 != v2 && best == best);
        best = take ? v2 : best;
        where = take ? at + w : where;
        take = v3 > best || (v3 != v3 && best == best);
        best = take ? v3 : best;
        where = take ? at + w + 1 : where;
        yo[ow] = best;
        ao[ow] = where;
      }
    }
  }
}

static void op_pool_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.pool_fwd) *q = &op->p.pool_fwd;
  if (q->kind == DT_POOL_MAX && q->k == 2 && q->stride == 2 && q->ho * 2 <= q->h && q->wo * 2 <= q->w) {
    max_pool_2x2(q);
    return;
  }
  float inv = 1.0f / (float)(q->k * q->k);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t c = 0; c < q->c; c++) {
      const float *x = q->x + (b * q->c + c) * q->h * q->w;
      float *y = q->y + (b * q->c + c) * q->ho * q->wo;
      int32_t *am = q->argmax ? q->argmax + (b * q->c + c) * q->ho * q->wo : NULL;
      for (int64_t oh = 0; oh < q->ho; oh++)
        for (int64_t ow = 0; ow < q->wo; ow++) {
          float best = -INFINITY, acc = 0;
          int32_t where = 0;
          for (int64_t i = 0; i < q->k; i++)
            for (int64_t j = 0; j < q->k; j++) {
              int64_t idx = (oh * q->stride + i) * q->w + ow * q->stride + j;
              float v = x[idx];
              acc += v;
              if (v > best || (isnan(v) && !isnan(best))) {
                best = v;
                where = (int32_t)idx;
              }
            }
          if (q->kind == DT_POOL_MAX) {
            y[oh * q->wo + ow] = best;
            am[oh * q->wo + ow] = where;
          } else {
            y[oh * q->wo + ow] = acc * inv;
          }
        }
    }
}

VECTOR_CLONES static void op_pool_bwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.pool_bwd) *q = &op->p.pool_bwd;
  float inv = 1.0f / (float)(q->k * q->k);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t c = 0; c < q->c; c++) {
      float *dx = q->dx + (b * q->c + c) * q->h * q->w;
      const float *dy = q->dy + (b * q->c + c) * q->ho * q->wo;
      memset(dx, 0, (size_t)(q->h * q->w) * sizeof(float));
      if (q->kind == DT_POOL_MAX) {
        const int32_t *am = q->argmax + (b * q->c + c) * q->ho * q->wo;
        for (int64_t i = 0; i < q->ho * q->wo; i++) dx[am[i]] += dy[i];
      } else {
        for (int64_t oh = 0; oh < q->ho; oh++)
          for (int64_t ow = 0; ow < q->wo; ow++) {
            float g = dy[oh * q->wo + ow] * inv;
            for (int64_t i = 0; i < q->k; i++)
              for (int64_t j = 0; j < q->k; j++) dx[(oh * q->stride + i) * q->w + ow * q->stride + j] += g;
          }
      }
    }
}

VECTOR_CLONES static void op_dropout_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.dropout_fwd) *q = &op->p.dropout_fwd;
  float keep = 1.0f / (1.0f - q->p);
  uint64_t seed = dt_hash64(q->seed ^ *q->step_seed);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->y[i] = dt_hash_uniform(seed, (uint64_t)i) >= q->p ? q->x[i] * keep : 0.0f;
}

VECTOR_CLONES static void op_dropout_bwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.dropout_bwd) *q = &op->p.dropout_bwd;
  float keep = 1.0f / (1.0f - q->p);
  uint64_t seed = dt_hash64(q->seed ^ *q->step_seed);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->dx[i] = dt_hash_uniform(seed, (uint64_t)i) >= q->p ? q->dy[i] * keep : 0.0f;
}

VECTOR_CLONES static void op_add(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.add) *q = &op->p.add;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->y[i] = q->a[i] + q->b[i];
}

static void op_loss(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.loss) *q = &op->p.loss;
  const double weight = (q->weight_dev ? *q->weight_dev : q->weight) * (q->grad_scale ? (double)q->grad_scale[0] : 1.0);
  double total = 0, hits = 0;
#pragma omp parallel for reduction(+ : total, hits) schedule(static)
  for (int64_t b = 0; b < q->b; b++) {
    const float *z = q->logits + b * q->k;
    float *dz = q->dlogits + b * q->k;
    if (q->kind == DT_LOSS_CROSS_ENTROPY && q->ignore && q->labels[b] == q->ignore_index) {
      memset(dz, 0, (size_t)q->k * sizeof(float)); /* padding: no loss, no gradient */
    } else if (q->kind == DT_LOSS_CROSS_ENTROPY) {
      float mx = z[0];
      int64_t arg = 0;
      for (int64_t j = 1; j < q->k; j++)
        if (z[j] > mx) mx = z[j], arg = j;
      double se = 0;
      for (int64_t j = 0; j < q->k; j++) se += exp((double)(z[j] - mx));
      double lse = mx + log(se);
      int32_t y = q->labels[b];
      double eps = q->label_smoothing, off = eps / (double)q->k, l = 0;
      for (int64_t j = 0; j < q->k; j++) {
        double t = off + (j == y ? 1.0 - eps : 0.0);
        double lp = (double)z[j] - lse;
        l -= t * lp;
        dz[j] = (float)((exp(lp) - t) * weight);
      }
      total += l;
      hits += arg == y;
    } else {
      const float *t = q->targets + b * q->k;
      double l = 0;
      for (int64_t j = 0; j < q->k; j++) {
        double d = (double)z[j] - t[j];
        l += d * d;
        dz[j] = (float)(2.0 * d / (double)q->k * weight);
      }
      total += l / (double)q->k;
    }
  }
  q->sums[0] += total;
  q->sums[1] += hits;
}

VECTOR_CLONES static void op_sgd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.sgd) *q = &op->p.sgd;
  if (q->skip && *q->skip > 0) return;
  /* the fields in locals: a store through a float pointer could change a float field of *q, so the
   * loops below would reload them every element and not vectorise */
  const float lr = q->hyper[0], wd = q->weight_decay, momentum = q->momentum;
  const int first = q->hyper[1] != 0.0f, nesterov = q->nesterov;
  const float *restrict grad = q->grad;
  float *restrict param = q->param, *restrict mom = q->mom;
  /* PyTorch's SGD: g += wd*p; buf = momentum*buf + g (buf = g at first); nesterov: g += momentum*buf */
  if (momentum > 0) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < q->n; i++) {
      float g = grad[i] + wd * param[i];
      float buf = first ? g : momentum * mom[i] + g;
      mom[i] = buf;
      g = nesterov ? g + momentum * buf : buf;
      param[i] -= lr * g;
    }
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < q->n; i++) param[i] -= lr * (grad[i] + wd * param[i]);
  }
}

VECTOR_CLONES static void op_adamw(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.adamw) *q = &op->p.adamw;
  if (q->skip && *q->skip > 0) return;
  /* the fields in locals, as op_sgd's */
  const float lr = q->hyper[0], step_size = q->hyper[1], bc2_sqrt = q->hyper[2];
  const float decay = 1.0f - lr * q->weight_decay, beta1 = q->beta1, beta2 = q->beta2, eps = q->eps;
  const float rest1 = 1.0f - beta1, rest2 = 1.0f - beta2;
  const float *restrict grad = q->grad;
  float *restrict param = q->param, *restrict m = q->m, *restrict v = q->v;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) {
    float g = grad[i], p = param[i] * decay;
    float mi = beta1 * m[i] + rest1 * g, vi = beta2 * v[i] + rest2 * g * g;
    m[i] = mi;
    v[i] = vi;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    param[i] = p - step_size * mi / denom;
  }
}

static void op_scale(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.scale) *q = &op->p.scale;
  const float alpha = q->alpha;
  float *restrict x = q->x;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) x[i] *= alpha;
}

VECTOR_CLONES static void op_sumsq(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.sumsq) *q = &op->p.sumsq;
  const float *restrict x = q->x;
  /* Each thread sums its own fixed range (branch-free, in a fixed vector order) and the partial sums
   * are added in thread order: the same bits on every run with the same threads, which an OpenMP
   * reduction (combined as threads arrive) does not promise. The norm scales every clipped update. */
  enum { MAX_PARTS = 256 };
  double acc[MAX_PARTS] = {0};
  int64_t bad[MAX_PARTS] = {0};
  int parts = im->threads < MAX_PARTS ? im->threads : MAX_PARTS;
#pragma omp parallel for schedule(static, 1) num_threads(parts)
  for (int t = 0; t < parts; t++) {
    int64_t lo = q->n * t / parts, hi = q->n * (t + 1) / parts;
    double a = 0;
    int64_t b = 0;
#pragma omp simd reduction(+ : a, b)
    for (int64_t i = lo; i < hi; i++) {
      float v = x[i];
      int finite = isfinite(v);
      b += !finite;
      a += finite ? (double)v * v : 0.0;
    }
    acc[t] = a;
    bad[t] = b;
  }
  for (int t = 0; t < parts; t++) {
    q->out[0] += acc[t];
    q->out[1] += (double)bad[t];
  }
}

VECTOR_CLONES static void op_input(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.input) *q = &op->p.input;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t c = 0; c < q->c; c++) {
      const float *r = q->raw + (b * q->c + c) * q->s;
      float *x = q->x + (b * q->c + c) * q->s;
      float m = q->mean ? q->mean[c] : 0.0f, inv = q->std ? 1.0f / q->std[c] : 1.0f, scale = q->scale;
      for (int64_t s = 0; s < q->s; s++) x[s] = (r[s] * scale - m) * inv;
    }
}

VECTOR_CLONES static void op_ema(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.ema) *q = &op->p.ema;
  float d = q->decay, rest = 1.0f - q->decay;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->ema[i] = d * q->ema[i] + rest * q->x[i];
}

static void op_clip(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.clip) *q = &op->p.clip;
  double norm = sqrt(*q->sumsq);
  if (!(norm > q->max_norm)) return;
  float alpha = (float)(q->max_norm / (norm + 1e-6));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->x[i] *= alpha;
}

static void op_copy(cpu_impl *im, const dt_op *op) {
  (void)im;
  if (op->p.copy.n) memcpy(op->p.copy.y, op->p.copy.x, (size_t)op->p.copy.n * sizeof(float));
}

static void op_unscale(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.unscale) *q = &op->p.unscale;
  float inv = 1.0f / q->scaler[0]; /* as GradScaler: multiplied by the reciprocal */
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->x[i] *= inv;
}

static void op_scaler_update(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.scaler_update) *q = &op->p.scaler_update;
  float *s = q->scaler;
  if (*q->overflow > 0) {
    s[0] *= q->backoff;
    s[1] = 0;
  } else if (s[1] + 1 >= (float)q->growth_interval) {
    float grown = s[0] * q->growth;
    if (isfinite(grown)) s[0] = grown; /* as PyTorch: a scale that would overflow stays */
    s[1] = 0;
  } else {
    s[1] += 1;
  }
}

static void op_gather(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.gather) *q = &op->p.gather;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) {
    int64_t from = (int64_t)q->idx[i] * q->row, to = i * q->row;
    for (int64_t j = 0; j < q->row; j++) {
      if (q->type == DT_GATHER_I32) {
        ((int32_t *)q->out)[to + j] = ((const int32_t *)q->src)[from + j];
        continue;
      }
      float *out = (float *)q->out + to + j;
      if (q->type == DT_GATHER_U8)
        *out = (float)((const uint8_t *)q->src)[from + j];
      else if (q->type == DT_GATHER_F32)
        *out = ((const float *)q->src)[from + j];
      else
        *out = (float)((const double *)q->src)[from + j];
    }
  }
}

/* Column loops go over chunks of this many columns (a cache line), rows in increasing order. */
enum { COL_CHUNK = 16 };

static void op_embed_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.embed_fwd) *q = &op->p.embed_fwd;
  const int64_t d = q->d;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < q->n; r++) {
    int64_t tok = (int64_t)q->tokens[r];
    DT_ASSERT(tok >= 0 && tok < q->vocab);
    const float *e = q->wte + tok * d;
    float *y = q->y + r * d;
    if (q->wpe) {
      const float *p = q->wpe + (r % q->t) * d;
      for (int64_t j = 0; j < d; j++) y[j] = e[j] + p[j];
    } else {
      memcpy(y, e, (size_t)d * sizeof(float));
    }
  }
}

/* As if the rows were added in turn, n = 0, 1, ...: dwte(tok[n]) += dy(n), dwpe(n % T) += dy(n).
 * Parallel over columns (wte) and positions (wpe), never over rows, so the order is fixed; the
 * CUDA kernels add in the same order and give the same bits. */
static void op_embed_bwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.embed_bwd) *q = &op->p.embed_bwd;
  const int64_t d = q->d, chunks = (d + COL_CHUNK - 1) / COL_CHUNK;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; c++) {
    int64_t j0 = c * COL_CHUNK, j1 = j0 + COL_CHUNK < d ? j0 + COL_CHUNK : d;
    for (int64_t r = 0; r < q->n; r++) {
      int64_t tok = (int64_t)q->tokens[r];
      DT_ASSERT(tok >= 0 && tok < q->vocab);
      float *w = q->dwte + tok * d;
      const float *g = q->dy + r * d;
      for (int64_t j = j0; j < j1; j++) w[j] += g[j];
    }
  }
  if (!q->dwpe) return;
  const int64_t positions = q->t < q->n ? q->t : q->n;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < positions; t++) {
    float *w = q->dwpe + t * d;
    for (int64_t r = t; r < q->n; r += q->t) {
      const float *g = q->dy + r * d;
      for (int64_t j = 0; j < d; j++) w[j] += g[j];
    }
  }
}

/* Per row: mean and biased variance in double (two passes), rstd = 1 / sqrt(var + eps);
 * xhat = (x - mean) * rstd in double (a float mean would cost rows far from 0 their low bits),
 * y = xhat * gamma + beta in float; mean and rstd stored as float for the backward. */
VECTOR_CLONES static void op_ln_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.ln_fwd) *q = &op->p.ln_fwd;
  const int64_t d = q->d;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < q->n; r++) {
    const float *x = q->x + r * d;
    float *y = q->y + r * d;
    double s = 0, v = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < d; j++) s += x[j];
    double mu = s / (double)d;
#pragma omp simd reduction(+ : v)
    for (int64_t j = 0; j < d; j++) v += ((double)x[j] - mu) * ((double)x[j] - mu);
    double rs = 1.0 / sqrt(v / (double)d + (double)q->eps);
    for (int64_t j = 0; j < d; j++) y[j] = (float)(((double)x[j] - mu) * rs) * q->gamma[j] + q->beta[j];
    q->mean[r] = (float)mu;
    q->rstd[r] = (float)rs;
  }
}

/* xhat = (x - mean) * rstd, g = dy * gamma: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) per
 * row (means in double); dgamma += sum_n dy * xhat, dbeta += sum_n dy, in double over rows in
 * increasing order. */
VECTOR_CLONES static void op_ln_bwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.ln_bwd) *q = &op->p.ln_bwd;
  const int64_t d = q->d, chunks = (d + COL_CHUNK - 1) / COL_CHUNK;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < (q->dx ? q->n : 0); r++) { /* dx NULL: the parameter gradients only */
    const float *x = q->x + r * d, *dy = q->dy + r * d;
    float *dx = q->dx + r * d;
    float m = q->mean[r], rs = q->rstd[r];
    double a = 0, b = 0;
    for (int64_t j = 0; j < d; j++) {
      float g = dy[j] * q->gamma[j], xh = (x[j] - m) * rs;
      a += g;
      b += (double)g * xh;
    }
    float ma = (float)(a / (double)d), mb = (float)(b / (double)d);
    for (int64_t j = 0; j < d; j++) {
      float g = dy[j] * q->gamma[j], xh = (x[j] - m) * rs;
      dx[j] = rs * (g - ma - xh * mb);
    }
  }
  if (!q->n) return;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; c++) {
    int64_t j0 = c * COL_CHUNK, j1 = j0 + COL_CHUNK < d ? j0 + COL_CHUNK : d;
    double sg[COL_CHUNK] = {0}, sb[COL_CHUNK] = {0};
    for (int64_t r = 0; r < q->n; r++) {
      const float *x = q->x + r * d, *dy = q->dy + r * d;
      float m = q->mean[r], rs = q->rstd[r];
      for (int64_t j = j0; j < j1; j++) {
        sg[j - j0] += (double)dy[j] * ((x[j] - m) * rs);
        sb[j - j0] += dy[j];
      }
    }
    for (int64_t j = j0; j < j1; j++) {
      q->dgamma[j] += (float)sg[j - j0];
      q->dbeta[j] += (float)sb[j - j0];
    }
  }
}

/* Columns [0, valid) of row r take part: all t, or j <= r % t when causal (the rest are 0). */
static inline int64_t softmax_valid(int64_t r, int64_t t, int causal) {
  return causal ? r % t + 1 : t;
}

/* z = scale * x; y = exp(z - max z) / sum, the exponentials in float, their sum in double. */
VECTOR_CLONES static void op_softmax_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.softmax_fwd) *q = &op->p.softmax_fwd;
  const int64_t t = q->t;
  if (!t) return;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < q->rows; r++) {
    const float *x = q->x + r * t;
    float *y = q->y + r * t;
    int64_t valid = softmax_valid(r, t, q->causal);
    float mx = -INFINITY;
    for (int64_t j = 0; j < valid; j++) { /* fmaxf's choice (NaN ignored) without its call */
      float v = q->scale * x[j];
      mx = v > mx ? v : mx;
    }
    double s = 0;
    for (int64_t j = 0; j < valid; j++) { /* each exp once: kept in y, then scaled */
      y[j] = expf(q->scale * x[j] - mx);
      s += y[j];
    }
    float inv = (float)(1.0 / s);
    for (int64_t j = 0; j < valid; j++) y[j] *= inv;
    for (int64_t j = valid; j < t; j++) y[j] = 0.0f;
  }
}

/* dx = scale * y * (dy - sum_j dy_j y_j) (sum in double over the valid columns); masked columns get 0. */
VECTOR_CLONES static void op_softmax_bwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.softmax_bwd) *q = &op->p.softmax_bwd;
  const int64_t t = q->t;
  if (!t) return;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < q->rows; r++) {
    const float *y = q->y + r * t, *dy = q->dy + r * t;
    float *dx = q->dx + r * t;
    int64_t valid = softmax_valid(r, t, q->causal);
    double s = 0;
    for (int64_t j = 0; j < valid; j++) s += (double)dy[j] * y[j];
    float sf = (float)s;
    for (int64_t j = 0; j < valid; j++) dx[j] = q->scale * y[j] * (dy[j] - sf);
    for (int64_t j = valid; j < t; j++) dx[j] = 0.0f;
  }
}

/* The permutation as 5 dims (leading ones of size 1): y's dims and, for each, x's stride. */
typedef struct {
  int64_t ydim[5], xstride[5];
} perm5;

static perm5 permute_geometry(const dt_op *op) {
  const typeof(op->p.permute) *q = &op->p.permute;
  DT_ASSERT(q->ndim >= 2 && q->ndim <= 5);
  int64_t stride[5], s = 1;
  int seen = 0;
  for (int i = q->ndim - 1; i >= 0; i--) stride[i] = s, s *= q->dims[i];
  perm5 g;
  int pad = 5 - q->ndim;
  for (int i = 0; i < 5; i++) {
    if (i < pad) {
      g.ydim[i] = 1, g.xstride[i] = 0;
      continue;
    }
    int from = q->perm[i - pad];
    DT_ASSERT(from >= 0 && from < q->ndim && !(seen & (1 << from)));
    seen |= 1 << from;
    g.ydim[i] = q->dims[from];
    g.xstride[i] = stride[from];
  }
  return g;
}

static void op_permute(cpu_impl *im, const dt_op *op) {
  (void)im;
  const float *x = op->p.permute.x;
  float *y = op->p.permute.y;
  perm5 g = permute_geometry(op);
  const int64_t *n = g.ydim, *s = g.xstride;
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t a = 0; a < n[0]; a++)
    for (int64_t b = 0; b < n[1]; b++)
      for (int64_t c = 0; c < n[2]; c++) {
        float *out = y + ((a * n[1] + b) * n[2] + c) * n[3] * n[4];
        const float *in = x + a * s[0] + b * s[1] + c * s[2];
        for (int64_t e = 0; e < n[3]; e++)
          for (int64_t f = 0; f < n[4]; f++) out[e * n[4] + f] = in[e * s[3] + f * s[4]];
      }
}

typedef void (*cpu_op_fn)(cpu_impl *im, const dt_op *op);
static const cpu_op_fn cpu_ops[DT_OP_COUNT] = {
    [DT_OP_GEMM] = op_gemm,
    [DT_OP_BIAS_ADD] = op_bias_add,
    [DT_OP_BIAS_GRAD] = op_bias_grad,
    [DT_OP_CONV_FWD] = op_conv_fwd,
    [DT_OP_CONV_BWD_DATA] = op_conv_bwd_data,
    [DT_OP_CONV_BWD_FILTER] = op_conv_bwd_filter,
    [DT_OP_BN_STATS] = op_bn_stats,
    [DT_OP_BN_FINALIZE] = op_bn_finalize,
    [DT_OP_BN_APPLY] = op_bn_apply,
    [DT_OP_BN_BWD_STATS] = op_bn_bwd_stats,
    [DT_OP_BN_BWD_APPLY] = op_bn_bwd_apply,
    [DT_OP_ACT_FWD] = op_act_fwd,
    [DT_OP_ACT_BWD] = op_act_bwd,
    [DT_OP_POOL_FWD] = op_pool_fwd,
    [DT_OP_POOL_BWD] = op_pool_bwd,
    [DT_OP_DROPOUT_FWD] = op_dropout_fwd,
    [DT_OP_DROPOUT_BWD] = op_dropout_bwd,
    [DT_OP_ADD] = op_add,
    [DT_OP_LOSS] = op_loss,
    [DT_OP_SGD] = op_sgd,
    [DT_OP_ADAMW] = op_adamw,
    [DT_OP_SCALE] = op_scale,
    [DT_OP_SUMSQ] = op_sumsq,
    [DT_OP_CLIP] = op_clip,
    [DT_OP_COPY] = op_copy,
    [DT_OP_INPUT] = op_input,
    [DT_OP_EMA] = op_ema,
    [DT_OP_UNSCALE] = op_unscale,
    [DT_OP_SCALER_UPDATE] = op_scaler_update,
    [DT_OP_GATHER] = op_gather,
    [DT_OP_EMBED_FWD] = op_embed_fwd,
    [DT_OP_EMBED_BWD] = op_embed_bwd,
    [DT_OP_LN_FWD] = op_ln_fwd,
    [DT_OP_LN_BWD] = op_ln_bwd,
    [DT_OP_SOFTMAX_FWD] = op_softmax_fwd,
    [DT_OP_SOFTMAX_BWD] = op_softmax_bwd,
    [DT_OP_PERMUTE] = op_permute,
};

static void cpu_run(dt_backend *be, const dt_op *op) {
  DT_ASSERT(op->type >= 0 && op->type < DT_OP_COUNT && cpu_ops[op->type]);
  cpu_impl *im = be->impl;
  /* a convolution may reuse the blocked copy of an input that the one before it made */
  if (op->type != DT_OP_CONV_FWD && op->type != DT_OP_CONV_BWD_DATA && op->type != DT_OP_CONV_BWD_FILTER)
    cpu_dnnl_forget(im->dnnl);
  cpu_ops[op->type](im, op);
}

/* 64-byte aligned and zeroed. calloc takes large blocks straight from the kernel, whose pages are
 * already zero and are only touched on first use: no start-up pass over every activation buffer.
 * The block's own address sits just below the aligned one, for cpu_free. */
static float *cpu_alloc(dt_backend *be, size_t bytes) {
  (void)be;
  char *raw = calloc(1, (bytes ? bytes : 64) + 64);
  if (!raw)
    dt_die(
        "out of host memory allocating %zu bytes (%.1f MiB) for model buffers; lower train.batch_size or "
        "train.global_batch_size, or use more ranks",
        bytes, (double)bytes / 1048576.0);
  char *p = raw + 64 - ((uintptr_t)raw & 63); /* 16 to 64 bytes above raw (malloc aligns to 16) */
  memcpy(p - sizeof raw, &raw, sizeof raw);
  return (float *)p;
}

static void cpu_free(dt_backend *be, void *p) {
  (void)be;
  if (!p) return;
  char *raw;
  memcpy(&raw, (char *)p - sizeof raw, sizeof raw);
  free(raw);
}

static void cpu_copy(dt_backend *be, void *dst, const void *src, size_t bytes) {
  cpu_dnnl_forget(((cpu_impl *)be->impl)->dnnl);
  if (bytes) memmove(dst, src, bytes);
}

static void cpu_zero(dt_backend *be, void *p, size_t bytes) {
  cpu_dnnl_forget(((cpu_impl *)be->impl)->dnnl);
  memset(p, 0, bytes);
}

static void cpu_sync(dt_backend *be) {
  (void)be;
}

static int cpu_done(dt_backend *be) {
  (void)be;
  return 1;
}

static void *cpu_alloc_host(dt_backend *be, size_t bytes) {
  return cpu_alloc(be, bytes);
}

static void cpu_destroy(dt_backend *be) {
  cpu_impl *im = be->impl;
  for (int t = 0; t < im->threads; t++) {
    free(im->col[t]);
    free(im->dw[t]);
  }
  free(im->col);
  free(im->dw);
  cpu_dnnl_destroy(im->dnnl);
  free(im);
  free(be);
}

int64_t backend_cpu_onednn_runs(const dt_backend *be) {
  return cpu_dnnl_runs(((const cpu_impl *)be->impl)->dnnl);
}

int64_t backend_cpu_winograd_runs(const dt_backend *be) {
  return cpu_dnnl_winograd_runs(((const cpu_impl *)be->impl)->dnnl);
}

int64_t backend_cpu_reorders_saved(const dt_backend *be) {
  return cpu_dnnl_reorders_saved(((const cpu_impl *)be->impl)->dnnl);
}

dt_backend *backend_cpu_create(int threads) {
  return backend_cpu_create_with(threads, DT_CPU_CONV_DIRECT);
}

dt_backend *backend_cpu_create_with(int threads, int conv) {
  dt_backend *be = dt_calloc(1, sizeof *be);
  cpu_impl *im = dt_calloc(1, sizeof *im);
  if (threads < 1) threads = 1;
  im->threads = threads;
  im->col = dt_calloc((size_t)threads, sizeof(float *));
  im->dw = dt_calloc((size_t)threads, sizeof(float *));
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
  if (conv != DT_CPU_CONV_IM2COL) im->dnnl = cpu_dnnl_create(conv == DT_CPU_CONV_WINOGRAD);
  *be = (dt_backend){.name = "cpu",
                     .run = cpu_run,
                     .alloc = cpu_alloc,
                     .free = cpu_free,
                     .to_device = cpu_copy,
                     .to_host = cpu_copy,
                     .upload = cpu_copy,
                     .upload_ahead = cpu_copy,
                     .download = cpu_copy,
                     .done = cpu_done,
                     .alloc_host = cpu_alloc_host,
                     .free_host = cpu_free,
                     .zero = cpu_zero,
                     .sync = cpu_sync,
                     .destroy = cpu_destroy,
                     .threads = threads,
                     .host_memory = 1,
                     .impl = im};
  return be;
}
