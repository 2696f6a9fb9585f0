/* pool.c: max (argmax kept) and average pooling, NCHW, no padding, as kernels/pool.cu. */
#include <math.h>
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

void cpu_pool_fwd(cpu_impl *im, const dt_op *op) {
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

VECTOR_CLONES void cpu_pool_bwd(cpu_impl *im, const dt_op *op) {
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
