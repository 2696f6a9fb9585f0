/* attention.c: the fused attention ops (backend.h's DT_OP_ATTENTION_*), as kernels/attention.cu
 * computes them: one query row at a time forward, one head at a time backward, the (T, T) scores never
 * stored. The reference the stand-in tests hold the kernels to; the CPU's model.attention auto runs the
 * materialised path (layer_attention.c), which OpenBLAS makes the faster here. */
#include <math.h>
#include <stdlib.h>

#include "cpu.h"
#include "half.h"

/* x . y over n values, in 8 interleaved partial sums (vectorisable without reassociation) added in
 * a fixed order: the same bits every run. */
static inline float dot8(const float *x, const float *y, int64_t n) {
  float part[8] = {0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int u = 0; u < 8; u++) part[u] += x[d + u] * y[d + u];
  for (int u = 0; d < n; d++, u++) part[u] += x[d] * y[d];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/* The dropout factor of probability (head, i, j): keep or 0, as cpu_dropout_fwd on element (head T + i) T + j. */
static inline float attention_mask(uint64_t seed, float p, float keep, int64_t head, int64_t t, int64_t i, int64_t j) {
  return dt_hash_uniform(seed, (uint64_t)((head * t + i) * t + j)) >= p ? keep : 0.0f;
}

/* Where head `head` (b H + h) starts in a buffer of row stride ld (backend.h's dt_attention_geom). */
static inline int64_t attention_head_offset(const dt_attention_geom *g, int64_t head, int64_t ld) {
  return head / g->h * g->t * ld + head % g->h * g->hd;
}

/* The values the B T rows of heads span in a buffer of row stride ld. */
static int64_t heads_extent(const dt_attention_geom *g, int64_t ld) {
  const int64_t rows = g->b * g->t;
  return rows ? (rows - 1) * ld + g->h * g->hd : 0;
}

/* Zeroed FP32 heads of that extent: an output's. */
static float *fresh_heads(const dt_attention_geom *g, int64_t ld) {
  return dt_calloc((size_t)heads_extent(g, ld) + 1, sizeof(float));
}

/* The heads in a buffer of row stride ld as FP32, from their bfloat16 values (g->io16). */
static float *widen_heads(const void *x16, const dt_attention_geom *g, int64_t ld) {
  const uint16_t *h = x16;
  const int64_t n = heads_extent(g, ld);
  float *x = fresh_heads(g, ld);
  for (int64_t i = 0; i < n; i++) x[i] = dt_from_bf16(h[i]);
  return x;
}

/* The heads' values of x (as widen_heads lays them out) rounded into their bfloat16 places; nothing else of
 * the buffer is written (q, k and v share one). */
static void narrow_heads(const float *x, void *x16, const dt_attention_geom *g, int64_t ld) {
  uint16_t *h = x16;
  for (int64_t r = 0; r < g->b * g->t; r++)
    for (int64_t e = 0; e < g->h * g->hd; e++) h[r * ld + e] = dt_to_bf16(x[r * ld + e]);
}

/* One query row at a time (rows in parallel), in one pass over its keys: the running maximum m
 * rescales the sum and the output so far when it grows (online softmax); o = sum_j mask_j p_j v_j /
 * sum_j p_j, lse = m + log sum. */
VECTOR_CLONES void cpu_attention_fwd(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.attention_fwd) *q = &op->p.attention_fwd;
  const dt_attention_geom *g = &q->g;
  if (g->io16) { /* bfloat16 heads: widened, the op in FP32, o rounded back */
    dt_op fp32 = *op;
    typeof(fp32.p.attention_fwd) *f = &fp32.p.attention_fwd;
    float *qw = widen_heads(q->q, g, g->ld_qkv), *kw = widen_heads(q->k, g, g->ld_qkv);
    float *vw = widen_heads(q->v, g, g->ld_qkv), *ow = fresh_heads(g, g->ld_o);
    f->g.io16 = 0, f->q = qw, f->k = kw, f->v = vw, f->o = ow;
    cpu_attention_fwd(im, &fp32);
    narrow_heads(ow, q->o, g, g->ld_o);
    free(qw), free(kw), free(vw), free(ow);
    return;
  }
  const int64_t t = g->t, hd = g->hd;
  const uint64_t seed = g->p > 0 ? dt_hash64(g->seed ^ *g->step_seed) : 0;
  const float keep = g->p > 0 ? 1.0f / (1.0f - g->p) : 1.0f;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < g->b * g->h * t; r++) {
    const int64_t head = r / t, i = r % t, valid = g->causal ? i + 1 : t;
    const int64_t in = attention_head_offset(g, head, g->ld_qkv), ld = g->ld_qkv;
    const float *qi = q->q + in + i * ld, *k = q->k + in, *v = q->v + in;
    float *o = q->o + attention_head_offset(g, head, g->ld_o) + i * g->ld_o;
    for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
    float mx = -INFINITY;
    double sum = 0;
    for (int64_t j = 0; j < valid; j++) {
      float s = g->scale * dot8(qi, k + j * ld, hd);
      if (s > mx) {
        float c = expf(mx - s);
        sum *= c;
        for (int64_t d = 0; d < hd; d++) o[d] *= c;
        mx = s;
      }
      float pj = expf(s - mx);
      sum += pj;
      if (g->p > 0) pj *= attention_mask(seed, g->p, keep, head, t, i, j);
      const float *vj = v + j * ld;
      for (int64_t d = 0; d < hd; d++) o[d] += pj * vj[d];
    }
    float inv = (float)(1.0 / sum);
    for (int64_t d = 0; d < hd; d++) o[d] *= inv;
    q->lse[r] = mx + (float)log(sum);
  }
}

