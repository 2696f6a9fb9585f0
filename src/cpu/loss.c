/* loss.c: the loss op (cross-entropy with label smoothing and ignored rows, or MSE; a teacher's
 * logits mixed in by KL or MSE for distillation): loss sums and dlogits in double, as
 * kernels/loss.cu. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"

/* What distillation needs of a row before its elements: log-sum-exps of the student's and the
 * teacher's logits at temperature T, as max / T + log(se), kept apart for accuracy. */
typedef struct {
  double s_max, s_log_se, t_max, t_log_se;
} row_softmax;

static row_softmax distill_row(const float *z, const float *t, int64_t k, double temp) {
  row_softmax r = {z[0], 0, t[0], 0};
  for (int64_t j = 1; j < k; j++) {
    if (z[j] > r.s_max) r.s_max = z[j];
    if (t[j] > r.t_max) r.t_max = t[j];
  }
  double ss = 0, st = 0;
  for (int64_t j = 0; j < k; j++) {
    ss += exp(((double)z[j] - r.s_max) / temp);
    st += exp(((double)t[j] - r.t_max) / temp);
  }
  r.s_log_se = log(ss), r.t_log_se = log(st);
  return r;
}

/* Element j's distillation term: its gradient (by the student's logit, before alpha) into *grad, its
 * part of the row's loss returned. */
static double distill_element(int kind, const row_softmax *r, double z, double t, int64_t k, double temp,
                              double *grad) {
  if (kind == DT_DISTILL_MSE) {
    double d = z - t;
    *grad = 2.0 * d / (double)k;
    return d * d / (double)k;
  }
  double ls = (z - r->s_max) / temp - r->s_log_se, lt = (t - r->t_max) / temp - r->t_log_se;
  double pt = exp(lt);
  *grad = temp * (exp(ls) - pt);       /* T^2 d KL / dz = T (p_student - p_teacher) */
  return temp * temp * pt * (lt - ls); /* T^2 p_t (log p_t - log p_s) */
}

void cpu_loss(cpu_impl *im, const dt_op *op) {
  const typeof(op->p.loss) *q = &op->p.loss;
  if (q->logits16) { /* the FP32 op on the widened logits; dlogits rounded to nearest even from its floats */
    float *z = cpu_widen_rows(q->logits, q->logits16, q->b, q->k), *dz = cpu_fp32_for(q->logits16, q->b * q->k);
    dt_op fp32 = *op;
    fp32.p.loss.logits16 = 0, fp32.p.loss.logits = z, fp32.p.loss.dlogits = dz;
    cpu_loss(im, &fp32);
    cpu_narrow_rows(dz, q->dlogits, q->logits16, q->b, q->k);
    free(z);
    free(dz);
    return;
  }
  const double weight = (q->weight_dev ? *q->weight_dev : q->weight) * (q->grad_scale ? (double)q->grad_scale[0] : 1.0);
  const double alpha = q->alpha, keep = 1.0 - alpha, temp = q->temperature;
  double total = 0, hits = 0;
#pragma omp parallel for reduction(+ : total, hits) schedule(static)
  for (int64_t b = 0; b < q->b; b++) {
    const float *z = q->logits + b * q->k;
    const float *tz = q->distill ? q->teacher + b * q->k : NULL;
    float *dz = q->dlogits + b * q->k;
    if (q->kind == DT_LOSS_CROSS_ENTROPY && q->ignore && q->labels[b] == q->ignore_index) {
      memset(dz, 0, (size_t)q->k * sizeof(float)); /* padding: no loss, no gradient */
      continue;
    }
    row_softmax r = {0};
    if (q->distill == DT_DISTILL_KL) r = distill_row(z, tz, q->k, temp);
    double own = 0, dist = 0;
    if (q->kind == DT_LOSS_CROSS_ENTROPY) {
      float mx = z[0];
      int64_t arg = 0;
      for (int64_t j = 1; j < q->k; j++)
        if (z[j] > mx) mx = z[j], arg = j;
      double se = 0;
      for (int64_t j = 0; j < q->k; j++) se += exp((double)(z[j] - mx));
      double lse = mx + log(se);
      int32_t y = q->labels[b];
      double eps = q->label_smoothing, off = eps / (double)q->k;
      for (int64_t j = 0; j < q->k; j++) {
        double t = off + (j == y ? 1.0 - eps : 0.0);
        double lp = (double)z[j] - lse;
        own -= t * lp;
        double g = exp(lp) - t;
        if (q->distill) {
          double dg;
          dist += distill_element(q->distill, &r, z[j], tz[j], q->k, temp, &dg);
          g = keep * g + alpha * dg;
        }
        dz[j] = (float)(g * weight);
      }
      hits += arg == y;
    } else {
      const float *t = q->targets + b * q->k;
      for (int64_t j = 0; j < q->k; j++) {
        double d = (double)z[j] - t[j];
        own += d * d;
        double g = 2.0 * d / (double)q->k;
        if (q->distill) {
          double dg;
          dist += distill_element(q->distill, &r, z[j], tz[j], q->k, temp, &dg);
          g = keep * g + alpha * dg;
        }
        dz[j] = (float)(g * weight);
      }
      own /= (double)q->k;
    }
    total += q->distill ? keep * own + alpha * dist : own;
  }
  q->sums[0] += total;
  q->sums[1] += hits;
}
