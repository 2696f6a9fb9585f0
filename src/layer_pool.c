/* layer_pool.c: maxpool{kernel, stride}, avgpool{kernel, stride} (no padding, floor as PyTorch),
 * global_avgpool: (B,C,H,W) -> (B,C). */
#include <stddef.h>
#include <stdlib.h>

#include "layers.h"

#define A(field) offsetof(dt_layer_args, field)
static const dt_key pool_keys[] = {
    {"kernel", DT_KEY_INT, A(kernel), NULL, 1, 1024, NULL, "square window"},
    {"stride", DT_KEY_INT, A(stride), "0", 0, 1024, NULL, "stride (0: the kernel size)"},
};

typedef struct {
  int32_t *argmax; /* (B, C, Ho, Wo) backend memory, max pooling only */
  float *ones;     /* (H*W) of 1/(H*W): global average pooling as a matrix-vector product */
} pool_state;

static int pool_setup(dt_model *m, dt_layer *l, dt_status *st) {
  (void)m;
  char s[64];
  shape_text(l->in, s, sizeof s);
  if (l->in.rank != 3)
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s %s: expects a (C, H, W) input, got %s", l->where, l->name,
                   l->ops->kind, s);
  if (l->args.stride == 0) l->args.stride = l->args.kernel;
  if (l->args.kernel > l->in.h || l->args.kernel > l->in.w)
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s %s: kernel %lld is larger than the input %s", l->where, l->name,
                   l->ops->kind, (long long)l->args.kernel, s);
  int64_t k = l->args.kernel, str = l->args.stride;
  l->out = (dt_shape){3, l->in.c, (l->in.h - k) / str + 1, (l->in.w - k) / str + 1};
  return 0;
}

/* maxpool's argmax is activation memory; global_avgpool's constant 1/(H*W) weights are kept. */
static void pool_alloc(dt_layer *l, dt_backend *be, dt_acts *acts, int64_t max_batch) {
  pool_state *s = dt_calloc(1, sizeof *s);
  if (l->ops == &dt_layer_maxpool)
    acts_take(acts, &s->argmax, (size_t)(max_batch * shape_size(l->out)) * sizeof(int32_t));
  if (l->ops == &dt_layer_global_avgpool) {
    int64_t hw = l->in.h * l->in.w;
    float *h = dt_malloc((size_t)hw * sizeof(float));
    for (int64_t i = 0; i < hw; i++) h[i] = 1.0f / (float)hw;
    s->ones = be->alloc(be, (size_t)hw * sizeof(float));
    be->to_device(be, s->ones, h, (size_t)hw * sizeof(float));
    free(h);
  }
  l->priv = s;
}

static void pool_release(dt_layer *l, dt_backend *be) {
  pool_state *s = l->priv;
  if (!s) return;
  if (s->ones) be->free(be, s->ones);
}

/* The pooling op of type (forward or backward) over this batch. */
static void pool_run(dt_layer *l, dt_pass *pass, dt_op_type type, const float *x, float *dx) {
  pool_state *s = l->priv;
  const dt_pool_args a = {.kind = l->ops == &dt_layer_maxpool ? DT_POOL_MAX : DT_POOL_AVG,
                          .b = pass->batch,
                          .c = l->in.c,
                          .h = l->in.h,
                          .w = l->in.w,
                          .k = l->args.kernel,
                          .stride = l->args.stride,
                          .ho = l->out.h,
                          .wo = l->out.w,
                          .x = x,
                          .y = l->y,
                          .dy = l->dy,
                          .dx = dx,
                          .argmax = s->argmax,
                          .nhwc16 = l->y16};
  DT_ASSERT(l->x16 == l->y16);
  dt_op op = {.type = type};
  if (type == DT_OP_POOL_FWD)
    op.p.pool_fwd = a;
  else
    op.p.pool_bwd = a;
  backend_run(pass->be, &op);
}

static void pool_forward(dt_layer *l, dt_pass *pass, const float *x) {
  pool_run(l, pass, DT_OP_POOL_FWD, x, NULL);
}

static void pool_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  if (dx) pool_run(l, pass, DT_OP_POOL_BWD, x, dx);
}

static int64_t pool_flops(const dt_layer *l) {
  return shape_size(l->out) * l->args.kernel * l->args.kernel;
}

