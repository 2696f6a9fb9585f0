/* ops.c: the ops that run kernels/, one function per op grouped by the kernels/ file of its
 * family (as src/cpu/<family>.c): each checks that the kernels can index its tensors, grows the
 * partial-sum buffer where a fixed-order reduction needs one, and calls the kernel's C entry point
 * (kernels.h) on the backend's stream. */
#include "cuda_impl.h"

/* The kernels split indices with 32-bit fast division: main.c refuses larger tensors. */
#define CHECK_INDEXABLE(n) DT_ASSERT((int64_t)(n) < ((int64_t)1 << 31))

/* kernels/elementwise.cu */

void cuda_bias_add(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bias_add) *q = &op->p.bias_add;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  k_bias_add(im->stream, q->y, q->bias, q->b, q->c, q->s);
}

void cuda_bias_grad(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bias_grad) *q = &op->p.bias_grad;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  k_bias_grad(im->stream, q->dy, q->db, q->b, q->c, q->s);
}

void cuda_act_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.act_fwd) *q = &op->p.act_fwd;
  k_act_fwd(im->stream, q->kind, q->x, q->y, q->n);
}

void cuda_act_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.act_bwd) *q = &op->p.act_bwd;
  if (q->h16) {
    DT_ASSERT(q->kind == DT_ACT_RELU && q->h16 == cuda_format16(im));
    k_relu_bwd16(im->stream, (const uint16_t *)q->x, (const uint16_t *)q->dy, (uint16_t *)q->dx, q->n, q->h16);
    return;
  }
  k_act_bwd(im->stream, q->kind, q->x, q->y, q->dy, q->dx, q->n);
}

void cuda_dropout_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.dropout_fwd) *q = &op->p.dropout_fwd;
  k_dropout(im->stream, q->x, q->y, q->n, q->p, q->seed, q->step_seed);
}

/* the same mask on the gradient */
void cuda_dropout_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.dropout_bwd) *q = &op->p.dropout_bwd;
  k_dropout(im->stream, q->dy, q->dx, q->n, q->p, q->seed, q->step_seed);
}

void cuda_add(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.add) *q = &op->p.add;
  if (q->h16) {
    DT_ASSERT(q->h16 == cuda_format16(im));
    k_add16(im->stream, (const uint16_t *)q->a, (const uint16_t *)q->b, (uint16_t *)q->y, q->n, q->relu, q->h16);
    return;
  }
  k_add(im->stream, q->a, q->b, q->y, q->n, q->relu);
}

void cuda_scale(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.scale) *q = &op->p.scale;
  k_scale(im->stream, q->x, q->alpha, q->n);
}

/* A batchnorm statistics op's sums, forward or backward (kernels.h): its channels, the chunks its kernels sum
 * each channel's positions in, and the groups of channels that take tickets. 0: op is neither. */
typedef struct {
  int64_t c, chunks, groups;
} bn_sums_shape;
static int bn_sums_of(const dt_op *op, bn_sums_shape *bn) {
  int64_t n, c;
  int x16;
  if (op->type == DT_OP_BN_STATS)
    n = op->p.bn_stats.b * op->p.bn_stats.s, c = op->p.bn_stats.c, x16 = op->p.bn_stats.x16;
  else if (op->type == DT_OP_BN_BWD_STATS)
    n = op->p.bn_bwd_stats.b * op->p.bn_bwd_stats.s, c = op->p.bn_bwd_stats.c, x16 = op->p.bn_bwd_stats.x16;
  else
    return 0;
  *bn =
      (bn_sums_shape){.c = c, .chunks = x16 ? k_bn16_chunks(n, c) : k_bn_chunks(n), .groups = x16 ? (c + 31) / 32 : c};
  return 1;
}

size_t cuda_tickets_bytes(const dt_op *op) {
  bn_sums_shape bn;
  return bn_sums_of(op, &bn) ? (size_t)k_bn_tickets(bn.chunks, bn.groups) * sizeof(unsigned) : 0;
}

