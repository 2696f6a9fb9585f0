/* loss.h: the model's loss on its logits (B, K): cross_entropy{label_smoothing} against integer
 * labels, or mse against float targets (B, K) (mean over K per sample). Per-sample losses are
 * summed and dlogits weighted by 1/(targets in the global batch), so gradients summed over ranks are the gradient
 * of the global mean. The model owns one (dt_model.loss); this file knows nothing of models. */
#ifndef DT_LOSS_H
#define DT_LOSS_H

#include "backend.h"
#include "yaml_tree.h"

typedef struct {
  int kind; /* DT_LOSS_CROSS_ENTROPY or DT_LOSS_MSE */
  double label_smoothing;
  int64_t ignore_index; /* cross_entropy: labels equal to it add no loss and no gradient (padding) */
  int ignore_index_set;
  /* distillation (the distill section): how a teacher's logits join the training loss, DT_DISTILL_* (NONE: they
   * do not), with its alpha and temperature */
  int distill;
  double alpha, temperature;
} dt_loss;

/* Parses model.loss (NULL: cross_entropy; a name; or a one-key map). Returns 0 or st (exit 2). */
int loss_parse(dt_loss *l, const dt_node *node, dt_status *st);

/* "cross_entropy" or "mse". */
const char *loss_name(const dt_loss *l);

/* Queues the loss over rows x k logits: overwrites dlogits (weighted by `weight`, 1/global
 * count, and by grad_scale[0] unless it is NULL) and adds the summed per-sample loss and the hits
 * to sums[0], sums[1]. With a teacher's logits (rows x k; NULL: none) and l->distill, each row's loss
 * is distillation's mix (backend.h's loss op). Every pointer is backend memory (labels: rows int32;
 * targets: rows x k). logits16: logits and dlogits in bfloat16 rows (backend.h's loss.logits16). */
void loss_run(const dt_loss *l, dt_backend *be, int64_t rows, int64_t k, double weight, const double *weight_dev,
              const float *grad_scale, const float *logits, const float *teacher, const int32_t *labels,
              const float *targets, float *dlogits, double *sums, int logits16);

#endif
