/* layer_attention.c: attention{heads, causal, dropout}: multi-head self-attention over a sequence
 * (T, C), as GPT-2's: qkv = x Wqkv^T + b (T, 3C) = [q | k | v], each C split into H heads of
 * hd = C/H; per head softmax(q k^T / sqrt(hd)) (causal: position i sees j <= i), dropout on the
 * probabilities, times v; heads concatenated (T, C); y = that Wproj^T + b.
 * Tensors as two torch.nn.Linear: qkv.weight (3C, C), qkv.bias, proj.weight (C, C), proj.bias.
 * Work per layer: GEMMs for the projections and between them either the fused attention ops
 * (model.attention, attention_pick: they read q, k, v from the (B, T, 3, H, hd) projections and write
 * the merged heads, no (B*H, T, T) buffer) or the materialised path: permutes to and from the
 * (3, B, H, T, hd) layout, strided-batched GEMMs over B*H heads, a softmax op and the dropout op. */
#include <math.h>
#include <stddef.h>

#include "layers.h"

#define A(field) offsetof(dt_layer_args, field)
static const dt_key attention_keys[] = {
    {"heads", DT_KEY_INT, A(heads), NULL, 1, 4096, NULL, "heads; the width must divide by it"},
    {"causal", DT_KEY_BOOL, A(causal), "true", 1, 0, NULL, "position i attends to positions <= i"},
    {"dropout", DT_KEY_FLOAT, A(p), "0", 0, 0.999, NULL, "dropout on the attention probabilities (training)"},
};

/* Backend memory for max_batch samples; forward keeps what backward reads. */
typedef struct {
  float *qkv;    /* (B*T, 3C) = (B, T, 3, H, hd) */
  float *merged; /* (B*T, C) = (B, T, H, hd): heads concatenated per position */
  /* fused only (NULL materialised) */
  float *lse;   /* (B*H, T) each row's log sum exp */
  float *delta; /* (B*H, T) backward scratch */
  /* materialised only (NULL fused) */
  float *heads; /* (3, B, H, T, hd): q, k, v per head */
  float *probs; /* (B*H, T, T) softmax output */
  float *kept;  /* (B*H, T, T) after dropout; NULL without dropout (the probs are kept) */
  float *att;   /* (B*H, T, hd) */
  /* backward scratch: d_merged, d_qkv always; the rest materialised only, d_probs with dropout only */
  float *d_merged, *d_qkv, *d_att, *d_kept, *d_probs, *d_scores, *d_heads;
} attention_state;

/* model.attention: fused (auto: on CUDA); on CUDA only where the kernels take the head's width and
 * their shared memory fits the GPU's blocks (attention_geom.h). */
static void attention_pick(dt_layer *l, const dt_model *m, int cuda, size_t shared_per_block) {
  const int64_t hd = l->in.c / l->args.heads;
  const int asked = m->attention == DT_ATTENTION_FUSED || (m->attention == DT_ATTENTION_AUTO && cuda);
  l->fused_attention = asked && (!cuda || dt_attention_fits(hd, shared_per_block));
}

static int attention_setup(dt_model *m, dt_layer *l, dt_status *st) {
  if (l->in.rank != 2)
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s attention: expects a sequence (T, C) (after an embedding)",
                   l->where, l->name);
  int64_t c = l->in.c;
  if (c % l->args.heads)
    return dt_fail(st, DT_EXIT_INPUT, "%s: layer %s attention: width %lld does not divide into %lld heads", l->where,
                   l->name, (long long)c, (long long)l->args.heads);
  l->out = l->in;
  attention_pick(l, m, 0, 0);
  int64_t wqkv[2] = {3 * c, c}, bqkv = 3 * c, wproj[2] = {c, c};
  layer_add_tensor(l, "qkv.weight", 0, 2, wqkv);
  layer_add_tensor(l, "qkv.bias", 0, 1, &bqkv);
  layer_add_tensor(l, "proj.weight", 0, 2, wproj);
  layer_add_tensor(l, "proj.bias", 0, 1, &c);
  return 0;
}

/* Bytes of a (B*T, C) buffer (2 a value under heads16: the projections, the heads and their gradients), of the
 * (B*H, T, T) ones (materialised) and of the (B*H, T) ones (fused). */
static void sizes(const dt_layer *l, int64_t batch, size_t *seq, size_t *square, size_t *rows) {
  int64_t t = l->in.h;
  *seq = (size_t)(batch * t * l->in.c) * (l->heads16 ? 2 : sizeof(float));
  *square = (size_t)(batch * l->args.heads * t * t) * sizeof(float);
  *rows = (size_t)(batch * l->args.heads * t) * sizeof(float);
}

