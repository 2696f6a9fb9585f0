/* layer_loss.c: losses on the logits (B, K): cross_entropy{label_smoothing} against integer
 * labels, and mse against float targets (B, K) (mean over K per sample). The per-sample losses
 * are summed and dlogits weighted by 1/global_count, so gradients summed over ranks are the
 * gradient of the global mean. */
#include <stddef.h>
#include <string.h>

#include "layers.h"

#define A(field) offsetof(dt_layer_args, field)
static const dt_key ce_keys[] = {
    {"label_smoothing", DT_KEY_FLOAT, A(label_smoothing), "0", 0, 1, NULL, "PyTorch's label smoothing"},
};

int loss_parse(dt_model *m, const dt_node *node, dt_status *st) {
  char where[512];
  const char *name;
  const dt_node *params = NULL;
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
  dt_layer_args args;
  memset(&args, 0, sizeof args);
  if (!strcmp(name, "cross_entropy")) {
    m->loss_kind = DT_LOSS_CROSS_ENTROPY;
    if (keys_read(ce_keys, 1, &args, params, node, "model.loss cross_entropy: ", "parameter", st)) return st->code;
    m->label_smoothing = args.label_smoothing;
  } else if (!strcmp(name, "mse")) {
    m->loss_kind = DT_LOSS_MSE;
    if (keys_read(NULL, 0, &args, params, node, "model.loss mse: ", "parameter", st)) return st->code;
  } else {
    const char *names[] = {"cross_entropy", "mse"};
    const char *near = keys_suggest(name, names, 2);
    return dt_fail(st, DT_EXIT_INPUT, "%s: model.loss: unknown loss '%s'%s%s%s", where, name,
                   near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
  }
  return 0;
}

void loss_compute(dt_model *m, dt_pass *pass, const int32_t *labels, const float *targets, double *loss_sum,
                  double *correct) {
  double l = 0, c = 0;
  if (pass->batch > 0) {
    dt_op op = {.type = DT_OP_LOSS};
    op.p.loss = (typeof(op.p.loss)){m->loss_kind,
                                    pass->batch,
                                    m->n_outputs,
                                    (float)m->label_smoothing,
                                    1.0 / pass->global_count,
                                    model_logits(m),
                                    labels,
                                    targets,
                                    model_dlogits(m),
                                    &l,
                                    &c};
    backend_run(pass->be, &op);
  }
  *loss_sum += l;
  *correct += c;
}