/* im->tickets grown to op's and zeroed where new (queued on the stream: its kernels follow). Grown during a
 * capture, the memset is the graph's, which train_step.c replays as soon as it is captured; a warm-up step
 * runs every op before a capture, so growing there is for a shape the warm-up did not see. */
static unsigned *tickets_for(cuda_impl *im, const dt_op *op) {
  const size_t need = cuda_tickets_bytes(op);
  if (need > im->tickets_bytes) {
    cuda_grow_device(im, (void **)&im->tickets, &im->tickets_bytes, need, "batchnorm tickets");
    CUDA_CHECK(cudaMemsetAsync(im->tickets, 0, need, im->stream));
  }
  return im->tickets;
}

size_t cuda_partials_bytes(const dt_op *op) {
  int64_t n = 0; /* doubles */
  bn_sums_shape bn;
  if (op->type == DT_OP_SUMSQ) {
    n = (int64_t)K_SUM_BLOCKS * 2;
  } else if (op->type == DT_OP_LN_BWD) {
    n = 2 * K_LN_CHUNKS * op->p.ln_bwd.d > 2 * K_SUM_BLOCKS ? 2 * K_LN_CHUNKS * op->p.ln_bwd.d : 2 * K_SUM_BLOCKS;
  } else if (bn_sums_of(op, &bn)) {
    n = k_bn_partials(bn.chunks, bn.c);
  } else if (op->type == DT_OP_GEMM && op->p.gemm.a_col_sums) {
    n = k_pack_bf16_rows_chunks(DT_GEMM_A_ROWS(&op->p.gemm), DT_GEMM_A_COLS(&op->p.gemm)) * DT_GEMM_A_COLS(&op->p.gemm);
  } else if (op->type == DT_OP_LOSS) {
    n = (op->p.loss.b > K_SUM_BLOCKS ? op->p.loss.b : K_SUM_BLOCKS) * 2;
  }
  return (size_t)n * sizeof(double);
}

void cuda_sumsq(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.sumsq) *q = &op->p.sumsq;
  double *pairs =
      cuda_grow_device(im, (void **)&im->partials, &im->partials_bytes, cuda_partials_bytes(op), "sums of squares");
  k_sumsq(im->stream, q->x, q->n, q->out, pairs);
}

void cuda_clip(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.clip) *q = &op->p.clip;
  k_clip(im->stream, q->x, q->n, q->max_norm, q->sumsq);
}

void cuda_copy(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.copy) *q = &op->p.copy;
  if (q->n) CUDA_CHECK(cudaMemcpyAsync(q->y, q->x, (size_t)q->n * sizeof(float), cudaMemcpyDeviceToDevice, im->stream));
}

void cuda_weights16(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.weights16) *q = &op->p.weights16;
  k_weights16(im->stream, q->params, q->w16, q->table, q->n, q->rows);
}

void cuda_grads16(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.grads16) *q = &op->p.grads16;
  k_grads16(im->stream, q->grads, q->g16, q->table, q->n, q->rows);
}

void cuda_input(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.input) *q = &op->p.input;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  DT_ASSERT(!q->x16 || q->x16 == cuda_format16(im));
  k_input(im->stream, q->raw, q->x, q->x16, q->b, q->c, q->s, q->scale, q->mean, q->std);
}

void cuda_gather(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.gather) *q = &op->p.gather;
  CHECK_INDEXABLE(q->n * q->row);
  k_gather(im->stream, q->type, q->src, q->idx, q->out, q->n, q->row);
}

/* kernels/norm.cu: batchnorm, layernorm */

/* A batchnorm's x16 input (backend.h): the 16-bit format this run's convolutions write. */
static const uint16_t *x16_of(const cuda_impl *im, const float *x, int format) {
  DT_ASSERT(format == cuda_format16(im));
  return (const uint16_t *)x;
}

