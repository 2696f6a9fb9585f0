/* layer_conv.c: conv2d{out, kernel, stride, pad, bias}. x (B,C,H,W) -> y (B,O,Ho,Wo);
 * weight (O,C,K,K) and bias (O) as PyTorch. */
#include <math.h>
#include <stddef.h>

#include "common.h"
#include "layers.h"

#define A(field) offsetof(dt_layer_args, field)
static const dt_key conv_keys[] = {
    {"out", DT_KEY_INT, A(out), NULL, 1, 1e9, NULL, "output channels"},
    {"kernel", DT_KEY_INT, A(kernel), NULL, 1, 1024, NULL, "square kernel size"},
    {"stride", DT_KEY_INT, A(stride), "1", 1, 1024, NULL, "stride"},
    {"pad", DT_KEY_INT, A(pad), "0", 0, 1024, NULL, "zero padding on each side"},
    {"bias", DT_KEY_BOOL, A(bias), "true", 1, 0, NULL, "add a bias"},
};

static dt_conv_geom geom(const dt_layer *l, int64_t batch) {
  return (dt_conv_geom){batch,          l->in.c,        l->in.h,     l->in.w,  l->args.out,
                        l->args.kernel, l->args.stride, l->args.pad, l->out.h, l->out.w};
}

static int conv_setup(dt_model *m, dt_layer *l, dt_status *st) {
  (void)m;
  char s[64];
  shape_text(l->in, s, sizeof s);
  if (l->in.rank != 3)
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s conv2d: expects a (C, H, W) input, got %s", l->where, l->name, s);
  int64_t k = l->args.kernel, p = l->args.pad, str = l->args.stride;
  int64_t ho = (l->in.h + 2 * p - k) / str + 1, wo = (l->in.w + 2 * p - k) / str + 1;
  if (l->in.h + 2 * p < k || l->in.w + 2 * p < k)
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s conv2d: kernel %lld does not fit input %s with pad %lld", l->where,
                   l->name, (long long)k, s, (long long)p);
  l->out = (dt_shape){3, l->args.out, ho, wo};
  int64_t w[4] = {l->args.out, l->in.c, k, k};
  layer_add_tensor(l, "weight", 0, 4, w);
  if (l->args.bias) layer_add_tensor(l, "bias", 0, 1, &l->args.out);
  return 0;
}

/* Backend memory kept from forward to backward: x's 16-bit copy (l->keeps_x16), else NULL. */
typedef struct {
  void *x16; /* (B, C, H, W) as 16-bit NHWC: the backend's own layout (backend.h's conv_fwd) */
} conv_state;

/* CUDA under bf16 or fp16 runs convolutions on 16-bit copies of their operands: a layer that trains
 * keeps its forward's copy of x, so that its backward filter need not round x again. */
static void conv_pick(dt_layer *l, const dt_model *m, int cuda, size_t shared_per_block) {
  (void)shared_per_block;
  l->keeps_x16 = cuda && !m->frozen && (m->precision == DT_PREC_BF16 || m->precision == DT_PREC_FP16);
}

static size_t x16_bytes(const dt_layer *l, int64_t batch) {
  return l->keeps_x16 ? (size_t)(batch * shape_size(l->in)) * 2 : 0;
}

static void conv_alloc(dt_layer *l, dt_backend *be, dt_acts *acts, int64_t max_batch) {
  (void)be;
  conv_state *s = dt_calloc(1, sizeof *s);
  l->priv = s;
  if (l->keeps_x16) acts_take(acts, &s->x16, x16_bytes(l, max_batch));
}

static void conv_memory(const dt_layer *l, int64_t batch, int threads, dt_memory *mem) {
  (void)threads;
  mem->activations += x16_bytes(l, batch);
}

static void conv_init(dt_layer *l, float *params, float *bufs, uint64_t seed) {
  (void)bufs;
  float bound = 1.0f / sqrtf((float)(l->in.c * l->args.kernel * l->args.kernel));
  for (int t = 0; t < l->n_tensors; t++)
    init_uniform(params + l->tensors[t].offset, l->tensors[t].count, bound, dt_hash64(seed + (uint64_t)t));
}

