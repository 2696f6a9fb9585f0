/* pool.c: max (argmax kept) and average pooling, NCHW (max pooling also 16-bit NHWC), no padding, as
 * kernels/pool.cu. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

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

/* argmax between (B, C, S) and (B, S, C): to_nhwc 1 from the first to the second, 0 back. */
static void transpose_argmax(const int32_t *src, int32_t *dst, int64_t b, int64_t c, int64_t s, int to_nhwc) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < b; i++)
    for (int64_t ch = 0; ch < c; ch++)
      for (int64_t p = 0; p < s; p++) {
        const int64_t nchw = (i * c + ch) * s + p, nhwc = (i * s + p) * c + ch;
        if (to_nhwc)
          dst[nhwc] = src[nchw];
        else
          dst[nchw] = src[nhwc];
      }
}

/* 16-bit NHWC (nhwc16): the FP32 op on widened NCHW copies, y rounded back (exactly: a maximum is one of
 * x's values), argmax transposed. */
static void pool_fwd16(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.pool_fwd) *q = &op->p.pool_fwd;
  DT_ASSERT(q->kind == DT_POOL_MAX);
  const int64_t s = q->ho * q->wo;
  float *x = cpu_widen16(q->x, q->nhwc16, q->b, q->c, q->h * q->w), *y = cpu_fp32_for(q->nhwc16, q->b * q->c * s);
  int32_t *am = dt_malloc((size_t)(q->b * q->c * s + 1) * sizeof *am);
  dt_op fp32 = *op;
  fp32.p.pool_fwd.nhwc16 = 0, fp32.p.pool_fwd.x = x, fp32.p.pool_fwd.y = y, fp32.p.pool_fwd.argmax = am;
  cpu_pool_fwd(im, &fp32);
  cpu_narrow16(y, q->y, q->nhwc16, q->b, q->c, s);
  transpose_argmax(am, q->argmax, q->b, q->c, s, 1);
  free(x);
  free(y);
  free(am);
}

/* The same for the backward: dx summed in FP32 and rounded once. */
static void pool_bwd16(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.pool_bwd) *q = &op->p.pool_bwd;
  DT_ASSERT(q->kind == DT_POOL_MAX);
  const int64_t s = q->ho * q->wo;
  float *dy = cpu_widen16(q->dy, q->nhwc16, q->b, q->c, s), *dx = cpu_fp32_for(q->nhwc16, q->b * q->c * q->h * q->w);
  int32_t *am = dt_malloc((size_t)(q->b * q->c * s + 1) * sizeof *am);
  transpose_argmax(q->argmax, am, q->b, q->c, s, 0);
  dt_op fp32 = *op;
  fp32.p.pool_bwd.nhwc16 = 0, fp32.p.pool_bwd.dy = dy, fp32.p.pool_bwd.dx = dx, fp32.p.pool_bwd.argmax = am;
  cpu_pool_bwd(im, &fp32);
  cpu_narrow16(dx, q->dx, q->nhwc16, q->b, q->c, q->h * q->w);
  free(dy);
  free(dx);
  free(am);
}

void cpu_pool_fwd(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.pool_fwd) *q = &op->p.pool_fwd;
  if (q->nhwc16) {
    pool_fwd16(im, op);
    return;
  }
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
          int32_t where = (int32_t)(oh * q->stride * q->w + ow * q->stride); /* a window of -inf: its first */
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

VECTOR_CLONES void cpu_pool_bwd(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.pool_bwd) *q = &op->p.pool_bwd;
  if (q->nhwc16) {
    pool_bwd16(im, op);
    return;
  }
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

/* Global average pooling of 16-bit NHWC values (backend.h's gap16_fwd): each (b, c)'s sum over s in order,
 * divided once, as the CUDA kernel does. */
void cpu_gap16_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.gap16_fwd) *q = &op->p.gap16_fwd;
  const uint16_t *x = q->x;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t c = 0; c < q->c; c++) {
      float sum = 0.0f;
      for (int64_t s = 0; s < q->s; s++) sum += dt_from_16(x[(b * q->s + s) * q->c + c], q->format);
      q->y[b * q->c + c] = sum / (float)q->s;
    }
}

void cpu_gap16_bwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.gap16_bwd) *q = &op->p.gap16_bwd;
  uint16_t *dx = q->dx;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < q->b; b++)
    for (int64_t s = 0; s < q->s; s++)
      for (int64_t c = 0; c < q->c; c++)
        dx[(b * q->s + s) * q->c + c] = dt_to_16(q->dy[b * q->c + c] / (float)q->s, q->format);
}
