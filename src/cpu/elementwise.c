/* elementwise.c: bias add and gradient, activations, dropout, add, scale, the sum of squares and
 * clipping, copy, input normalisation and gather, as kernels/elementwise.cu. Loops are OpenMP
 * over elements, vectorised at the machine's width (VECTOR_CLONES); sums are taken in a fixed
 * order. Borrows tanh_poly.h's tanh (the one kernels/ use) and hash.h's dropout mask. */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "cpu.h"
#include "tanh_poly.h"

VECTOR_CLONES void cpu_bias_add(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bias_add) *q = &op->p.bias_add;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t c = 0; c < q->c; c++) {
      float *y = q->y + (b * q->c + c) * q->s, bias = q->bias[c];
      for (int64_t s = 0; s < q->s; s++) y[s] += bias;
    }
}

VECTOR_CLONES void cpu_bias_grad(cpu_impl *im, const dt_op *op) {
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
      if (dx == dy) { /* in place (a linear's gelu epilogue): no overlap check to send it down a scalar loop */
        float *restrict g = dx;
        const float *restrict at = x;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) g[i] = gelu_tanh_grad(at[i]) * g[i];
        break;
      }
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) dx[i] = gelu_tanh_grad(x[i]) * dy[i];
      break;
    default:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; i++) dx[i] = y[i] * (1.0f - y[i]) * dy[i];
      break;
  }
}

void cpu_act_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  act_fwd(op->p.act_fwd.kind, op->p.act_fwd.n, op->p.act_fwd.x, op->p.act_fwd.y);
}

/* 16-bit values (h16): the relu's mask, dy's bits passed as they are. */
static void relu_bwd16(const typeof(((dt_op *)0)->p.act_bwd) *q) {
  DT_ASSERT(q->kind == DT_ACT_RELU);
  const uint16_t *x = (const uint16_t *)q->x, *dy = (const uint16_t *)q->dy;
  uint16_t *dx = (uint16_t *)q->dx;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) dx[i] = dt_from_16(x[i], q->h16) > 0 ? dy[i] : 0;
}

void cpu_act_bwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  if (op->p.act_bwd.h16) {
    relu_bwd16(&op->p.act_bwd);
    return;
  }
  act_bwd(op->p.act_bwd.kind, op->p.act_bwd.n, op->p.act_bwd.x, op->p.act_bwd.y, op->p.act_bwd.dy, op->p.act_bwd.dx);
}

VECTOR_CLONES void cpu_dropout_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.dropout_fwd) *q = &op->p.dropout_fwd;
  float keep = 1.0f / (1.0f - q->p);
  uint64_t seed = dt_hash64(q->seed ^ *q->step_seed);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->y[i] = dt_hash_uniform(seed, (uint64_t)i) >= q->p ? q->x[i] * keep : 0.0f;
}

VECTOR_CLONES void cpu_dropout_bwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.dropout_bwd) *q = &op->p.dropout_bwd;
  float keep = 1.0f / (1.0f - q->p);
  uint64_t seed = dt_hash64(q->seed ^ *q->step_seed);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->dx[i] = dt_hash_uniform(seed, (uint64_t)i) >= q->p ? q->dy[i] * keep : 0.0f;
}

VECTOR_CLONES void cpu_add(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.add) *q = &op->p.add;
  if (q->h16) { /* as the FP32 loop, each sum rounded to 16 bits */
    const uint16_t *a = (const uint16_t *)q->a, *b = (const uint16_t *)q->b;
    uint16_t *y = (uint16_t *)q->y;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < q->n; i++) {
      float v = dt_from_16(a[i], q->h16) + dt_from_16(b[i], q->h16);
      y[i] = dt_to_16(q->relu && v < 0 ? 0.0f : v, q->h16);
    }
    return;
  }
  if (q->relu) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < q->n; i++) {
      float v = q->a[i] + q->b[i];
      q->y[i] = v < 0 ? 0.0f : v; /* as act_fwd's relu: NaN passes */
    }
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->y[i] = q->a[i] + q->b[i];
}

void cpu_scale(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.scale) *q = &op->p.scale;
  const float alpha = q->alpha;
  float *restrict x = q->x;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) x[i] *= alpha;
}

