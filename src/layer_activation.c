/* layer_activation.c: elementwise layers that keep the shape: relu, gelu{approximate} (erf form, or
 * PyTorch's tanh form), tanh,
 * sigmoid, dropout{p}; and flatten, (C,H,W) -> (C*H*W) in PyTorch's C,H,W order. */
#include <stddef.h>

#include "layers.h"

static int same_setup(dt_model *m, dt_layer *l, dt_status *st) {
  (void)m;
  (void)st;
  l->out = l->in;
  return 0;
}

static int act_kind(const dt_layer *l) {
  if (l->ops == &dt_layer_relu) return DT_ACT_RELU;
  if (l->ops == &dt_layer_gelu) return l->args.approximate ? DT_ACT_GELU_TANH : DT_ACT_GELU;
  if (l->ops == &dt_layer_tanh) return DT_ACT_TANH;
  return DT_ACT_SIGMOID;
}

/* A relu fused into the batchnorm, residual or linear before it (l->fused_into), or a gelu the linear before it
 * applies (l->gelu_prev), has nothing of its own to do. */
static void act_forward(dt_layer *l, dt_pass *pass, const float *x) {
  if (l->fused_into || l->gelu_prev) return;
  dt_op op = {.type = DT_OP_ACT_FWD};
  op.p.act_fwd = (typeof(op.p.act_fwd)){.kind = act_kind(l), .n = pass->batch * shape_size(l->in), .x = x, .y = l->y};
  backend_run(pass->be, &op);
}

/* Nor a gelu whose derivative the linear after it applied, into the dy it shares with the linear
 * before it (dy_of). */
static void act_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  if (!dx || l->fused_into || (l->gelu_prev && l->dy_of == l->gelu_prev)) return;
  dt_op op = {.type = DT_OP_ACT_BWD};
  op.p.act_bwd = (typeof(op.p.act_bwd)){
      .kind = act_kind(l), .n = pass->batch * shape_size(l->in), .x = x, .y = l->y, .dy = l->dy, .dx = dx};
  backend_run(pass->be, &op);
}

static int64_t act_flops(const dt_layer *l) {
  return shape_size(l->in);
}

#define ACTIVATION(var, name) \
  const dt_layer_ops var = {  \
      .kind = name, .setup = same_setup, .forward = act_forward, .backward = act_backward, .flops = act_flops}
const dt_layer_ops dt_layer_relu = {.kind = "relu",
                                    .setup = same_setup,
                                    .forward = act_forward,
                                    .backward = act_backward,
                                    .flops = act_flops,
                                    .traits = DT_LAYER_RELU};
static const dt_key gelu_keys[] = {
    {"approximate", DT_KEY_ENUM, offsetof(dt_layer_args, approximate), "none", 1, 0, "none|tanh",
     "PyTorch's approximate: tanh is GPT-2's form"},
};
const dt_layer_ops dt_layer_gelu = {.kind = "gelu",
                                    .keys = gelu_keys,
                                    .n_keys = 1,
                                    .setup = same_setup,
                                    .forward = act_forward,
                                    .backward = act_backward,
                                    .flops = act_flops,
                                    .traits = DT_LAYER_GELU};
ACTIVATION(dt_layer_tanh, "tanh");
ACTIVATION(dt_layer_sigmoid, "sigmoid");

#define A(field) offsetof(dt_layer_args, field)
static const dt_key dropout_keys[] = {
    {"p", DT_KEY_FLOAT, A(p), "0.5", 0, 0.999, NULL, "probability of zeroing an element"},
};

/* The mask is a hash of (the micro-batch's seed, which the step uploads, layer index, element), so
 * backward recomputes it. */
static uint64_t dropout_seed(const dt_layer *l) {
  return (uint64_t)l->index * 0x9e3779b97f4a7c15ULL;
}

static void dropout_forward(dt_layer *l, dt_pass *pass, const float *x) {
  int64_t n = pass->batch * shape_size(l->in);
  if (!pass->training || l->args.p == 0) {
    backend_copy(pass->be, l->y, x, n);
    return;
  }
  dt_op op = {
      .type = DT_OP_DROPOUT_FWD,
      .p.dropout_fwd = {
          .n = n, .p = (float)l->args.p, .seed = dropout_seed(l), .step_seed = pass->step_seed, .x = x, .y = l->y}};
  backend_run(pass->be, &op);
}

static void dropout_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  (void)x;
  if (!dx) return;
  int64_t n = pass->batch * shape_size(l->in);
  if (l->args.p == 0) {
    backend_copy(pass->be, dx, l->dy, n);
    return;
  }
  dt_op op = {
      .type = DT_OP_DROPOUT_BWD,
      .p.dropout_bwd = {
          .n = n, .p = (float)l->args.p, .seed = dropout_seed(l), .step_seed = pass->step_seed, .dy = l->dy, .dx = dx}};
  backend_run(pass->be, &op);
}

const dt_layer_ops dt_layer_dropout = {.kind = "dropout",
                                       .keys = dropout_keys,
                                       .n_keys = 1,
                                       .setup = same_setup,
                                       .forward = dropout_forward,
                                       .backward = dropout_backward,
                                       .flops = act_flops};

static int flatten_setup(dt_model *m, dt_layer *l, dt_status *st) {
  (void)m;
  (void)st;
  l->out = (dt_shape){1, shape_size(l->in), 1, 1};
  return 0;
}

/* Same memory order, so forward and backward are copies (on the device for GPU backends). */
static void flatten_forward(dt_layer *l, dt_pass *pass, const float *x) {
  backend_copy(pass->be, l->y, x, pass->batch * shape_size(l->in));
}

static void flatten_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  (void)x;
  if (dx) backend_copy(pass->be, dx, l->dy, pass->batch * shape_size(l->in));
}

const dt_layer_ops dt_layer_flatten = {
    .kind = "flatten", .setup = flatten_setup, .forward = flatten_forward, .backward = flatten_backward};
