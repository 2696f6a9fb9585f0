/* transformer.c: token and position embeddings, (causal) softmax and permute, as
 * kernels/transformer.cu; the embedding gradient adds rows in a fixed order, the same as the
 * CUDA kernels', so both backends give the same bits there. Layernorm is in norm.c. */
#include <math.h>
#include <string.h>

#include "cpu.h"

void cpu_embed_fwd(cpu_impl *im, const dt_op *op) {
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
void cpu_embed_bwd(cpu_impl *im, const dt_op *op) {
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

/* Columns [0, valid) of row r take part: all t, or j <= r % t when causal (the rest are 0). */
static inline int64_t softmax_valid(int64_t r, int64_t t, int causal) {
  return causal ? r % t + 1 : t;
}

/* z = scale * x; y = exp(z - max z) / sum, the exponentials in float, their sum in double. */
VECTOR_CLONES void cpu_softmax_fwd(cpu_impl *im, const dt_op *op) {
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
VECTOR_CLONES void cpu_softmax_bwd(cpu_impl *im, const dt_op *op) {
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

void cpu_permute(cpu_impl *im, const dt_op *op) {
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

/* One query row at a time (rows in parallel), in one pass over its keys: the running maximum m
 * rescales the sum and the output so far when it grows (online softmax); o = sum_j mask_j p_j v_j /
 * sum_j p_j, lse = m + log sum. */
VECTOR_CLONES void cpu_attention_fwd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.attention_fwd) *q = &op->p.attention_fwd;
  const dt_attention_geom *g = &q->g;
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
  (void)im;
  const typeof(op->p.attention_bwd) *q = &op->p.attention_bwd;
  const dt_attention_geom *g = &q->g;
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