/* The filter the convolutions read: its 16-bit copy (l->w16, model.c's pick_weights16), else the FP32 weights. */
static const float *filter(const dt_layer *l, const dt_pass *pass) {
  return l->w16 ? (const float *)layer_w16(l, pass, 0) : pass->params + l->param_off;
}

static void conv_forward(dt_layer *l, dt_pass *pass, const float *x) {
  const float *w = pass->params + l->param_off;
  dt_op op = {.type = DT_OP_CONV_FWD};
  op.p.conv_fwd.g = geom(l, pass->batch);
  op.p.conv_fwd.x = x;
  op.p.conv_fwd.w = filter(l, pass);
  op.p.conv_fwd.w16 = l->w16;
  op.p.conv_fwd.y = l->y;
  op.p.conv_fwd.x16 = ((conv_state *)l->priv)->x16;
  op.p.conv_fwd.y16 = l->y16; /* then no bias (fuse_seq) */
  op.p.conv_fwd.in16 = l->in16;
  backend_run(pass->be, &op);
  if (l->args.bias) {
    dt_op b = {.type = DT_OP_BIAS_ADD};
    b.p.bias_add = (typeof(b.p.bias_add)){
        .b = pass->batch, .c = l->args.out, .s = l->out.h * l->out.w, .y = l->y, .bias = w + l->tensors[0].count};
    backend_run(pass->be, &b);
  }
}

/* The bias first, so that the two convolutions run back to back: the second then reuses the copy
 * of dy the first made (the CPU backend's blocked one, CUDA's 16-bit one under bf16 and fp16). */
static void conv_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  float *dw = pass->grads + l->param_off;
  if (l->args.bias) {
    dt_op b = {.type = DT_OP_BIAS_GRAD};
    b.p.bias_grad = (typeof(b.p.bias_grad)){
        .b = pass->batch, .c = l->args.out, .s = l->out.h * l->out.w, .dy = l->dy, .db = dw + l->tensors[0].count};
    backend_run(pass->be, &b);
  }
  dt_op op = {.type = DT_OP_CONV_BWD_FILTER};
  op.p.conv_bwd_filter.g = geom(l, pass->batch);
  op.p.conv_bwd_filter.x = x;
  op.p.conv_bwd_filter.dy = l->dy;
  op.p.conv_bwd_filter.dw = dw;
  if (l->w16) { /* its 16-bit gradient, for the model's grads16 op (model_add_grads16) */
    DT_ASSERT(pass->grads16);
    op.p.conv_bwd_filter.dw = (float *)(pass->grads16 + l->w16_off[0]);
    op.p.conv_bwd_filter.dw16 = l->w16;
  }
  op.p.conv_bwd_filter.x16 = ((conv_state *)l->priv)->x16;
  op.p.conv_bwd_filter.dy16 = l->y16;
  op.p.conv_bwd_filter.in16 = l->in16;
  backend_run(pass->be, &op);
  if (dx) {
    dt_op d = {.type = DT_OP_CONV_BWD_DATA};
    d.p.conv_bwd_data.g = geom(l, pass->batch);
    d.p.conv_bwd_data.dy = l->dy;
    d.p.conv_bwd_data.w = filter(l, pass);
    d.p.conv_bwd_data.w16 = l->w16;
    d.p.conv_bwd_data.dx = dx;
    d.p.conv_bwd_data.dy16 = l->y16;
    d.p.conv_bwd_data.in16 = l->in16;
    backend_run(pass->be, &d);
  }
}

static int64_t conv_flops(const dt_layer *l) {
  int64_t outs = l->out.c * l->out.h * l->out.w;
  return 2 * outs * l->in.c * l->args.kernel * l->args.kernel + (l->args.bias ? outs : 0);
}

int layer_conv_geom(const dt_layer *l, int64_t batch, dt_conv_geom *g) {
  if (l->ops != &dt_layer_conv2d) return 0;
  *g = geom(l, batch);
  return 1;
}

const dt_layer_ops dt_layer_conv2d = {.kind = "conv2d",
                                      .keys = conv_keys,
                                      .n_keys = 5,
                                      .setup = conv_setup,
                                      .init = conv_init,
                                      .alloc = conv_alloc,
                                      .forward = conv_forward,
                                      .backward = conv_backward,
                                      .flops = conv_flops,
                                      .memory = conv_memory,
                                      .pick = conv_pick,
                                      .traits = DT_LAYER_CONV};
