/* conv.c: the convolution ops (CONV_FWD, CONV_BWD_DATA, CONV_BWD_FILTER): oneDNN's where it has
 * them (dnnl.c), else im2col + a GEMM per sample through OpenBLAS, the reference the tests compare
 * oneDNN's with. Owns the per-thread im2col and filter-gradient workspaces' growth; the CUDA side is
 * src/cuda/conv.c (cuDNN). */
#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

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

/* A 16-bit filter (O, K, K, C) (w16) as FP32 (O, C, K, K); NULL for an FP32 one. */
static float *widen_filter(const float *w, int w16, const dt_conv_geom *g) {
  return cpu_widen16(w, w16, g->o, g->c, g->k * g->k);
}

/* 16-bit operands (in16, y16, dy16, w16) go through FP32 copies (cpu_widen16, cpu_narrow16). */
void cpu_conv_fwd(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.conv_fwd) *q = &op->p.conv_fwd;
  const dt_conv_geom *g = &q->g;
  DT_ASSERT(!q->in16 || !q->x16); /* a 16-bit x is its own copy (backend.h) */
  float *x = cpu_widen16(q->x, q->in16, g->b, g->c, g->h * g->w),
        *y = cpu_fp32_for(q->y16, g->b * g->o * g->ho * g->wo), *w = widen_filter(q->w, q->w16, g);
  conv_fwd(im, g, x ? x : q->x, w ? w : q->w, y ? y : q->y);
  if (y) cpu_narrow16(y, q->y, q->y16, g->b, g->o, g->ho * g->wo);
  free(x);
  free(y);
  free(w);
}

void cpu_conv_bwd_data(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.conv_bwd_data) *q = &op->p.conv_bwd_data;
  const dt_conv_geom *g = &q->g;
  float *dy = cpu_widen16(q->dy, q->dy16, g->b, g->o, g->ho * g->wo),
        *dx = cpu_fp32_for(q->in16, g->b * g->c * g->h * g->w), *w = widen_filter(q->w, q->w16, g);
  conv_bwd_data(im, g, dy ? dy : q->dy, w ? w : q->w, dx ? dx : q->dx);
  if (dx) cpu_narrow16(dx, q->dx, q->in16, g->b, g->c, g->h * g->w);
  free(dy);
  free(dx);
  free(w);
}

void cpu_conv_bwd_filter(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.conv_bwd_filter) *q = &op->p.conv_bwd_filter;
  const dt_conv_geom *g = &q->g;
  float *dy = cpu_widen16(q->dy, q->dy16, g->b, g->o, g->ho * g->wo),
        *x = cpu_widen16(q->x, q->in16, g->b, g->c, g->h * g->w);
  float *dw = q->dw16 ? dt_calloc((size_t)(g->o * g->c * g->k * g->k), sizeof *dw) : NULL; /* written, not added */
  conv_bwd_filter(im, g, x ? x : q->x, dy ? dy : q->dy, dw ? dw : q->dw);
  if (dw) cpu_narrow16(dw, q->dw, q->dw16, g->o, g->c, g->k * g->k);
  free(dy);
  free(x);
  free(dw);
}

size_t cpu_conv_scratch(cpu_impl *im, const dt_op *ops, int n) {
  size_t need[CPU_DNNL_BUFFERS] = {0}, col = 0, dw = 0;
  cpu_dnnl_plan_start(im->dnnl);
  for (int i = 0; i < n; i++) {
    const dt_op *op = &ops[i];
    const dt_conv_geom *g = op->type == DT_OP_CONV_FWD          ? &op->p.conv_fwd.g
                            : op->type == DT_OP_CONV_BWD_DATA   ? &op->p.conv_bwd_data.g
                            : op->type == DT_OP_CONV_BWD_FILTER ? &op->p.conv_bwd_filter.g
                                                                : NULL;
    if (!g) continue;
    const int kind = op->type == DT_OP_CONV_FWD        ? CPU_DNNL_FWD
                     : op->type == DT_OP_CONV_BWD_DATA ? CPU_DNNL_BWD_DATA
                                                       : CPU_DNNL_BWD_FILTER;
    if (im->dnnl && cpu_dnnl_plan(im->dnnl, kind, g, need)) continue;
    /* im2col: grow_all's per-thread columns of one sample, and filter gradients */
    const size_t ckk = (size_t)(g->c * g->k * g->k), hw = (size_t)(g->ho * g->wo);
    if (ckk * hw * sizeof(float) > col) col = ckk * hw * sizeof(float);
    if (kind == CPU_DNNL_BWD_FILTER && (size_t)g->o * ckk * sizeof(float) > dw) dw = (size_t)g->o * ckk * sizeof(float);
  }
  size_t total = (size_t)im->threads * (col + dw);
  for (int k = 0; k < CPU_DNNL_BUFFERS; k++) total += need[k];
  return total;
}