/* Per sample: the projections (T, 3C), or the (H, T, T) scores and probabilities when larger
 * (materialised). */
static int64_t attention_row_values(const dt_layer *l) {
  const int64_t t = l->in.h, square = l->args.heads * t * t, heads = 3 * t * l->in.c;
  return !l->fused_attention && square > heads ? square : heads;
}

static int attention_causal(const dt_layer *l) {
  return l->args.causal;
}

/* Everything is activation memory: the backward scratch (d_*) too, which lives only in backward. */
static void attention_alloc(dt_layer *l, dt_backend *be, dt_acts *acts, int64_t max_batch) {
  (void)be;
  attention_state *s = dt_calloc(1, sizeof *s);
  l->priv = s;
  size_t seq, sq, rows;
  sizes(l, max_batch, &seq, &sq, &rows);
  acts_take(acts, &s->qkv, 3 * seq);
  acts_take(acts, &s->merged, seq);
  acts_take(acts, &s->d_merged, seq);
  acts_take(acts, &s->d_qkv, 3 * seq);
  if (l->fused_attention) { /* the ops read and write the four above in place: no per-head copies */
    acts_take(acts, &s->lse, rows);
    acts_take(acts, &s->delta, rows);
    return;
  }
  acts_take(acts, &s->heads, 3 * seq);
  acts_take(acts, &s->att, seq);
  acts_take(acts, &s->d_att, seq);
  acts_take(acts, &s->d_heads, 3 * seq);
  acts_take(acts, &s->probs, sq);
  acts_take(acts, &s->d_kept, sq);
  acts_take(acts, &s->d_scores, sq);
  if (l->args.p > 0) { /* without dropout the kept probabilities are the probabilities */
    acts_take(acts, &s->kept, sq);
    acts_take(acts, &s->d_probs, sq);
  }
}

static void attention_memory(const dt_layer *l, int64_t batch, int threads, dt_memory *mem) {
  (void)threads;
  size_t seq, sq, rows;
  sizes(l, batch, &seq, &sq, &rows);
  int drop = l->args.p > 0;
  if (l->fused_attention)
    mem->activations += 3 * seq * 2 + seq * 2 + 2 * rows;
  else
    mem->activations += 3 * seq * 4 + seq * 4 + sq * (size_t)(3 + 2 * drop);
}

/* Queues `count` row-major products C = op(A) op(B) of (m, k) and (k, n), strided by their sizes. */
static void batched_gemm(dt_backend *be, int64_t count, int ta, int tb, int64_t m, int64_t n, int64_t k, const float *a,
                         const float *b, float *c) {
  if (count == 0) return; /* a rank with no rows: batch 0 would mean one product */
  dt_op op = {.type = DT_OP_GEMM,
              .p.gemm = {.trans_a = ta,
                         .trans_b = tb,
                         .m = m,
                         .n = n,
                         .k = k,
                         .alpha = 1.0f,
                         .beta = 0.0f,
                         .a = a,
                         .b = b,
                         .c = c,
                         .batch = count,
                         .stride_a = m * k,
                         .stride_b = k * n,
                         .stride_c = m * n}};
  backend_run(be, &op);
}

static void permute(dt_backend *be, int ndim, const int64_t *dims, const int *perm, const float *x, float *y) {
  dt_op op = {.type = DT_OP_PERMUTE, .p.permute = {.ndim = ndim, .x = x, .y = y}};
  for (int i = 0; i < ndim; i++) op.p.permute.dims[i] = dims[i], op.p.permute.perm[i] = perm[i];
  backend_run(be, &op);
}

/* The layouts, for b samples: qkv (B, T, 3, H, hd) <-> heads (3, B, H, T, hd), and
 * att (B, H, T, hd) <-> merged (B, T, H, hd). */
static const int to_heads[5] = {2, 0, 3, 1, 4}, from_heads[5] = {1, 3, 0, 2, 4}, swap_th[4] = {0, 2, 1, 3};

static uint64_t attention_seed(const dt_layer *l) {
  return (uint64_t)l->index * 0x9e3779b97f4a7c15ULL + 0x5bd1e995ULL;
}