void cuda_bn_stats(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_stats) *q = &op->p.bn_stats;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  double *partials =
      cuda_grow_device(im, (void **)&im->partials, &im->partials_bytes, cuda_partials_bytes(op), "batchnorm sums");
  const dt_bn_finalize_args *f = q->finalize;
  DT_ASSERT(!f || (f->training && f->sums == q->sums && f->c == q->c));
  const k_bn_fin fin =
      f ? (k_bn_fin){f->momentum, f->eps, f->mean, f->invstd, f->running_mean, f->running_var} : (k_bn_fin){0};
  unsigned *tickets = tickets_for(im, op);
  if (q->x16)
    k_bn16_stats(im->stream, x16_of(im, q->x, q->x16), q->x16, q->b, q->c, q->s, q->sums, partials, tickets, fin);
  else
    k_bn_stats(im->stream, q->x, q->b, q->c, q->s, q->sums, partials, tickets, fin);
}

void cuda_bn_finalize(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_finalize) *q = &op->p.bn_finalize;
  k_bn_finalize(im->stream, q->c, q->training, q->momentum, q->eps, q->sums, q->mean, q->invstd, q->running_mean,
                q->running_var);
}

void cuda_bn_apply(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_apply) *q = &op->p.bn_apply;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  DT_ASSERT(!q->y16 || q->y16 == q->x16);
  if (q->x16)
    k_bn16_apply(im->stream, q->relu, x16_of(im, q->x, q->x16), q->x16, q->y, q->y16, q->b, q->c, q->s, q->mean,
                 q->invstd, q->gamma, q->beta);
  else
    k_bn_apply(im->stream, q->relu, q->x, q->y, q->b, q->c, q->s, q->mean, q->invstd, q->gamma, q->beta);
}

void cuda_bn_bwd_stats(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_bwd_stats) *q = &op->p.bn_bwd_stats;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  double *partials = cuda_grow_device(im, (void **)&im->partials, &im->partials_bytes, cuda_partials_bytes(op),
                                      "batchnorm gradient sums");
  DT_ASSERT(!q->dy16 || q->dy16 == q->x16);
  unsigned *tickets = tickets_for(im, op);
  if (q->x16)
    k_bn16_bwd_stats(im->stream, q->relu, x16_of(im, q->x, q->x16), q->x16, q->dy, q->dy16, q->b, q->c, q->s, q->mean,
                     q->invstd, q->gamma, q->beta, q->sums, q->dgamma, q->dbeta, partials, tickets);
  else
    k_bn_bwd_stats(im->stream, q->relu, q->x, q->dy, q->b, q->c, q->s, q->mean, q->invstd, q->gamma, q->beta, q->sums,
                   q->dgamma, q->dbeta, partials, tickets);
}

void cuda_bn_bwd_apply(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.bn_bwd_apply) *q = &op->p.bn_bwd_apply;
  CHECK_INDEXABLE(q->b * q->c * q->s);
  DT_ASSERT(!q->dy16 || q->dy16 == q->x16);
  if (q->x16)
    k_bn16_bwd_apply(im->stream, q->relu, x16_of(im, q->x, q->x16), q->x16, q->dy, q->dy16, (uint16_t *)q->dx, q->b,
                     q->c, q->s, q->count, q->mean, q->invstd, q->gamma, q->beta, q->sums);
  else
    k_bn_bwd_apply(im->stream, q->relu, q->x, q->dy, q->dx, q->b, q->c, q->s, q->count, q->mean, q->invstd, q->gamma,
                   q->beta, q->sums);
}

void cuda_ln_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.ln_fwd) *q = &op->p.ln_fwd;
  CHECK_INDEXABLE(q->n * q->d);
  DT_ASSERT(!q->y16 || q->y16 == DT_F16_BF16);
  k_ln_fwd(im->stream, q->x, q->gamma, q->beta, q->y, q->y16, q->mean, q->rstd, q->n, q->d, q->eps);
}

void cuda_ln_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.ln_bwd) *q = &op->p.ln_bwd;
  CHECK_INDEXABLE(q->n * q->d);
  if (!q->n) return;
  double *partials =
      cuda_grow_device(im, (void **)&im->partials, &im->partials_bytes, cuda_partials_bytes(op), "layernorm sums");
  DT_ASSERT(!q->dy16 || q->dy16 == DT_F16_BF16);
  k_ln_bwd(im->stream, q->x, q->dy, q->dy16, q->gamma, q->mean, q->rstd, q->dx, q->dx_add, q->dgamma, q->dbeta, q->n,
           q->d, partials);
}