VECTOR_CLONES void cpu_sumsq(cpu_impl *im, const dt_op *op) {
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

VECTOR_CLONES void cpu_input(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.input) *q = &op->p.input;
  if (q->x16) { /* the FP32 values, rounded into place */
    dt_op wide = *op;
    wide.p.input.x = dt_malloc((size_t)(q->b * q->c * q->s) * sizeof(float)), wide.p.input.x16 = 0;
    cpu_input(im, &wide);
    cpu_narrow16(wide.p.input.x, q->x, q->x16, q->b, q->c, q->s);
    free(wide.p.input.x);
    return;
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t c = 0; c < q->c; c++) {
      const float *r = q->raw + (b * q->c + c) * q->s;
      float *x = q->x + (b * q->c + c) * q->s;
      float m = q->mean ? q->mean[c] : 0.0f, inv = q->std ? 1.0f / q->std[c] : 1.0f, scale = q->scale;
      for (int64_t s = 0; s < q->s; s++) x[s] = (r[s] * scale - m) * inv;
    }
}

void cpu_clip(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.clip) *q = &op->p.clip;
  double norm = sqrt(*q->sumsq);
  if (!(norm > q->max_norm)) return;
  float alpha = (float)(q->max_norm / (norm + 1e-6));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->x[i] *= alpha;
}

void cpu_copy(cpu_impl *im, const dt_op *op) {
  (void)im;
  if (op->p.copy.n) memcpy(op->p.copy.y, op->p.copy.x, (size_t)op->p.copy.n * sizeof(float));
}

void cpu_gather(cpu_impl *im, const dt_op *op) {
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

void cpu_weights16(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.weights16) *q = &op->p.weights16;
  for (int e = 0; e < q->n; e++) {
    const dt_weight16 *t = &q->table[e];
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < t->rows; r++)
      for (int64_t c = 0; c < t->cols; c++)
        for (int64_t s = 0; s < t->inner; s++)
          q->w16[t->dst + (r * t->inner + s) * t->ld + c] =
              dt_to_16(q->params[t->src + (r * t->cols + c) * t->inner + s], t->format);
  }
}

void cpu_grads16(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.grads16) *q = &op->p.grads16;
  for (int e = 0; e < q->n; e++) {
    const dt_weight16 *t = &q->table[e];
    if (!t->grad) continue;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < t->rows; r++)
      for (int64_t c = 0; c < t->cols; c++)
        for (int64_t s = 0; s < t->inner; s++)
          q->grads[t->src + (r * t->cols + c) * t->inner + s] +=
              dt_from_16(q->g16[t->dst + (r * t->inner + s) * t->ld + c], t->format);
  }
}

float *cpu_fp32_for(int format, int64_t n) {
  return format ? dt_malloc((size_t)(n + 1) * sizeof(float)) : NULL;
}

float *cpu_widen16(const void *x16, int format, int64_t b, int64_t c, int64_t s) {
  const uint16_t *h = x16;
  float *x = cpu_fp32_for(format, b * c * s);
  if (!x) return NULL;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < b; i++)
    for (int64_t ch = 0; ch < c; ch++)
      for (int64_t p = 0; p < s; p++) x[(i * c + ch) * s + p] = dt_from_16(h[(i * s + p) * c + ch], format);
  return x;
}

void cpu_narrow16(const float *x, void *x16, int format, int64_t b, int64_t c, int64_t s) {
  uint16_t *h = x16;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < b; i++)
    for (int64_t p = 0; p < s; p++)
      for (int64_t ch = 0; ch < c; ch++) h[(i * s + p) * c + ch] = dt_to_16(x[(i * c + ch) * s + p], format);
}

float *cpu_widen_rows(const void *x16, int format, int64_t rows, int64_t cols) {
  const uint16_t *h = x16;
  const int64_t ld = dt_ld16(cols);
  float *x = cpu_fp32_for(format, rows * cols);
  if (!x) return NULL;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < cols; j++) x[r * cols + j] = dt_from_16(h[r * ld + j], format);
  return x;
}

void cpu_narrow_rows(const float *x, void *x16, int format, int64_t rows, int64_t cols) {
  uint16_t *h = x16;
  const int64_t ld = dt_ld16(cols);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < cols; j++) h[r * ld + j] = dt_to_16(x[r * cols + j], format);
}
