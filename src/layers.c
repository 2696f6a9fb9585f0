/* layers.c: the layer kinds a config may name, in the order --config-keys lists them, and what layers share. */
#include <string.h>

#include "layers.h"

const dt_layer_ops *const dt_layer_kinds[] = {
    &dt_layer_linear,   &dt_layer_conv2d,         &dt_layer_batchnorm, &dt_layer_maxpool,
    &dt_layer_avgpool,  &dt_layer_global_avgpool, &dt_layer_relu,      &dt_layer_gelu,
    &dt_layer_tanh,     &dt_layer_sigmoid,        &dt_layer_dropout,   &dt_layer_flatten,
    &dt_layer_residual, &dt_layer_embedding,      &dt_layer_layernorm, &dt_layer_attention};
const int dt_n_layer_kinds = (int)(sizeof dt_layer_kinds / sizeof *dt_layer_kinds);

void layer_mask_relu_dy(dt_layer *l, dt_pass *pass, int64_t n) {
  dt_op op = {.type = DT_OP_ACT_BWD};
  op.p.act_bwd = (typeof(op.p.act_bwd)){
      .kind = DT_ACT_RELU, .n = n, .x = l->y, .y = l->y, .dy = l->dy, .dx = l->dy, .h16 = l->y16};
  backend_run(pass->be, &op);
}

const dt_layer_ops *layer_kind(const char *kind) {
  for (int k = 0; k < dt_n_layer_kinds; k++)
    if (!strcmp(kind, dt_layer_kinds[k]->kind)) return dt_layer_kinds[k];
  return NULL;
}
