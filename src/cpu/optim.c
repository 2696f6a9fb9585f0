/* optim.c: one optimizer step over a flat range (SGD, AdamW: PyTorch's rules), fp16 loss
 * scaling (unscale, scaler update) and the EMA of the parameters, as kernels/optim.cu. */
#include <math.h>

#include "cpu.h"

/* Run r of an optimizer op's values ([*lo, *hi), its weight decay returned): the whole range with wd where
 * there is no table of runs (n_runs of a NULL table counts as 1). */
static float run_of(const dt_decay_run *runs, int n_runs, int64_t n, float wd, int r, int64_t *lo, int64_t *hi) {
  DT_ASSERT(!runs || (n_runs > 0 && runs[0].start == 0));
  if (!runs) {
    *lo = 0, *hi = n;
    return wd;
  }
  *lo = runs[r].start, *hi = r + 1 < n_runs ? runs[r + 1].start : n;
  return runs[r].weight_decay;
}

VECTOR_CLONES void cpu_sgd(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.sgd) *q = &op->p.sgd;
  if (q->skip && *q->skip > 0) return;
  /* the fields in locals: a store through a float pointer could change a float field of *q, so the
   * loops below would reload them every element and not vectorise */
  const float lr = q->hyper[0], momentum = q->momentum;
  const int first = q->hyper[1] != 0.0f, nesterov = q->nesterov;
  const float *restrict grad = q->grad;
  float *restrict param = q->param, *restrict mom = q->mom;
  /* PyTorch's SGD: g += wd*p; buf = momentum*buf + g (buf = g at first); nesterov: g += momentum*buf */
  int64_t bad = 0;
  for (int r = 0; r < (q->runs ? q->n_runs : 1); r++) {
    int64_t lo, hi;
    const float wd = run_of(q->runs, q->n_runs, q->n, q->weight_decay, r, &lo, &hi);
    if (momentum > 0) {
#pragma omp parallel for schedule(static) reduction(+ : bad)
      for (int64_t i = lo; i < hi; i++) {
        bad += !isfinite(grad[i]);
        float g = grad[i] + wd * param[i];
        float buf = first ? g : momentum * mom[i] + g;
        mom[i] = buf;
        g = nesterov ? g + momentum * buf : buf;
        param[i] -= lr * g;
      }
    } else {
#pragma omp parallel for schedule(static) reduction(+ : bad)
      for (int64_t i = lo; i < hi; i++) {
        bad += !isfinite(grad[i]);
        param[i] -= lr * (grad[i] + wd * param[i]);
      }
    }
  }
  if (q->nonfinite) *q->nonfinite += (double)bad;
}

VECTOR_CLONES void cpu_adamw(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.adamw) *q = &op->p.adamw;
  if (q->skip && *q->skip > 0) return;
  /* the fields in locals, as cpu_sgd's */
  const float lr = q->hyper[0], step_size = q->hyper[1], bc2_sqrt = q->hyper[2];
  const float beta1 = q->beta1, beta2 = q->beta2, eps = q->eps;
  const float rest1 = 1.0f - beta1, rest2 = 1.0f - beta2;
  const float *restrict grad = q->grad;
  float *restrict param = q->param, *restrict m = q->m, *restrict v = q->v;
  int64_t bad = 0;
  for (int r = 0; r < (q->runs ? q->n_runs : 1); r++) {
    int64_t lo, hi;
    const float decay = 1.0f - lr * run_of(q->runs, q->n_runs, q->n, q->weight_decay, r, &lo, &hi);
#pragma omp parallel for schedule(static) reduction(+ : bad)
    for (int64_t i = lo; i < hi; i++) {
      float g = grad[i], p = param[i] * decay;
      bad += !isfinite(g);
      float mi = beta1 * m[i] + rest1 * g, vi = beta2 * v[i] + rest2 * g * g;
      m[i] = mi;
      v[i] = vi;
      float denom = sqrtf(vi) / bc2_sqrt + eps;
      param[i] = p - step_size * mi / denom;
    }
  }
  if (q->nonfinite) *q->nonfinite += (double)bad;
}

void cpu_unscale(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.unscale) *q = &op->p.unscale;
  float inv = 1.0f / q->scaler[0]; /* as GradScaler: multiplied by the reciprocal */
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->x[i] *= inv;
}

void cpu_scaler_update(cpu_impl *im, const dt_op *op) {
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

VECTOR_CLONES void cpu_ema(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.ema) *q = &op->p.ema;
  float d = q->decay, rest = 1.0f - q->decay;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < q->n; i++) q->ema[i] = d * q->ema[i] + rest * q->x[i];
}