static void pool_memory(const dt_layer *l, int64_t batch, int threads, dt_memory *mem) {
  (void)threads;
  if (l->ops == &dt_layer_maxpool) mem->activations += (size_t)(batch * shape_size(l->out)) * sizeof(int32_t);
  if (l->ops == &dt_layer_global_avgpool) mem->buffers += (size_t)(l->in.h * l->in.w) * sizeof(float);
}

#define POOL_LAYER(var, name, kind_traits)             \
  const dt_layer_ops var = {.kind = name,              \
                            .traits = kind_traits,     \
                            .keys = pool_keys,         \
                            .n_keys = 2,               \
                            .setup = pool_setup,       \
                            .alloc = pool_alloc,       \
                            .forward = pool_forward,   \
                            .backward = pool_backward, \
                            .release = pool_release,   \
                            .flops = pool_flops,       \
                            .memory = pool_memory}
POOL_LAYER(dt_layer_maxpool, "maxpool", DT_LAYER_MAXPOOL);
POOL_LAYER(dt_layer_avgpool, "avgpool", 0);

static int gap_setup(dt_model *m, dt_layer *l, dt_status *st) {
  (void)m;
  if (l->in.rank != 3) {
    char s[64];
    shape_text(l->in, s, sizeof s);
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s global_avgpool: expects a (C, H, W) input, got %s", l->where,
                   l->name, s);
  }
  l->out = (dt_shape){1, l->in.c, 1, 1};
  return 0;
}

/* y(B*C) = x(B*C, HW) ones(HW); dx(B*C, HW) = dy(B*C, 1) ones^T(1, HW). A 16-bit NHWC x (x16: a residual's
 * 16-bit sums) has ops of its own; y and dy stay FP32. */
static void gap_forward(dt_layer *l, dt_pass *pass, const float *x) {
  if (l->x16) {
    dt_op op = {.type = DT_OP_GAP16_FWD};
    op.p.gap16_fwd = (typeof(op.p.gap16_fwd)){
        .b = pass->batch, .s = l->in.h * l->in.w, .c = l->in.c, .format = l->x16, .x = x, .y = l->y};
    backend_run(pass->be, &op);
    return;
  }
  pool_state *s = l->priv;
  dt_op op = {.type = DT_OP_GEMM};
  op.p.gemm = (typeof(op.p.gemm)){.trans_a = 0,
                                  .trans_b = 0,
                                  .m = pass->batch * l->in.c,
                                  .n = 1,
                                  .k = l->in.h * l->in.w,
                                  .alpha = 1.0f,
                                  .beta = 0.0f,
                                  .a = x,
                                  .b = s->ones,
                                  .c = l->y};
  backend_run(pass->be, &op);
}

static void gap_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  (void)x;
  if (!dx) return;
  if (l->x16) {
    dt_op op = {.type = DT_OP_GAP16_BWD};
    op.p.gap16_bwd = (typeof(op.p.gap16_bwd)){
        .b = pass->batch, .s = l->in.h * l->in.w, .c = l->in.c, .format = l->x16, .dy = l->dy, .dx = dx};
    backend_run(pass->be, &op);
    return;
  }
  pool_state *s = l->priv;
  dt_op op = {.type = DT_OP_GEMM};
  op.p.gemm = (typeof(op.p.gemm)){.trans_a = 0,
                                  .trans_b = 0,
                                  .m = pass->batch * l->in.c,
                                  .n = l->in.h * l->in.w,
                                  .k = 1,
                                  .alpha = 1.0f,
                                  .beta = 0.0f,
                                  .a = l->dy,
                                  .b = s->ones,
                                  .c = dx};
  backend_run(pass->be, &op);
}

static int64_t gap_flops(const dt_layer *l) {
  return shape_size(l->in);
}

const dt_layer_ops dt_layer_global_avgpool = {.kind = "global_avgpool",
                                              .traits = DT_LAYER_GAP,
                                              .keys = NULL,
                                              .n_keys = 0,
                                              .setup = gap_setup,
                                              .alloc = pool_alloc,
                                              .forward = gap_forward,
                                              .backward = gap_backward,
                                              .release = pool_release,
                                              .flops = gap_flops,
                                              .memory = pool_memory};