/* Materialised: att (B*H, T, hd) = dropout(softmax(scale q k^T)) v through the (B*H, T, T) buffers. */
static void heads_forward_materialized(dt_layer *l, dt_pass *pass, const float *q, const float *k, const float *v) {
  attention_state *s = l->priv;
  dt_backend *be = pass->be;
  const int64_t t = l->in.h, hd = l->in.c / l->args.heads, bh = pass->batch * l->args.heads;
  float *kept = s->kept ? s->kept : s->probs;
  batched_gemm(be, bh, 0, 1, t, t, hd, q, k, s->d_scores); /* raw scores (B*H, T, T), as scratch */
  dt_op sm = {.type = DT_OP_SOFTMAX_FWD,
              .p.softmax_fwd = {.rows = bh * t,
                                .t = t,
                                .causal = l->args.causal,
                                .scale = 1.0f / sqrtf((float)hd),
                                .x = s->d_scores,
                                .y = s->probs}};
  backend_run(be, &sm);
  if (s->kept) {
    if (pass->training) {
      dt_op d = {.type = DT_OP_DROPOUT_FWD,
                 .p.dropout_fwd = {.n = bh * t * t,
                                   .p = (float)l->args.p,
                                   .seed = attention_seed(l),
                                   .step_seed = pass->step_seed,
                                   .x = s->probs,
                                   .y = s->kept}};
      backend_run(be, &d);
    } else {
      backend_copy(be, kept, s->probs, bh * t * t);
    }
  }
  batched_gemm(be, bh, 0, 0, t, hd, t, kept, v, s->att);
}

/* Element i of a buffer of the heads (qkv, merged and their gradients): bfloat16 under heads16. */
static float *element(float *buf, int64_t i, int heads16) {
  return heads16 ? (float *)((uint16_t *)buf + i) : buf + i;
}

/* The fused ops' geometry over the layer's own buffers: q, k, v in (B, T, 3, H, hd), o in (B, T, H, hd). */
static dt_attention_geom fused_geom(const dt_layer *l, const dt_pass *pass) {
  const int64_t c = l->in.c, h = l->args.heads;
  return (dt_attention_geom){.b = pass->batch,
                             .h = h,
                             .t = l->in.h,
                             .hd = c / h,
                             .ld_qkv = 3 * c,
                             .ld_o = c,
                             .causal = l->args.causal,
                             .scale = 1.0f / sqrtf((float)(c / h)),
                             .p = pass->training ? (float)l->args.p : 0.0f, /* dropout only in training */
                             .seed = attention_seed(l),
                             .step_seed = pass->step_seed,
                             .io16 = l->heads16};
}

static void attention_forward(dt_layer *l, dt_pass *pass, const float *x) {
  attention_state *s = l->priv;
  dt_backend *be = pass->be;
  const float *w = pass->params;
  const int64_t b = pass->batch, t = l->in.h, c = l->in.c, h = l->args.heads, hd = c / h;
  dense_forward(be, b * t, c, 3 * c, x, w + l->tensors[0].offset, layer_w16(l, pass, 0), w + l->tensors[1].offset,
                s->qkv, NULL, 0, l->x16, l->heads16);
  if (l->fused_attention) {
    dt_op op = {.type = DT_OP_ATTENTION_FWD,
                .p.attention_fwd = {.g = fused_geom(l, pass),
                                    .q = s->qkv,
                                    .k = element(s->qkv, c, l->heads16),
                                    .v = element(s->qkv, 2 * c, l->heads16),
                                    .o = s->merged,
                                    .lse = s->lse}};
    backend_run(be, &op);
  } else {
    int64_t qkv_dims[5] = {b, t, 3, h, hd};
    permute(be, 5, qkv_dims, to_heads, s->qkv, s->heads);
    heads_forward_materialized(l, pass, s->heads, s->heads + b * t * c, s->heads + 2 * b * t * c);
    int64_t att_dims[4] = {b, h, t, hd};
    permute(be, 4, att_dims, swap_th, s->att, s->merged);
  }
  dense_forward(be, b * t, c, c, s->merged, w + l->tensors[2].offset, layer_w16(l, pass, 1), w + l->tensors[3].offset,
                l->y, NULL, 0, l->heads16, 0);
}