/* kernels/pool.cu */

void cuda_pool_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.pool_fwd) *q = &op->p.pool_fwd;
  CHECK_INDEXABLE(q->b * q->c * q->h * q->w);
  if (q->nhwc16) {
    DT_ASSERT(q->kind == DT_POOL_MAX);
    k_pool16_fwd(im->stream, (const uint16_t *)q->x, (uint16_t *)q->y, q->argmax, q->b, q->c, q->h, q->w, q->k,
                 q->stride, q->ho, q->wo, q->nhwc16 == DT_F16_BF16);
    return;
  }
  k_pool_fwd(im->stream, q->kind, q->x, q->y, q->argmax, q->b, q->c, q->h, q->w, q->k, q->stride, q->ho, q->wo);
}

void cuda_pool_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.pool_bwd) *q = &op->p.pool_bwd;
  CHECK_INDEXABLE(q->b * q->c * q->h * q->w);
  if (q->nhwc16) {
    DT_ASSERT(q->kind == DT_POOL_MAX);
    k_pool16_bwd(im->stream, (const uint16_t *)q->dy, q->argmax, (uint16_t *)q->dx, q->b, q->c, q->h, q->w, q->k,
                 q->stride, q->ho, q->wo, q->nhwc16 == DT_F16_BF16);
    return;
  }
  k_pool_bwd(im->stream, q->kind, q->dy, q->argmax, q->dx, q->b, q->c, q->h, q->w, q->k, q->stride, q->ho, q->wo);
}

void cuda_gap16_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.gap16_fwd) *q = &op->p.gap16_fwd;
  CHECK_INDEXABLE(q->b * q->s * q->c);
  DT_ASSERT(q->format == cuda_format16(im));
  k_gap16_fwd(im->stream, q->x, q->format, q->y, q->b, q->s, q->c);
}

void cuda_gap16_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.gap16_bwd) *q = &op->p.gap16_bwd;
  CHECK_INDEXABLE(q->b * q->s * q->c);
  DT_ASSERT(q->format == cuda_format16(im));
  k_gap16_bwd(im->stream, q->dy, q->dx, q->format, q->b, q->s, q->c);
}

/* kernels/loss.cu */

void cuda_loss(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.loss) *q = &op->p.loss;
  double *pairs =
      cuda_grow_device(im, (void **)&im->partials, &im->partials_bytes, cuda_partials_bytes(op), "loss sums");
  DT_ASSERT(!q->logits16 ||
            (q->logits16 == DT_F16_BF16 && (uintptr_t)q->logits % 16 == 0 && (uintptr_t)q->dlogits % 16 == 0));
  k_loss(im->stream, q->kind, q->logits, q->logits16, q->labels, q->targets, q->dlogits, q->b, q->k, q->label_smoothing,
         q->ignore ? q->ignore_index : -1, q->weight, q->weight_dev, q->grad_scale, q->distill, q->alpha,
         q->temperature, q->teacher, q->sums, pairs);
}

/* kernels/optim.cu: optimizer steps, fp16 loss scaling, EMA */

void cuda_sgd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.sgd) *q = &op->p.sgd;
  DT_ASSERT(!q->runs || q->n_runs > 0); /* and the first run at 0 (optim_set_runs; the CPU's op checks it) */
  k_sgd(im->stream, q->param, q->grad, q->mom, q->n, q->hyper, q->skip, q->nonfinite, q->momentum, q->weight_decay,
        q->runs, q->n_runs, q->nesterov);
}

void cuda_adamw(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.adamw) *q = &op->p.adamw;
  DT_ASSERT(!q->runs || q->n_runs > 0); /* as cuda_sgd's */
  k_adamw(im->stream, q->param, q->grad, q->m, q->v, q->n, q->hyper, q->skip, q->nonfinite, q->beta1, q->beta2, q->eps,
          q->weight_decay, q->runs, q->n_runs);
}

