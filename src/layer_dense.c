/* layer_dense.c: linear{out, bias}. x (B, in) -> y (B, out) = x W^T + b; W (out, in) as PyTorch. */
#include <math.h>
#include <stddef.h>

#include "layers.h"

#define A(field) offsetof(dt_layer_args, field)
static const dt_key linear_keys[] = {
    {"out", DT_KEY_INT, A(out), NULL, 1, 1e9, NULL, "output features"},
    {"bias", DT_KEY_BOOL, A(bias), "true", 1, 0, NULL, "add a bias"},
};

static int linear_setup(dt_model *m, dt_layer *l, dt_status *st) {
  (void)m;
  if (l->in.rank != 1) {
    char s[64];
    shape_text(l->in, s, sizeof s);
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s linear: expects a vector input, got %s (add flatten before it)",
                   l->where, l->name, s);
  }
  l->out = (dt_shape){1, l->args.out, 1, 1};
  int64_t w[2] = {l->args.out, l->in.c};
  layer_add_tensor(l, "weight", 0, 2, w);
  if (l->args.bias) layer_add_tensor(l, "bias", 0, 1, &l->args.out);
  return 0;
}

/* PyTorch: kaiming_uniform(a=sqrt(5)) gives bound 1/sqrt(fan_in) for weight and bias alike. */
static void linear_init(dt_layer *l, float *params, float *bufs, uint64_t seed) {
  (void)bufs;
  float bound = 1.0f / sqrtf((float)l->in.c);
  for (int t = 0; t < l->n_tensors; t++)
    init_uniform(params + l->tensors[t].offset, l->tensors[t].count, bound, dt_hash64(seed + (uint64_t)t));
}

static void linear_forward(dt_layer *l, dt_pass *pass, const float *x) {
  const float *w = pass->params + l->param_off;
  dt_op op = {.type = DT_OP_GEMM};
  op.p.gemm = (typeof(op.p.gemm)){.trans_a = 0,
                                  .trans_b = 1,
                                  .m = pass->batch,
                                  .n = l->args.out,
                                  .k = l->in.c,
                                  .alpha = 1.0f,
                                  .beta = 0.0f,
                                  .a = x,
                                  .b = w,
                                  .c = l->y};
  backend_run(pass->be, &op);
  if (l->args.bias) {
    dt_op b = {.type = DT_OP_BIAS_ADD};
    b.p.bias_add = (typeof(b.p.bias_add)){
        .b = pass->batch, .c = l->args.out, .s = 1, .y = l->y, .bias = w + l->args.out * l->in.c};
    backend_run(pass->be, &b);
  }
}

static void linear_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  const float *w = pass->params + l->param_off;
  float *dw = pass->grads + l->param_off;
  dt_op op = {.type = DT_OP_GEMM};
  /* dW(out, in) += dy^T(out, B) x(B, in) */
  op.p.gemm = (typeof(op.p.gemm)){.trans_a = 1,
                                  .trans_b = 0,
                                  .m = l->args.out,
                                  .n = l->in.c,
                                  .k = pass->batch,
                                  .alpha = 1.0f,
                                  .beta = 1.0f,
                                  .a = l->dy,
                                  .b = x,
                                  .c = dw};
  backend_run(pass->be, &op);
  if (l->args.bias) {
    dt_op b = {.type = DT_OP_BIAS_GRAD};
    b.p.bias_grad = (typeof(b.p.bias_grad)){
        .b = pass->batch, .c = l->args.out, .s = 1, .dy = l->dy, .db = dw + l->args.out * l->in.c};
    backend_run(pass->be, &b);
  }
  if (dx) {
    /* dx(B, in) = dy(B, out) W(out, in) */
    op.p.gemm = (typeof(op.p.gemm)){.trans_a = 0,
                                    .trans_b = 0,
                                    .m = pass->batch,
                                    .n = l->in.c,
                                    .k = l->args.out,
                                    .alpha = 1.0f,
                                    .beta = 0.0f,
                                    .a = l->dy,
                                    .b = w,
                                    .c = dx};
    backend_run(pass->be, &op);
  }
}

static int64_t linear_flops(const dt_layer *l) {
  return 2 * l->in.c * l->args.out + (l->args.bias ? l->args.out : 0);
}

const dt_layer_ops dt_layer_linear = {.kind = "linear",
                                      .keys = linear_keys,
                                      .n_keys = 2,
                                      .setup = linear_setup,
                                      .init = linear_init,
                                      .forward = linear_forward,
                                      .backward = linear_backward,
                                      .flops = linear_flops};
