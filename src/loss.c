#include "loss.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "keys.h"

typedef struct {
  double label_smoothing;
  int64_t ignore_index;
} ce_args;

#define NO_IGNORE (-100) /* PyTorch's default ignore_index; labels are checked to be >= 0 */
static const dt_key ce_keys[] = {
    {"label_smoothing", DT_KEY_FLOAT, offsetof(ce_args, label_smoothing), "0", 0, 1, NULL, "PyTorch's label smoothing"},
    {"ignore_index", DT_KEY_INT, offsetof(ce_args, ignore_index), "-100", -100, 2147483647, NULL,
     "token models: targets equal to it (padding) add no loss or gradient"},
};

int loss_parse(dt_loss *l, const dt_node *node, dt_status *st) {
  char where[512];
  const char *name;
  const dt_node *params = NULL;
  memset(l, 0, sizeof *l);
  l->ignore_index = NO_IGNORE;
  if (!node)
    name = "cross_entropy";
  else if (node->kind == DT_NODE_SCALAR)
    name = node->scalar;
  else if (node->kind == DT_NODE_MAP && node->n == 1)
    name = node->keys[0], params = node->items[0];
  else
    return dt_fail(st, DT_EXIT_INPUT, "%s: model.loss: expected cross_entropy, mse or a one-key map",
                   yaml_where(node, where, sizeof where));
  if (node)
    yaml_where(node, where, sizeof where);
  else
    snprintf(where, sizeof where, "default");
  ce_args args = {0};
  if (!strcmp(name, "cross_entropy")) {
    l->kind = DT_LOSS_CROSS_ENTROPY;
    if (keys_read(ce_keys, 2, &args, params, node, "model.loss cross_entropy: ", "parameter", st)) return st->code;
    l->label_smoothing = args.label_smoothing;
    l->ignore_index = args.ignore_index;
    l->ignore_index_set = args.ignore_index != NO_IGNORE;
  } else if (!strcmp(name, "mse")) {
    l->kind = DT_LOSS_MSE;
    if (keys_read(NULL, 0, &args, params, node, "model.loss mse: ", "parameter", st)) return st->code;
  } else {
    const char *names[] = {"cross_entropy", "mse"};
    const char *near = keys_suggest(name, names, 2);
    return dt_fail(st, DT_EXIT_INPUT, "%s: model.loss: unknown loss '%s'%s%s%s", where, name,
                   near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
  }
  return 0;
}

const char *loss_name(const dt_loss *l) {
  return l->kind == DT_LOSS_CROSS_ENTROPY ? "cross_entropy" : "mse";
}

void loss_run(const dt_loss *l, dt_backend *be, int64_t rows, int64_t k, double weight, const double *weight_dev,
              const float *grad_scale, const float *logits, const float *teacher, const int32_t *labels,
              const float *targets, float *dlogits, double *sums, int logits16) {
  if (rows == 0) return; /* a rank with no rows this batch */
  dt_op op = {.type = DT_OP_LOSS,
              .p.loss = {.kind = l->kind,
                         .b = rows,
                         .k = k,
                         .label_smoothing = (float)l->label_smoothing,
                         .ignore = l->ignore_index_set,
                         .ignore_index = (int32_t)l->ignore_index,
                         .weight = weight,
                         .weight_dev = weight_dev,
                         .grad_scale = grad_scale,
                         .logits = logits,
                         .labels = labels,
                         .targets = targets,
                         .dlogits = dlogits,
                         .sums = sums,
                         .distill = teacher ? l->distill : DT_DISTILL_NONE,
                         .alpha = (float)l->alpha,
                         .temperature = (float)l->temperature,
                         .teacher = teacher,
                         .logits16 = logits16}};
  backend_run(be, &op);
}
