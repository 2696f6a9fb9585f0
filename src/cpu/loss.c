/* loss.c: the loss op (cross-entropy with label smoothing and ignored rows, or MSE): loss sums and
 * dlogits in double, as kernels/loss.cu. */
#include <math.h>
#include <string.h>

#include "cpu.h"

void cpu_loss(cpu_impl *im, const dt_op *op) {
  (void)im;
  const typeof(op->p.loss) *q = &op->p.loss;
  const double weight = (q->weight_dev ? *q->weight_dev : q->weight) * (q->grad_scale ? (double)q->grad_scale[0] : 1.0);
  double total = 0, hits = 0;
#pragma omp parallel for reduction(+ : total, hits) schedule(static)
  for (int64_t b = 0; b < q->b; b++) {
    const float *z = q->logits + b * q->k;
    float *dz = q->dlogits + b * q->k;
    if (q->kind == DT_LOSS_CROSS_ENTROPY && q->ignore && q->labels[b] == q->ignore_index) {
      memset(dz, 0, (size_t)q->k * sizeof(float)); /* padding: no loss, no gradient */
    } else if (q->kind == DT_LOSS_CROSS_ENTROPY) {
      float mx = z[0];
      int64_t arg = 0;
      for (int64_t j = 1; j < q->k; j++)
        if (z[j] > mx) mx = z[j], arg = j;
      double se = 0;
      for (int64_t j = 0; j < q->k; j++) se += exp((double)(z[j] - mx));
      double lse = mx + log(se);
      int32_t y = q->labels[b];
      double eps = q->label_smoothing, off = eps / (double)q->k, l = 0;
      for (int64_t j = 0; j < q->k; j++) {
        double t = off + (j == y ? 1.0 - eps : 0.0);
        double lp = (double)z[j] - lse;
        l -= t * lp;
        dz[j] = (float)((exp(lp) - t) * weight);
      }
      total += l;
      hits += arg == y;
    } else {
      const float *t = q->targets + b * q->k;
      double l = 0;
      for (int64_t j = 0; j < q->k; j++) {
        double d = (double)z[j] - t[j];
        l += d * d;
        dz[j] = (float)(2.0 * d / (double)q->k * weight);
      }
      total += l / (double)q->k;
    }
  }
  q->sums[0] += total;
  q->sums[1] += hits;
}
