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