/* One head at a time (heads in parallel, so dk and dv have one writer): for each row i and key j,
 * p = exp(scale q_i . k_j - lse_i), dp = dout_i . v_j (masked as forward), ds = scale p (dp - delta_i);
 * dv_j += mask p dout_i, dq_i += ds k_j, dk_j += ds q_i, rows in increasing order. */
VECTOR_CLONES void cpu_attention_bwd(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.attention_bwd) *q = &op->p.attention_bwd;
  const dt_attention_geom *g = &q->g;
  if (g->io16) { /* as the forward: dq, dk, dv rounded back */
    dt_op fp32 = *op;
    typeof(fp32.p.attention_bwd) *f = &fp32.p.attention_bwd;
    const int64_t ld = g->ld_qkv, ldo = g->ld_o;
    float *w[8] = {widen_heads(q->q, g, ld),  widen_heads(q->k, g, ld),     widen_heads(q->v, g, ld),
                   widen_heads(q->o, g, ldo), widen_heads(q->dout, g, ldo), fresh_heads(g, ld),
                   fresh_heads(g, ld),        fresh_heads(g, ld)};
    f->g.io16 = 0, f->q = w[0], f->k = w[1], f->v = w[2], f->o = w[3], f->dout = w[4];
    f->dq = w[5], f->dk = w[6], f->dv = w[7];
    cpu_attention_bwd(im, &fp32);
    narrow_heads(w[5], q->dq, g, ld), narrow_heads(w[6], q->dk, g, ld), narrow_heads(w[7], q->dv, g, ld);
    for (int i = 0; i < 8; i++) free(w[i]);
    return;
  }
  const int64_t t = g->t, hd = g->hd, ld = g->ld_qkv, ldo = g->ld_o;
  const uint64_t seed = g->p > 0 ? dt_hash64(g->seed ^ *g->step_seed) : 0;
  const float keep = g->p > 0 ? 1.0f / (1.0f - g->p) : 1.0f;
#pragma omp parallel for schedule(static)
  for (int64_t head = 0; head < g->b * g->h; head++) {
    const int64_t in = attention_head_offset(g, head, ld), out = attention_head_offset(g, head, ldo);
    const float *qh = q->q + in, *k = q->k + in, *v = q->v + in, *o = q->o + out, *dout = q->dout + out;
    float *dq = q->dq + in, *dk = q->dk + in, *dv = q->dv + in;
    for (int64_t j = 0; j < t; j++)
      for (int64_t d = 0; d < hd; d++) dk[j * ld + d] = dv[j * ld + d] = 0.0f;
    for (int64_t i = 0; i < t; i++) {
      const int64_t r = head * t + i, valid = g->causal ? i + 1 : t;
      const float *qi = qh + i * ld, *doi = dout + i * ldo;
      float *dqi = dq + i * ld;
      const float delta = dot8(doi, o + i * ldo, hd), lse = q->lse[r];
      q->delta[r] = delta;
      for (int64_t d = 0; d < hd; d++) dqi[d] = 0.0f;
      for (int64_t j = 0; j < valid; j++) {
        float p = expf(g->scale * dot8(qi, k + j * ld, hd) - lse), dp = dot8(doi, v + j * ld, hd);
        float pk = p;
        if (g->p > 0) {
          float m = attention_mask(seed, g->p, keep, head, t, i, j);
          pk *= m, dp *= m;
        }
        float ds = g->scale * p * (dp - delta);
        float *dvj = dv + j * ld, *dkj = dk + j * ld;
        const float *kj = k + j * ld;
        for (int64_t d = 0; d < hd; d++) {
          dvj[d] += pk * doi[d];
          dqi[d] += ds * kj[d];
          dkj[d] += ds * qi[d];
        }
      }
    }
  }
}