/* Materialised: dq, dk, dv (each (B*H, T, hd)) from d_att through the (B*H, T, T) buffers. */
static void heads_backward_materialized(dt_layer *l, dt_pass *pass, const float *q, const float *k, const float *v,
                                        float *dq, float *dk, float *dv) {
  attention_state *s = l->priv;
  dt_backend *be = pass->be;
  const int64_t t = l->in.h, hd = l->in.c / l->args.heads, bh = pass->batch * l->args.heads;
  const float *kept = s->kept ? s->kept : s->probs;
  float *d_probs = s->d_probs ? s->d_probs : s->d_kept;
  batched_gemm(be, bh, 0, 1, t, t, hd, s->d_att, v, s->d_kept); /* d kept (T, T) = d att v^T */
  batched_gemm(be, bh, 1, 0, t, hd, t, kept, s->d_att, dv);     /* dv (T, hd) = kept^T d att */
  if (s->d_probs) {
    dt_op d = {.type = DT_OP_DROPOUT_BWD,
               .p.dropout_bwd = {.n = bh * t * t,
                                 .p = (float)l->args.p,
                                 .seed = attention_seed(l),
                                 .step_seed = pass->step_seed,
                                 .dy = s->d_kept,
                                 .dx = d_probs}};
    backend_run(be, &d);
  }
  dt_op sm = {.type = DT_OP_SOFTMAX_BWD,
              .p.softmax_bwd = {.rows = bh * t,
                                .t = t,
                                .causal = l->args.causal,
                                .scale = 1.0f / sqrtf((float)hd),
                                .y = s->probs,
                                .dy = d_probs,
                                .dx = s->d_scores}};
  backend_run(be, &sm);
  batched_gemm(be, bh, 0, 0, t, hd, t, s->d_scores, k, dq); /* dq = dS k */
  batched_gemm(be, bh, 1, 0, t, hd, t, s->d_scores, q, dk); /* dk = dS^T q */
}

static void attention_backward(dt_layer *l, dt_pass *pass, const float *x, float *dx) {
  attention_state *s = l->priv;
  dt_backend *be = pass->be;
  const float *w = pass->params;
  float *g = pass->grads;
  const int64_t b = pass->batch, t = l->in.h, c = l->in.c, h = l->args.heads, hd = c / h;
  dense_backward(be, b * t, c, c, s->merged, w + l->tensors[2].offset, layer_w16(l, pass, 1), l->dy, NULL,
                 g + l->tensors[2].offset, g + l->tensors[3].offset, s->d_merged, NULL, l->heads16, 0);
  if (l->fused_attention) {
    dt_op op = {.type = DT_OP_ATTENTION_BWD,
                .p.attention_bwd = {.g = fused_geom(l, pass),
                                    .q = s->qkv,
                                    .k = element(s->qkv, c, l->heads16),
                                    .v = element(s->qkv, 2 * c, l->heads16),
                                    .o = s->merged,
                                    .lse = s->lse,
                                    .dout = s->d_merged,
                                    .delta = s->delta,
                                    .dq = s->d_qkv,
                                    .dk = element(s->d_qkv, c, l->heads16),
                                    .dv = element(s->d_qkv, 2 * c, l->heads16)}};
    backend_run(be, &op);
  } else {
    int64_t merged_dims[4] = {b, t, h, hd};
    permute(be, 4, merged_dims, swap_th, s->d_merged, s->d_att);
    const float *q = s->heads, *k = s->heads + b * t * c, *v = s->heads + 2 * b * t * c;
    heads_backward_materialized(l, pass, q, k, v, s->d_heads, s->d_heads + b * t * c, s->d_heads + 2 * b * t * c);
    int64_t head_dims[5] = {3, b, h, t, hd};
    permute(be, 5, head_dims, from_heads, s->d_heads, s->d_qkv);
  }
  dense_backward(be, b * t, c, 3 * c, x, w + l->tensors[0].offset, layer_w16(l, pass, 0), s->d_qkv, NULL,
                 g + l->tensors[0].offset, g + l->tensors[1].offset, dx, NULL, l->x16, l->heads16);
}

/* Forward FLOPs per sample: the projections and the two products over heads. */
static int64_t attention_flops(const dt_layer *l) {
  int64_t t = l->in.h, c = l->in.c;
  return t * (2 * c * 3 * c + 2 * c * c) + 2 * 2 * t * t * c;
}

const dt_layer_ops dt_layer_attention = {.kind = "attention",
                                         .keys = attention_keys,
                                         .n_keys = 3,
                                         .setup = attention_setup,
                                         .init = dense_init, /* as two nn.Linear of C inputs */
                                         .alloc = attention_alloc,
                                         .forward = attention_forward,
                                         .backward = attention_backward,
                                         .flops = attention_flops,
                                         .memory = attention_memory,
                                         .row_values = attention_row_values,
                                         .causal = attention_causal,
                                         .pick = attention_pick,
                                         .traits = DT_LAYER_ATTENTION};
