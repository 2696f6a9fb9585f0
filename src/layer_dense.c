/* layer_dense.c: linear{out, bias, tie}. x (B, in) -> y (B, out) = x W^T + b; W (out, in) as PyTorch.
 * On a sequence (B, T, in) it acts on each position's vector. tie: "<layer>" takes the weight from
 * that (earlier) embedding's tok.weight (vocab, D): one tensor, whose gradient sums both uses. */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "layers.h"

#define A(field) offsetof(dt_layer_args, field)
static const dt_key linear_keys[] = {
    {"out", DT_KEY_INT, A(out), NULL, 1, 1e9, NULL, "output features"},
    {"bias", DT_KEY_BOOL, A(bias), "true", 1, 0, NULL, "add a bias"},
    {"tie", DT_KEY_STRING, A(tie), "", 1, 0, NULL, "name of an earlier embedding layer whose tok.weight is the weight"},
};

static dt_layer *find_layer(dt_model *m, const char *name) {
  for (int i = 0; i < m->n_all; i++)
    if (!strcmp(m->all[i]->name, name)) return m->all[i];
  return NULL;
}

static int linear_setup(dt_model *m, dt_layer *l, dt_status *st) {
  if (l->in.rank == 3) {
    char s[64];
    shape_text(l->in, s, sizeof s);
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s linear: expects a vector input, got %s (add flatten before it)",
                   l->where, l->name, s);
  }
  l->out = (dt_shape){l->in.rank, l->args.out, l->in.h, 1};
  if (l->args.tie && l->args.tie[0]) {
    dt_layer *e = find_layer(m, l->args.tie);
    if (!e || e == l || !(e->ops->traits & DT_LAYER_EMBEDDING))
      return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s linear: tie '%s' names no earlier embedding layer", l->where,
                     l->name, l->args.tie);
    if (e->args.vocab != l->args.out || e->args.dim != l->in.c)
      return dt_fail(
          st, DT_EXIT_INPUT,
          "%s: layer %s linear: tied to %s's (%lld, %lld) tok.weight, but this layer is (%lld, %lld) (out, in)",
          l->where, l->name, e->name, (long long)e->args.vocab, (long long)e->args.dim, (long long)l->args.out,
          (long long)l->in.c);
    l->tied = e;
  } else {
    int64_t w[2] = {l->args.out, l->in.c};
    layer_add_tensor(l, "weight", 0, 2, w);
  }
  if (l->args.bias) layer_add_tensor(l, "bias", 0, 1, &l->args.out);
  return 0;
}

/* PyTorch: kaiming_uniform(a=sqrt(5)) gives bound 1/sqrt(fan_in) for weight and bias alike. */
void dense_init(dt_layer *l, float *params, float *bufs, uint64_t seed) {
  (void)bufs;
  float bound = 1.0f / sqrtf((float)l->in.c);
  for (int t = 0; t < l->n_tensors; t++)
    init_uniform(params + l->tensors[t].offset, l->tensors[t].count, bound, dt_hash64(seed + (uint64_t)t));
}

/* Offsets into the flat buffers of the weight (out, in) and the bias (out). */
static int64_t weight_off(const dt_layer *l) {
  return l->tied ? l->tied->tensors[0].offset : l->param_off;
}
static int64_t bias_off(const dt_layer *l) {
  return l->tied ? l->param_off : l->param_off + l->args.out * l->in.c;
}

dt_op dense_gemm(int kind, int64_t rows, int64_t in, int64_t out) {
  dt_op op = {.type = DT_OP_GEMM};
  if (kind == DENSE_FWD) /* y(rows, out) = x(rows, in) W^T(in, out) */
    op.p.gemm = (typeof(op.p.gemm)){.trans_b = 1, .m = rows, .n = out, .k = in, .alpha = 1.0f, .beta = 0.0f};
  else if (kind == DENSE_DW) /* dW(out, in) += dy^T(out, rows) x(rows, in) */
    op.p.gemm = (typeof(op.p.gemm)){.trans_a = 1, .m = out, .n = in, .k = rows, .alpha = 1.0f, .beta = 1.0f};
  else /* dx(rows, in) = dy(rows, out) W(out, in) */
    op.p.gemm = (typeof(op.p.gemm)){.m = rows, .n = in, .k = out, .alpha = 1.0f, .beta = 0.0f};
  return op;
}

int dense_reads_w16(int w16, int64_t rows, int64_t in, int64_t out, int x16, int y16) {
  const int64_t widest = in > out ? in : out, limit = (int64_t)1 << 31; /* gemm16_plan's copy of A */
  return w16 && (x16 || y16 || rows >= DT_GEMM16_MIN_DIM) && rows * widest < limit ? DT_F16_BF16 : DT_F16_NONE;
}

/* W's operand: its bfloat16 copy (w16) where the GEMM runs on bfloat16 operands (dense_reads_w16), else W. The
 * forward's and the input gradient's (n, k) are (out, in) and (in, out). */
static void weight_operand(typeof(((dt_op *)0)->p.gemm) *g, const float *w, const void *w16, int x16, int y16) {
  g->b16 = dense_reads_w16(w16 != NULL, g->m, g->n, g->k, x16, y16);
  g->b = g->b16 ? (const float *)w16 : w;
}

