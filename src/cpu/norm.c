/* norm.c: batchnorm (statistics, finalize, apply and their backward, with the fused relu) and
 * layernorm, as kernels/norm.cu: statistics in double, reductions in an order fixed by the shapes. */
#include <math.h>
#include <stdlib.h>

#include "cpu.h"

/* A batchnorm op's 16-bit operands (x16; the apply's y16, the backward's dy16 and dx) as FP32 copies
 * (cpu_widen16), each op below running again on them: x and dy widened (dy NULL where FP32), out a new
 * buffer for y or dx where that is 16-bit, rounded back into it by bn_narrow. */
typedef struct {
  float *x, *dy, *out;
} bn_wide;

static bn_wide bn_widen(const float *x, int x16, const float *dy, int dy16, int out16, int64_t b, int64_t c,
                        int64_t s) {
  return (bn_wide){
      .x = cpu_widen16(x, x16, b, c, s), .dy = cpu_widen16(dy, dy16, b, c, s), .out = cpu_fp32_for(out16, b * c * s)};
}

static void bn_narrow(bn_wide *w, float *out, int out16, int64_t b, int64_t c, int64_t s) {
  if (w->out) cpu_narrow16(w->out, out, out16, b, c, s);
  free(w->x);
  free(w->dy);
  free(w->out);
}

VECTOR_CLONES void cpu_bn_stats(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bn_stats) *q = &op->p.bn_stats;
  if (q->x16) {
    dt_op wide = *op;
    bn_wide w = bn_widen(q->x, q->x16, NULL, 0, 0, q->b, q->c, q->s);
    wide.p.bn_stats.x = w.x, wide.p.bn_stats.x16 = 0;
    cpu_bn_stats(im, &wide);
    bn_narrow(&w, NULL, 0, q->b, q->c, q->s);
    return;
  }
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
  if (q->finalize) {
    dt_op fin = {.type = DT_OP_BN_FINALIZE, .p.bn_finalize = *q->finalize};
    cpu_bn_finalize(im, &fin);
  }
}

/* Batch statistics (biased variance) from the sums, running statistics updated with the unbiased
 * one, as PyTorch; in evaluation the running statistics. Double precision, as kernels/norm.cu. */
void cpu_bn_finalize(cpu_impl *im, const dt_op *op) {
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

VECTOR_CLONES void cpu_bn_apply(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bn_apply) *q = &op->p.bn_apply;
  DT_ASSERT(!q->y16 || q->y16 == q->x16); /* a 16-bit y only beside a 16-bit x (backend.h) */
  if (q->x16) {
    dt_op wide = *op;
    bn_wide w = bn_widen(q->x, q->x16, NULL, 0, q->y16, q->b, q->c, q->s);
    wide.p.bn_apply.x = w.x, wide.p.bn_apply.x16 = 0;
    if (w.out) wide.p.bn_apply.y = w.out, wide.p.bn_apply.y16 = 0;
    cpu_bn_apply(im, &wide);
    bn_narrow(&w, q->y, q->y16, q->b, q->c, q->s);
    return;
  }
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

VECTOR_CLONES void cpu_bn_bwd_stats(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bn_bwd_stats) *q = &op->p.bn_bwd_stats;
  DT_ASSERT(!q->dy16 || q->dy16 == q->x16);
  if (q->x16) {
    dt_op wide = *op;
    bn_wide w = bn_widen(q->x, q->x16, q->dy, q->dy16, 0, q->b, q->c, q->s);
    wide.p.bn_bwd_stats.x = w.x, wide.p.bn_bwd_stats.x16 = 0;
    if (w.dy) wide.p.bn_bwd_stats.dy = w.dy, wide.p.bn_bwd_stats.dy16 = 0;
    cpu_bn_bwd_stats(im, &wide);
    bn_narrow(&w, NULL, 0, q->b, q->c, q->s);
    return;
  }
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

VECTOR_CLONES void cpu_bn_bwd_apply(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.bn_bwd_apply) *q = &op->p.bn_bwd_apply;
  DT_ASSERT(!q->dy16 || q->dy16 == q->x16);
  if (q->x16) { /* dx too: FP32, then rounded into the 16-bit dx */
    dt_op wide = *op;
    bn_wide w = bn_widen(q->x, q->x16, q->dy, q->dy16, q->x16, q->b, q->c, q->s);
    wide.p.bn_bwd_apply.x = w.x, wide.p.bn_bwd_apply.dx = w.out, wide.p.bn_bwd_apply.x16 = 0;
    if (w.dy) wide.p.bn_bwd_apply.dy = w.dy, wide.p.bn_bwd_apply.dy16 = 0;
    cpu_bn_bwd_apply(im, &wide);
    bn_narrow(&w, q->dx, q->x16, q->b, q->c, q->s);
    return;
  }
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

/* Per row: mean and biased variance in double (two passes), rstd = 1 / sqrt(var + eps);
 * xhat = (x - mean) * rstd in double (a float mean would cost rows far from 0 their low bits),
 * y = xhat * gamma + beta in float; mean and rstd stored as float for the backward. */
VECTOR_CLONES void cpu_ln_fwd(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.ln_fwd) *q = &op->p.ln_fwd;
  const int64_t d = q->d;
  if (q->y16) { /* y in FP32, then rounded into its 16-bit rows */
    dt_op fp32 = *op;
    fp32.p.ln_fwd.y16 = 0, fp32.p.ln_fwd.y = cpu_fp32_for(q->y16, q->n * d);
    cpu_ln_fwd(im, &fp32);
    cpu_narrow_rows(fp32.p.ln_fwd.y, q->y, q->y16, q->n, d);
    free(fp32.p.ln_fwd.y);
    return;
  }
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
 * row (means in double), plus dx_add (rounded first: the add op's sum); dgamma += sum_n dy * xhat,
 * dbeta += sum_n dy, in double over rows in increasing order. */
VECTOR_CLONES void cpu_ln_bwd(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.ln_bwd) *q = &op->p.ln_bwd;
  const int64_t d = q->d, chunks = (d + COL_CHUNK - 1) / COL_CHUNK;
  if (q->dy16) { /* dy widened from its 16-bit rows */
    dt_op fp32 = *op;
    float *dy = cpu_widen_rows(q->dy, q->dy16, q->n, d);
    fp32.p.ln_bwd.dy16 = 0, fp32.p.ln_bwd.dy = dy;
    cpu_ln_bwd(im, &fp32);
    free(dy);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < (q->dx ? q->n : 0); r++) { /* dx NULL: the parameter gradients only */
    const float *x = q->x + r * d, *dy = q->dy + r * d;
    float *dx = q->dx + r * d;
    const float *add = q->dx_add ? q->dx_add + r * d : NULL;
    float m = q->mean[r], rs = q->rstd[r];
    double a = 0, b = 0;
    for (int64_t j = 0; j < d; j++) {
      float g = dy[j] * q->gamma[j], xh = (x[j] - m) * rs;
      a += g;
      b += (double)g * xh;
    }
    float ma = (float)(a / (double)d), mb = (float)(b / (double)d);
    for (int64_t j = 0; j < d; j++) {
      float g = dy[j] * q->gamma[j], xh = (x[j] - m) * rs, v = rs * (g - ma - xh * mb);
      dx[j] = add ? v + add[j] : v;
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
