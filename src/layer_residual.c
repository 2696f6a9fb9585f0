/* layer_residual.c: residual{body, shortcut}: y = body(x) + shortcut(x), the shortcut being the
 * identity when omitted; with model.fuse a relu right after it is applied in the same pass (as a
 * batchnorm's is), and between 16-bit NHWC layers (model.c's pick_trunk16) x, y and their gradients are
 * 16-bit NHWC too, as are the branches' ends. Tensors are named "<i>.body.<j>.*" and "<i>.shortcut.<j>.*". */
#include <stddef.h>
#include <stdio.h>

#include "layers.h"

#define A(field) offsetof(dt_layer_args, field)
static const dt_key residual_keys[] = {
    {"body", DT_KEY_NODE, A(body), NULL, 1, 0, NULL, "list of layers"},
    {"shortcut", DT_KEY_NODE, A(shortcut), "{}", 1, 0, NULL, "list of layers (identity when omitted)"},
};

typedef struct {
  float *dx_short; /* (B, in) backend memory, as x (x16) */
} residual_state;

static int residual_setup(dt_model *m, dt_layer *l, dt_status *st) {
  char prefix[160], what[200];
  snprintf(prefix, sizeof prefix, "%s.body.", l->name);
  snprintf(what, sizeof what, "layer %s residual body", l->name);
  if (seq_build(m, &l->body, l->args.body, l->in, prefix, what, st)) return st->code;
  if (l->body.n == 0) return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s residual: body is empty", l->where, l->name);
  dt_shape body_out = l->body.layers[l->body.n - 1]->out, short_out = l->in;
  if (l->args.shortcut && !(l->args.shortcut->kind == DT_NODE_MAP && l->args.shortcut->n == 0)) {
    snprintf(prefix, sizeof prefix, "%s.shortcut.", l->name);
    snprintf(what, sizeof what, "layer %s residual shortcut", l->name);
    if (seq_build(m, &l->shortcut, l->args.shortcut, l->in, prefix, what, st)) return st->code;
    if (l->shortcut.n) short_out = l->shortcut.layers[l->shortcut.n - 1]->out;
  }
  if (shape_size(body_out) != shape_size(short_out) || body_out.c != short_out.c || body_out.h != short_out.h) {
    char a[64], b[64];
    shape_text(body_out, a, sizeof a);
    shape_text(short_out, b, sizeof b);
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s residual: body gives %s but the shortcut gives %s", l->where,
                   l->name, a, b);
  }
  l->out = body_out;
  return 0;
}

/* The shortcut's dx: as x, 16-bit when x is (model.c's pick_trunk16). */
static size_t dx_short_bytes(const dt_layer *l, int64_t batch) {
  return (size_t)(batch * shape_size(l->in)) * (l->x16 ? 2 : sizeof(float));
}

static void residual_alloc(dt_layer *l, dt_backend *be, dt_acts *acts, int64_t max_batch) {
  (void)be;
  residual_state *s = dt_calloc(1, sizeof *s);
  l->priv = s;
  acts_take(acts, &s->dx_short, dx_short_bytes(l, max_batch));
}

static void residual_forward(dt_layer *l, dt_pass *pass, const float *x) {
  seq_forward(&l->body, pass, x);
  const float *shortcut = x;
  if (l->shortcut.n) {
    seq_forward(&l->shortcut, pass, x);
    shortcut = l->shortcut.layers[l->shortcut.n - 1]->y;
  }
  dt_op op = {.type = DT_OP_ADD};
  op.p.add = (typeof(op.p.add)){.n = pass->batch * shape_size(l->out),
                                .a = l->body.layers[l->body.n - 1]->y,
                                .b = shortcut,
                                .y = l->y,
                                .relu = l->fused_relu,
                                .h16 = l->y16};
  DT_ASSERT(l->x16 == l->y16);
  backend_run(pass->be, &op);
}

/* Shortcut first: its parameters sit after the body's, and gradients complete from the end. Each
 * branch's last layer reads its gradient from l->dy itself (model.c's dy_of): with a fused relu, the
 * relu's gradient (the buffers are shared), masked first in place where y, relu's output, is not
 * positive (where the sum is not: the relu layer's own backward, bit for bit). */
static void residual_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  residual_state *s = l->priv;
  DT_ASSERT(l->body.layers[l->body.n - 1]->dy == l->dy);
  if (l->fused_relu) layer_mask_relu_dy(l, pass, pass->batch * shape_size(l->out));
  if (l->shortcut.n) {
    DT_ASSERT(l->shortcut.layers[l->shortcut.n - 1]->dy == l->dy);
    seq_backward(&l->shortcut, pass, x, dx ? s->dx_short : NULL);
  }
  seq_backward(&l->body, pass, x, dx);
  if (!dx || l->body.layers[0]->dx_adds == l) return; /* else a layernorm opening the body has added dy */
  dt_op op = {.type = DT_OP_ADD};
  op.p.add = (typeof(op.p.add)){
      .n = pass->batch * shape_size(l->in), .a = dx, .b = l->shortcut.n ? s->dx_short : l->dy, .y = dx, .h16 = l->x16};
  backend_run(pass->be, &op);
}

static int64_t residual_flops(const dt_layer *l) {
  return shape_size(l->out);
}

static void residual_memory(const dt_layer *l, int64_t batch, int threads, dt_memory *mem) {
  (void)threads;
  mem->activations += dx_short_bytes(l, batch);
}

const dt_layer_ops dt_layer_residual = {.kind = "residual",
                                        .traits = DT_LAYER_BLOCK | DT_LAYER_FUSES_RELU | DT_LAYER_RESIDUAL,
                                        .keys = residual_keys,
                                        .n_keys = 2,
                                        .setup = residual_setup,
                                        .alloc = residual_alloc,
                                        .forward = residual_forward,
                                        .backward = residual_backward,
                                        .flops = residual_flops,
                                        .memory = residual_memory};