void dense_forward(dt_backend *be, int64_t rows, int64_t in, int64_t out, const float *x, const float *w,
                   const void *w16, const float *bias, float *y, float *gelu_y, int relu, int x16, int y16) {
  dt_op op = dense_gemm(DENSE_FWD, rows, in, out);
  op.p.gemm.a = x, op.p.gemm.c = y, op.p.gemm.bias = bias, op.p.gemm.a16 = x16, op.p.gemm.c16 = y16;
  weight_operand(&op.p.gemm, w, w16, x16, y16);
  if (gelu_y) op.p.gemm.epilogue = DT_GEMM_GELU_TANH, op.p.gemm.aux = y, op.p.gemm.c = gelu_y;
  if (relu) op.p.gemm.epilogue = DT_GEMM_RELU;
  backend_run(be, &op);
}

void dense_backward(dt_backend *be, int64_t rows, int64_t in, int64_t out, const float *x, const float *w,
                    const void *w16, const float *dy, const float *relu_y, float *dw, float *dbias, float *dx,
                    float *dgelu_x, int x16, int y16) {
  DT_ASSERT(!y16 || !relu_y);
  /* the two GEMMs back to back: under bf16 the CUDA backend copies dy to bfloat16 once for both, and sums
   * dbias's columns as it copies */
  dt_op op = dense_gemm(DENSE_DW, rows, in, out);
  op.p.gemm.a = dy, op.p.gemm.b = x, op.p.gemm.c = dw, op.p.gemm.a16 = y16, op.p.gemm.b16 = x16;
  op.p.gemm.a_col_sums = dbias;
  op.p.gemm.relu_y = relu_y;
  backend_run(be, &op);
  if (dx) {
    op = dense_gemm(DENSE_DX, rows, in, out);
    op.p.gemm.a = dy, op.p.gemm.c = dx, op.p.gemm.a16 = y16, op.p.gemm.c16 = x16;
    weight_operand(&op.p.gemm, w, w16, x16, y16);
    if (dgelu_x) op.p.gemm.epilogue = DT_GEMM_DGELU_TANH, op.p.gemm.aux = dgelu_x;
    backend_run(be, &op);
  }
}

int layer_dense_products(const dt_layer *l, int64_t batch, int64_t products[2][8]) {
  const int64_t rows = shape_rows(l->in, batch), c = l->in.c;
  if (l->ops == &dt_layer_linear) {
    products[0][0] = rows, products[0][1] = c, products[0][2] = l->args.out;
    products[0][3] = l->args.bias || l->gelu_next || l->dgelu_aux || l->fused_relu, products[0][4] = l->y16;
    products[0][5] = l->args.bias, products[0][6] = l->x16;
    products[0][7] = dense_reads_w16(l->w16, rows, c, l->args.out, l->x16, l->y16);
    return 1;
  }
  if (l->ops != &dt_layer_attention) return 0;
  for (int p = 0; p < 2; p++) {
    products[p][0] = rows, products[p][1] = c, products[p][2] = p ? c : 3 * c;
    products[p][3] = 1, products[p][4] = p ? 0 : l->heads16, products[p][5] = 1,
    products[p][6] = p ? l->heads16 : l->x16;
    products[p][7] = dense_reads_w16(l->w16, rows, c, products[p][2], (int)products[p][6], (int)products[p][4]);
  }
  return 2;
}

/* With a gelu after it (gelu_next), y is the gelu's input and the GEMM writes the gelu's output too; with a
 * relu after it (fused_relu, model.fuse), the GEMM writes the relu's output, y, which the relu borrows. The
 * classifier under bf16 (y16, model.c's pick_logits16) writes bfloat16 logits for the loss, whose gradient
 * its backward GEMMs read as the loss wrote it; a transformer's MLP under bf16 (model.c's pick_gelu16) keeps
 * its hidden activations so: the first linear writes the gelu's input and output, and reads its dy, in
 * bfloat16 rows (y16), the second reads x and writes dx (through the gelu's derivative) so (x16). */
static void linear_forward(dt_layer *l, dt_pass *pass, const float *x) {
  dense_forward(pass->be, shape_rows(l->in, pass->batch), l->in.c, l->args.out, x, pass->params + weight_off(l),
                layer_w16(l, pass, 0), l->args.bias ? pass->params + bias_off(l) : NULL, l->y,
                l->gelu_next ? l->gelu_next->y : NULL, l->fused_relu, l->x16, l->y16);
}

/* After such a gelu (dgelu_aux), dx goes through the gelu's derivative at its input. A fused relu's gradient
 * (dy, shared) is masked first in place where y, its output, is not positive: the relu's own backward, bit for
 * bit (as a residual's), by the weight gradient's op, which on CUDA in FP32 sums the bias gradient in the same
 * pass. */
static void linear_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  /* a fused relu has a layer after it, so its linear is not the classifier, the one with 16-bit y */
  dense_backward(pass->be, shape_rows(l->in, pass->batch), l->in.c, l->args.out, x, pass->params + weight_off(l),
                 layer_w16(l, pass, 0), l->dy, l->fused_relu ? l->y : NULL, pass->grads + weight_off(l),
                 l->args.bias ? pass->grads + bias_off(l) : NULL, dx, l->dgelu_aux ? l->dgelu_aux->y : NULL, l->x16,
                 l->y16);
}

static int64_t linear_flops(const dt_layer *l) {
  return shape_rows(l->in, 1) * (2 * l->in.c * l->args.out + (l->args.bias ? l->args.out : 0));
}

const dt_layer_ops dt_layer_linear = {.kind = "linear",
                                      .keys = linear_keys,
                                      .n_keys = 3,
                                      .setup = linear_setup,
                                      .init = dense_init,
                                      .forward = linear_forward,
                                      .backward = linear_backward,
                                      .flops = linear_flops,
                                      .traits = DT_LAYER_LINEAR | DT_LAYER_FUSES_RELU};