void cuda_unscale(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.unscale) *q = &op->p.unscale;
  CHECK_INDEXABLE(q->n);
  if (q->n) k_unscale(im->stream, q->x, q->n, q->scaler);
}

void cuda_scaler_update(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.scaler_update) *q = &op->p.scaler_update;
  k_scaler_update(im->stream, q->scaler, q->overflow, q->growth_interval, q->growth, q->backoff);
}

void cuda_ema(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.ema) *q = &op->p.ema;
  CHECK_INDEXABLE(q->n);
  k_ema(im->stream, q->ema, q->x, q->n, q->decay);
}

/* kernels/transformer.cu: embeddings, softmax, permute */

void cuda_embed_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.embed_fwd) *q = &op->p.embed_fwd;
  CHECK_INDEXABLE(q->n * q->d);
  CHECK_INDEXABLE(q->vocab * q->d);
  k_embed_fwd(im->stream, q->tokens, q->wte, q->wpe, q->y, q->n, q->t, q->d);
}

void cuda_embed_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.embed_bwd) *q = &op->p.embed_bwd;
  CHECK_INDEXABLE(q->n * q->d);
  CHECK_INDEXABLE(q->vocab * q->d);
  k_embed_bwd(im->stream, q->tokens, q->dy, q->dwte, q->dwpe, q->n, q->t, q->d, q->vocab);
}

void cuda_softmax_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.softmax_fwd) *q = &op->p.softmax_fwd;
  CHECK_INDEXABLE(q->rows * q->t);
  k_softmax_fwd(im->stream, q->x, q->y, q->rows, q->t, q->causal, q->scale);
}

void cuda_softmax_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.softmax_bwd) *q = &op->p.softmax_bwd;
  CHECK_INDEXABLE(q->rows * q->t);
  k_softmax_bwd(im->stream, q->y, q->dy, q->dx, q->rows, q->t, q->causal, q->scale);
}

void cuda_permute(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.permute) *q = &op->p.permute;
  DT_ASSERT(q->ndim >= 2 && q->ndim <= 5);
  int64_t total = 1;
  int seen = 0;
  for (int i = 0; i < q->ndim; i++) {
    DT_ASSERT(q->perm[i] >= 0 && q->perm[i] < q->ndim && !(seen & (1 << q->perm[i])));
    seen |= 1 << q->perm[i];
    total *= q->dims[i];
  }
  CHECK_INDEXABLE(total);
  k_permute(im->stream, q->x, q->y, q->ndim, q->dims, q->perm);
}

/* kernels/attention.cu: fused attention */

/* A head the kernels take, rows that hold the heads, buffers they can index. */
static void check_attention_geom(const dt_attention_geom *g) {
  DT_ASSERT(g->hd >= 1 && g->hd <= DT_ATTENTION_MAX_HD && g->ld_qkv >= g->h * g->hd && g->ld_o >= g->h * g->hd &&
            (!g->io16 || g->io16 == DT_F16_BF16));
  CHECK_INDEXABLE(g->b * g->t * g->ld_qkv);
  CHECK_INDEXABLE(g->b * g->t * g->ld_o);
}

void cuda_attention_fwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.attention_fwd) *q = &op->p.attention_fwd;
  const dt_attention_geom *g = &q->g;
  check_attention_geom(g);
  CUDA_CHECK(k_attention_fwd(im->stream, g, im->attention_tc, q->q, q->k, q->v, q->o, q->lse));
}

void cuda_attention_bwd(cuda_impl *im, const dt_op *op) {
  const typeof(op->p.attention_bwd) *q = &op->p.attention_bwd;
  const dt_attention_geom *g = &q->g;
  check_attention_geom(g);
  CUDA_CHECK(k_attention_bwd(im->stream, g, im->attention_tc, q->q, q->k, q->v, q->o, q->lse, q->dout, q->delta, q->dq,
                             q->dk, q->dv));
}
